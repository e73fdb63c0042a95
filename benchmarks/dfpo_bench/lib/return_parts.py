"""An archive too large to come back from the GPU machine in one file, split into parts there and joined here.

Why: a file over 16 MiB under ``$OUT`` does not come back from the device machine (at most 8 files, 16 MiB each,
64 MiB together). Study v4 part 3's run folder (revision 2) passed 18 MB packed in its fourth session, and a poll
returned nothing. ``split`` leaves an archive at or under the part size as it is; a larger one becomes ``NAME.part_0``,
``NAME.part_1``, ... beside ``NAME.sha256`` (``sha256sum``'s format), and ``join`` rebuilds ``NAME`` and checks it.

    python -m dfpo_bench.lib.return_parts split $OUT/study_v4_long.tgz          # on the machine, after packing
    python -m dfpo_bench.lib.return_parts join FILES_AT study_v4_long.tgz DEST  # here: DEST/study_v4_long.tgz
"""
from __future__ import annotations

import argparse
import pathlib
import re

from dfpo_bench.lib.provenance import file_sha256

PART_BYTES = 15 * 1024 * 1024  # under the machine's 16 MiB per returned file, with room to spare


def parts_of(folder: pathlib.Path, name: str) -> list[pathlib.Path]:
    """``name``'s parts in ``folder`` in joining order, by number (``part_10`` after ``part_9``)."""
    pattern = re.compile(re.escape(name) + r"\.part_(\d+)")
    numbered = {int(m.group(1)): p for p in folder.iterdir() if (m := pattern.fullmatch(p.name))}
    return [numbered[n] for n in sorted(numbered)]


def split(archive: pathlib.Path, part_bytes: int = PART_BYTES) -> list[pathlib.Path]:
    """Split ``archive`` into parts of at most ``part_bytes`` beside ``NAME.sha256`` and remove it; an archive of at
    most ``part_bytes`` stays whole. Returns the files that now carry it."""
    if part_bytes <= 0:
        raise ValueError(f"part_bytes must be positive, got {part_bytes}")
    if archive.stat().st_size <= part_bytes:
        return [archive]
    (archive.parent / f"{archive.name}.sha256").write_text(f"{file_sha256(archive)}  {archive.name}\n")
    parts = []
    with archive.open("rb") as f:
        while block := f.read(part_bytes):
            part = archive.parent / f"{archive.name}.part_{len(parts)}"
            part.write_bytes(block)
            parts.append(part)
    archive.unlink()
    return parts


def join(folder: pathlib.Path, name: str, dest: pathlib.Path) -> pathlib.Path:
    """``dest / name`` rebuilt from what came back in ``folder``: the file itself if it came whole, else its parts
    joined in order and checked against ``NAME.sha256``. Raises FileNotFoundError when neither the file nor its parts
    and hash are there, ValueError when the joined bytes do not hash as recorded (a part missing or cut)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / name
    whole = folder / name
    if whole.is_file():
        out.write_bytes(whole.read_bytes())
        return out
    parts, recorded = parts_of(folder, name), folder / f"{name}.sha256"
    if not parts or not recorded.is_file():
        raise FileNotFoundError(f"{folder} holds neither {name} nor its parts {name}.part_N with {name}.sha256")
    with out.open("wb") as f:
        for part in parts:
            f.write(part.read_bytes())
    expected, got = recorded.read_text().split()[0], file_sha256(out)
    if got != expected:
        out.unlink()
        raise ValueError(f"{len(parts)} part(s) of {name} in {folder} join to SHA-256 {got[:12]}…, not the recorded "
                         f"{expected[:12]}…: a part is missing or cut; fetch the parts again")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("split", help="split ARCHIVE into parts beside its SHA-256 if it is over the part size")
    sp.add_argument("archive", type=pathlib.Path)
    sp.add_argument("--part-bytes", type=int, default=PART_BYTES)
    jn = sub.add_parser("join", help="rebuild NAME from FOLDER (whole or parts) into DEST and check its SHA-256")
    jn.add_argument("folder", type=pathlib.Path)
    jn.add_argument("name")
    jn.add_argument("dest", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        print("\n".join(str(p) for p in split(args.archive, args.part_bytes)))
    else:
        print(join(args.folder, args.name, args.dest))


if __name__ == "__main__":
    main()
