"""Layered records: packing a session's changes and unpacking every layer in order gives back the folder the session
left, byte for byte; a deletion, an empty layer and a missing first archive are refused by name."""
from __future__ import annotations

import pathlib
import tarfile

import pytest

from dfpo_bench.lib import record_layers


def write(root: pathlib.Path, files: dict[str, bytes]) -> pathlib.Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def first_archive(folder: pathlib.Path, root: pathlib.Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / record_layers.FIRST, "w:gz") as tar:
        tar.add(root / "tmp", arcname="tmp")


def contents(root: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_layers_unpacked_in_order_give_each_session_s_folder(tmp_path: pathlib.Path) -> None:
    results = tmp_path / "results"
    s1 = write(tmp_path / "s1", {"tmp/run/a.json": b"1", "tmp/run/log": b"one\n", "tmp/run/keep": b"k"})
    first_archive(results, s1)
    s2 = write(tmp_path / "s2", {**contents(s1), "tmp/run/log": b"one\ntwo\n", "tmp/run/b.json": b"2"})
    out, paths = record_layers.pack(s1, s2, results)
    assert out.name == "records_2.tgz" and paths == ["tmp/run/b.json", "tmp/run/log"]  # only what changed travels
    s3 = write(tmp_path / "s3", {**contents(s2), "tmp/run/log": b"one\ntwo\nthree\n", "tmp/run/c/d.json": b"3"})
    base = tmp_path / "base"
    record_layers.unpack(results, base)
    assert contents(base) == contents(s2)
    assert record_layers.pack(base, s3, results)[0].name == "records_3.tgz"
    again = tmp_path / "again"
    assert [p.name for p in record_layers.unpack(results, again)] == ["records.tgz", "records_2.tgz", "records_3.tgz"]
    assert contents(again) == contents(s3)


def test_layers_sort_by_number_not_by_text(tmp_path: pathlib.Path) -> None:
    for name in ["records_10.tgz", "records.tgz", "records_9.tgz", "records_2.tgz", "records_x.tgz", "notes.tgz"]:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in record_layers.layers(tmp_path)] == [
        "records.tgz", "records_2.tgz", "records_9.tgz", "records_10.tgz"]
    assert record_layers.next_layer(tmp_path).name == "records_11.tgz"


def test_a_deleted_file_an_empty_layer_and_no_first_archive_are_refused(tmp_path: pathlib.Path) -> None:
    results = tmp_path / "results"
    s1 = write(tmp_path / "s1", {"tmp/run/a.json": b"1", "tmp/run/gone.json": b"x"})
    first_archive(results, s1)
    s2 = write(tmp_path / "s2", {"tmp/run/a.json": b"changed"})
    with pytest.raises(ValueError, match=r"tmp/run/gone\.json.*cannot delete"):
        record_layers.pack(s1, s2, results)
    with pytest.raises(ValueError, match="no layer written"):
        record_layers.pack(s1, s1, results)
    assert [p.name for p in results.iterdir()] == ["records.tgz"]  # neither refusal wrote a file
    with pytest.raises(FileNotFoundError, match="records.tgz is missing"):
        record_layers.layers(tmp_path / "s1")


def test_the_command_line_lists_packs_and_unpacks(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    results = tmp_path / "results"
    s1 = write(tmp_path / "s1", {"tmp/run/a.json": b"1"})
    first_archive(results, s1)
    s2 = write(tmp_path / "s2", {"tmp/run/a.json": b"2"})
    record_layers.main(["pack", str(s1), str(s2), str(results)])
    record_layers.main(["list", str(results)])
    record_layers.main(["unpack", str(results), str(tmp_path / "out")])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"wrote {results / 'records_2.tgz'} (1 files")
    assert printed[1:3] == [str(results / "records.tgz"), str(results / "records_2.tgz")]
    assert contents(tmp_path / "out") == contents(s2)
