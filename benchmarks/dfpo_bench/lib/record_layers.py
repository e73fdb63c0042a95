"""A study's records across GPU sessions as layered archives: ``records.tgz`` (the first packing, whole) and then
``records_2.tgz``, ``records_3.tgz``, ..., one per later packing, each holding only the files added or changed since
the layers before it. Unpacked in order, the layers give the run folder as the last session left it.

Why layers: a study that runs across sessions used to repack its whole run folder each session, so every session
committed another full copy into the repository's history (14 MB by the third session). A layer costs what the
session added.

    python -m dfpo_bench.lib.record_layers list RESULTS_FOLDER              # the layers in order, one a line
    python -m dfpo_bench.lib.record_layers unpack RESULTS_FOLDER DEST       # every layer in order into DEST
    python -m dfpo_bench.lib.record_layers pack BASE NEW RESULTS_FOLDER      # NEW - BASE as the next layer

On the GPU machine: ``for f in $(python -m dfpo_bench.lib.record_layers list FOLDER); do tar xzf $f -C /; done``.

``BASE`` is the layers unpacked as committed, ``NEW`` the folder the session brought back (both roots the archives'
paths are relative to, e.g. ``tmp/v4long/...`` inside). A file in BASE that NEW lacks cannot be expressed by a layer
(unpacking never deletes), so ``pack`` refuses and names it.
"""
from __future__ import annotations

import argparse
import io
import pathlib
import re
import tarfile

from dfpo_bench.lib.provenance import tree_hashes

FIRST = "records.tgz"
LAYER = re.compile(r"records_(\d+)\.tgz")  # the N-th packing, N ≥ 2


def layers(folder: pathlib.Path) -> list[pathlib.Path]:
    """The folder's archives in unpacking order: ``records.tgz`` then ``records_N.tgz`` by N as a number (10 after
    9). Raises FileNotFoundError without ``records.tgz``: a later layer alone is not a run folder."""
    first = folder / FIRST
    if not first.is_file():
        raise FileNotFoundError(f"{first} is missing: the layers {folder}/records_N.tgz apply on top of it")
    numbered = {n: p for p in folder.glob("records_*.tgz") if (n := layer_number(p)) is not None}
    return [first, *(numbered[n] for n in sorted(numbered))]


def layer_number(path: pathlib.Path) -> int | None:
    """N of a ``records_N.tgz``; None for any other name (``records.tgz`` included)."""
    match = LAYER.fullmatch(path.name)
    return int(match.group(1)) if match else None


def describe(results: pathlib.Path, run_folder: str, held: str) -> str:
    """A report's sentence on where a run folder's records are (``results/run_folder``): its archives in unpacking
    order, ``held`` saying what they hold, and what the later ones hold; or that the repository lacks them."""
    try:
        names = [p.name for p in layers(results / run_folder)]
    except FileNotFoundError:
        return f"not in the repository (`results/{run_folder}/{FIRST}` is missing)"
    if len(names) == 1:
        return f"`results/{run_folder}/{names[0]}` ({held})"
    return (f"`results/{run_folder}/{names[0]}`, then " + ", ".join(f"`{n}`" for n in names[1:])
            + f" ({held}; each later archive holds only the files a later session added or changed, and `python -m "
            "dfpo_bench.lib.record_layers unpack` extracts them in order)")


def unpack(folder: pathlib.Path, dest: pathlib.Path) -> list[pathlib.Path]:
    """Extract every layer of ``folder`` into ``dest`` in order (a later layer's file replaces an earlier one's);
    returns the layers read."""
    found = layers(folder)
    for path in found:
        with tarfile.open(path) as tar:
            tar.extractall(dest, filter="data")
    return found


def changed_files(base: pathlib.Path, new: pathlib.Path) -> list[str]:
    """Paths (relative, sorted) of files in ``new`` that ``base`` lacks or holds with other bytes. Raises ValueError
    naming every file of ``base`` that ``new`` lacks: a layer cannot delete."""
    old, now = tree_hashes(base), tree_hashes(new)
    gone = sorted(set(old) - set(now))
    if gone:
        raise ValueError(f"{len(gone)} file(s) of the earlier layers are gone from {new}: {', '.join(gone[:5])}"
                         f"{' ...' if len(gone) > 5 else ''}; a layer cannot delete, so pack the folder whole as a "
                         "new records.tgz in a new results folder instead")
    return sorted(k for k in now if old.get(k) != now[k])


def next_layer(folder: pathlib.Path) -> pathlib.Path:
    """The name the folder's next layer takes: ``records_2.tgz`` after ``records.tgz`` alone, else one past the
    highest N."""
    numbers = [layer_number(p) for p in layers(folder)[1:]]
    return folder / f"records_{max(numbers, default=1) + 1}.tgz"


def pack(base: pathlib.Path, new: pathlib.Path, folder: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    """Write ``new - base`` as the folder's next layer (files in sorted order, owner and times zeroed so equal
    contents pack to equal archives up to gzip's header). Raises ValueError when nothing changed (an empty layer
    records nothing) or when a file was deleted (``changed_files``)."""
    paths = changed_files(base, new)
    if not paths:
        raise ValueError(f"{new} holds nothing that the layers of {folder} do not: no layer written")
    out = next_layer(folder)
    with tarfile.open(out, "w:gz") as tar:
        for rel in paths:
            data = (new / rel).read_bytes()
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    out.chmod(0o644)
    return out, paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="print RESULTS_FOLDER's layers in unpacking order, one a line")
    ls.add_argument("folder", type=pathlib.Path)
    un = sub.add_parser("unpack", help="extract every layer of RESULTS_FOLDER into DEST in order")
    un.add_argument("folder", type=pathlib.Path)
    un.add_argument("dest", type=pathlib.Path)
    pk = sub.add_parser("pack", help="write NEW - BASE as RESULTS_FOLDER's next layer")
    pk.add_argument("base", type=pathlib.Path)
    pk.add_argument("new", type=pathlib.Path)
    pk.add_argument("folder", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(str(p) for p in layers(args.folder)))
    elif args.command == "unpack":
        print("unpacked", ", ".join(p.name for p in unpack(args.folder, args.dest)), "into", args.dest)
    else:
        out, paths = pack(args.base, args.new, args.folder)
        print(f"wrote {out} ({len(paths)} files, {out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
