"""Return parts: an archive over the part size splits into parts no larger than it, which join back byte for byte
and in numeric order; a missing or cut part is refused by its hash, and an archive within the size stays whole."""
from __future__ import annotations

import hashlib
import os
import pathlib
import shutil

import pytest

from dfpo_bench.lib import return_parts


def archive(folder: pathlib.Path, size: int, name: str = "run.tgz") -> tuple[pathlib.Path, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    (folder / name).write_bytes(data)
    return folder / name, data


def test_a_large_archive_splits_under_the_part_size_and_joins_back(tmp_path: pathlib.Path) -> None:
    path, data = archive(tmp_path / "out", 2500)
    parts = return_parts.split(path, part_bytes=1000)
    assert [p.name for p in parts] == ["run.tgz.part_0", "run.tgz.part_1", "run.tgz.part_2"]
    assert [p.stat().st_size for p in parts] == [1000, 1000, 500]
    assert not path.exists()  # only the parts and the hash travel
    assert (tmp_path / "out" / "run.tgz.sha256").read_text() == f"{hashlib.sha256(data).hexdigest()}  run.tgz\n"
    joined = return_parts.join(tmp_path / "out", "run.tgz", tmp_path / "here")
    assert joined == tmp_path / "here" / "run.tgz" and joined.read_bytes() == data


def test_parts_join_in_numeric_order(tmp_path: pathlib.Path) -> None:
    path, data = archive(tmp_path / "out", 1150)
    parts = return_parts.split(path, part_bytes=100)
    assert len(parts) == 12 and parts[10].name == "run.tgz.part_10"  # by name, part_10 would sort before part_2
    assert return_parts.join(tmp_path / "out", "run.tgz", tmp_path / "here").read_bytes() == data


def test_an_archive_within_the_part_size_stays_whole(tmp_path: pathlib.Path) -> None:
    path, data = archive(tmp_path / "out", 1000)
    assert return_parts.split(path, part_bytes=1000) == [path]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["run.tgz"]  # no hash, no parts
    assert return_parts.join(tmp_path / "out", "run.tgz", tmp_path / "here").read_bytes() == data


def test_a_missing_or_cut_part_is_refused_by_its_hash(tmp_path: pathlib.Path) -> None:
    path, _ = archive(tmp_path / "out", 2500)
    return_parts.split(path, part_bytes=1000)
    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "out", missing)
    (missing / "run.tgz.part_1").unlink()
    with pytest.raises(ValueError, match="2 part.* of run.tgz .* a part is missing or cut"):
        return_parts.join(missing, "run.tgz", tmp_path / "here")
    assert not (tmp_path / "here" / "run.tgz").exists()  # nothing half-joined is left to be read
    cut = tmp_path / "out" / "run.tgz.part_2"
    cut.write_bytes(cut.read_bytes()[:-1])
    with pytest.raises(ValueError, match="not the recorded"):
        return_parts.join(tmp_path / "out", "run.tgz", tmp_path / "here")


def test_nothing_to_join_and_a_bad_part_size_are_named(tmp_path: pathlib.Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither run.tgz nor its parts"):
        return_parts.join(tmp_path / "empty", "run.tgz", tmp_path / "here")
    path, _ = archive(tmp_path / "out", 10)
    with pytest.raises(ValueError, match="part_bytes must be positive, got 0"):
        return_parts.split(path, part_bytes=0)
    assert path.exists()


def test_the_command_line_splits_and_joins(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, data = archive(tmp_path / "out", 300)
    return_parts.main(["split", str(path), "--part-bytes", "128"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "out" / f"run.tgz.part_{i}") for i in range(3)]
    return_parts.main(["join", str(tmp_path / "out"), "run.tgz", str(tmp_path / "here")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "here" / "run.tgz")
    assert (tmp_path / "here" / "run.tgz").read_bytes() == data
