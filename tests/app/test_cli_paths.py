"""Paths the file system cannot take (``OSError: File name too long`` on any use): ``output_dir`` and
``resume_from_checkpoint`` refused in one line naming the field, where it was set and its length, nothing created."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dfpo_trl.app.args import RecipeError
from dfpo_trl.app.paths import check_output_dir, resolve_resume_checkpoint, shown_path, too_long


def test_paths_the_file_system_cannot_take(tmp_path: Path) -> None:
    """A folder name over NAME_MAX or a path over PATH_MAX: one line naming the field, nothing created."""
    for path in (tmp_path / ("c" * 300) / "x", tmp_path / "/".join(["d" * 250] * 20)):
        with pytest.raises(RecipeError, match=r"^--output_dir on the command line: output_dir .* is too long"):
            check_output_dir(str(path), "--output_dir on the command line")
        with pytest.raises(RecipeError, match=r"^resume_from_checkpoint in r\.yaml, line 2: resume_from_checkpoint .*"
                                              r"is too long"):
            resolve_resume_checkpoint(str(path), None, "resume_from_checkpoint in r.yaml, line 2")
    assert list(tmp_path.iterdir()) == []


def test_too_long_says_which_limit_and_passes_ordinary_paths(tmp_path: Path) -> None:
    assert too_long(str(tmp_path / "outputs" / "run1")) is None
    name_max, path_max = os.pathconf(tmp_path, "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    assert f"folder name in it has {name_max + 1} bytes" in too_long(str(tmp_path / ("e" * (name_max + 1))))
    assert too_long(str(tmp_path / ("e" * name_max))) is None
    deep = "/" + "/".join(["f" * 100] * (path_max // 101 + 1))
    assert f"over the file system's limit of {path_max - 1}" in too_long(deep)
    shown = shown_path("/" + "g" * 300)
    assert len(shown) < 120 and "(301 characters)" in shown
