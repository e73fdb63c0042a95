"""Paths the file system cannot take (``OSError: File name too long`` on any use): ``output_dir`` and
``resume_from_checkpoint`` refused in one line naming the field, where it was set and its length, nothing created."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from dfpo_trl.cli.args import RecipeError
from dfpo_trl.cli.paths import check_output_dir, resolve_resume_checkpoint, shown_path, too_long
from dfpo_trl.cli.precheck import stored_field_table


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


ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "trl", "datasets", "accelerate")
NOBODY = 65534


def _as_non_root() -> list[str] | None:
    """The command prefix that runs a command as a user the permission bits apply to: none needed when this is not
    root; as root, setpriv to nobody (root ignores the bits, so a chmod 555 folder says nothing to it); None when
    there is no way."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    probe = subprocess.run([setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                            "-c", "import dfpo_trl.cli.main"], capture_output=True, text=True, timeout=120,
                           cwd="/", env={**os.environ, "PYTHONPATH": str(ROOT)})
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if probe.returncode == 0 else None



@pytest.mark.skipif(stored_field_table() is None, reason="refusals before torch need the stored field table, "
                    "which is for other library versions")
def test_an_output_dir_a_non_root_user_cannot_write_is_one_line_before_torch() -> None:
    """`--output_dir` inside a chmod 555 folder, run as a user the bits apply to (nobody, when the tests run as
    root): refused in one line naming the flag and the fix, exit 2, torch, transformers and TRL never imported, and
    nothing created there."""
    prefix = _as_non_root()
    if prefix is None:
        pytest.skip("running as root without a way to become another user (setpriv), or that user cannot read "
                    "the checkout")
    base = Path(tempfile.mkdtemp(prefix="dfpo-nonroot-"))  # not pytest's tmp_path: it is private to its owner
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir()
        recipe = base / "recipe.yaml"
        recipe.write_text("use_cpu: true\nmax_steps: 4\n")
        recipe.chmod(0o644)
        locked.chmod(0o555)
        target = locked / "out"
        script = textwrap.dedent(f"""
            import contextlib, io, json, sys
            from dfpo_trl.cli.main import main
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                code = main([{str(recipe)!r}, "--output_dir", {str(target)!r}])
            print(json.dumps([code, err.getvalue(), sorted(m for m in {HEAVY!r} if m in sys.modules)]))
        """)
        proc = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              cwd=base, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        code, err, imported = json.loads(proc.stdout)
        assert (code, imported) == (2, [])
        assert err == (f"dfpo-train: error: --output_dir on the command line: output_dir {str(target)!r} cannot be "
                       f"created (Permission denied in {str(locked)!r}); name a directory you can write, e.g. "
                       "--output_dir outputs/run1\n")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)
        shutil.rmtree(base)
