"""The repository's figures docs/source/concepts/architecture.md states, measured so that one command re-checks them:
``python -m dfpo_bench.structure_figures [--root DIR] [--out PATH]`` prints them as JSON (CPU, seconds).

* **Hand-written lines.** The files git tracks (``git ls-files`` of the checkout holding ``--root``, default the
  current directory; a folder outside git is refused), read from the work tree. Left out: symbolic links,
  submodules, tracked files missing from the work tree, anything under a ``results`` folder inside ``benchmarks/``
  (run outputs), and every file not of a hand-written kind: the suffixes :data:`TEXT_SUFFIXES`, extensionless files
  starting with ``#!``, and notebooks, which count only their cells' source lines. Every physical line counts (a last
  line without a newline too); ``nonblank`` beside it. Parts by the path's first folder (:data:`PARTS`, else
  ``other``). Figures: the product's (``dfpo_trl/``) share of all lines, and the ``.py`` lines of ``tests/`` and
  ``benchmarks/`` together over the product's.
* **The tracked size**: the bytes of the tracked files present in the work tree (``git ls-files -z | xargs -0 du
  -cb``; a symbolic link counts its own size).
* **The README's length**: the physical lines of ``README.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

TEXT_SUFFIXES = frozenset({".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".ini", ".txt", ".sbatch"})
PARTS = ("dfpo_trl", "tests", "benchmarks", "docs", "recipes", "examples", "notebooks")
COUNTS = ("files", "lines", "nonblank", "python_files", "python_lines")
DEFINITION = (
    "tracked files (git ls-files) read from the work tree; left out: anything under a 'results' folder in "
    "benchmarks/, symlinks, submodules, and files not of a hand-written kind (" + " ".join(sorted(TEXT_SUFFIXES))
    + ", extensionless '#!' scripts, and .ipynb counted by its cells' source lines only); every physical line counts")


class NotAGitCheckout(RuntimeError):
    """The line count reads what git tracks: a folder that is not a git checkout has no such list."""


def git(where: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as err:
        raise NotAGitCheckout("git is not installed: the hand-written lines are the files git tracks") from err
    if done.returncode != 0:
        raise NotAGitCheckout(f"{where} is not a git checkout (git {' '.join(args)}: {done.stderr.strip()}); the "
                              "hand-written lines are the files git tracks, so --root must be (inside) a git checkout")
    return done.stdout


def line_counts(text: str) -> tuple[int, int]:
    """(physical lines, non-blank lines)."""
    rows = text.removesuffix("\n").split("\n") if text else []
    return len(rows), sum(1 for row in rows if row.strip())


def hand_written_lines(path: str, raw: bytes) -> tuple[int, int] | None:
    """(lines, non-blank lines) of a file of a hand-written kind, None for any other file."""
    suffix = PurePosixPath(path).suffix.lower()
    if suffix == ".ipynb":  # the cells' sources; outputs and metadata are not written by hand
        counts = [line_counts("".join(cell.get("source", ""))) for cell in json.loads(raw).get("cells", [])]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)
    if suffix in TEXT_SUFFIXES or (suffix == "" and raw.startswith(b"#!")):
        return line_counts(raw.decode("utf-8", errors="replace"))
    return None


def count_lines(root: Path) -> dict[str, Any]:
    """The hand-written lines of the checkout holding ``root`` by part, and what was left out (files by reason)."""
    top = Path(git(root, "rev-parse", "--show-toplevel").strip())
    try:
        commit = git(top, "rev-parse", "--verify", "-q", "HEAD").strip()
    except NotAGitCheckout:  # a repository without a commit yet
        commit = ""
    parts = {name: dict.fromkeys(COUNTS, 0) for name in (*PARTS, "other")}
    excluded: dict[str, int] = {}
    for entry in filter(None, git(top, "ls-files", "-s", "-z").split("\0")):
        meta, path = entry.split("\t", 1)  # "mode sha stage\tpath": 120000 symlink, 160000 submodule
        names, file = PurePosixPath(path).parts, top / path
        if meta.split()[0] in ("120000", "160000"):
            reason = "symlink or submodule"
        elif names[0] == "benchmarks" and "results" in names[1:-1]:
            reason = "benchmarks results"
        elif not file.is_file():
            reason = "missing from the work tree"
        elif (counts := hand_written_lines(path, file.read_bytes())) is None:
            reason = "not a hand-written kind"
        else:
            python = PurePosixPath(path).suffix == ".py"
            part = parts[names[0] if len(names) > 1 and names[0] in PARTS else "other"]
            for key, value in zip(COUNTS, (1, *counts, int(python), counts[0] * python), strict=True):
                part[key] += value
            continue
        excluded[reason] = excluded.get(reason, 0) + 1
    total = {key: sum(part[key] for part in parts.values()) for key in COUNTS}
    product = parts["dfpo_trl"]
    checking = parts["tests"]["python_lines"] + parts["benchmarks"]["python_lines"]
    return {
        "definition": DEFINITION, "root": str(top), "commit": commit,
        "uncommitted_changes": bool(git(top, "status", "--porcelain", "--untracked-files=no").strip()),
        "parts": parts, "total": total, "product_lines": product["lines"],
        "product_share": round(product["lines"] / max(total["lines"], 1), 4),
        "product_share_nonblank": round(product["nonblank"] / max(total["nonblank"], 1), 4),
        "python": {"product_lines": product["python_lines"], "tests_lines": parts["tests"]["python_lines"],
                   "benchmarks_lines": parts["benchmarks"]["python_lines"],
                   "tests_and_benchmarks_over_product": round(checking / max(product["python_lines"], 1), 3)},
        "excluded_files": dict(sorted(excluded.items()))}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure the figures, print them as JSON (and write them to ``--out``); returns them."""
    parser = argparse.ArgumentParser(prog="python -m dfpo_bench.structure_figures", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="a folder of the git checkout to count")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    try:
        lines = count_lines(args.root)
    except NotAGitCheckout as err:
        parser.error(str(err))
    top = Path(lines["root"])
    size = sum(p.lstat().st_size for name in git(top, "ls-files", "-z").split("\0") if name
               if (p := top / name).is_symlink() or p.exists())
    readme = top / "README.md"
    readme_lines = line_counts(readme.read_text())[0] if readme.is_file() else None
    summary = [
        f"dfpo_trl/ is {lines['product_lines'] / 1000:.1f}k of {lines['total']['lines'] / 1000:.1f}k hand-written "
        f"lines ({lines['product_share']:.0%}); the .py lines of tests/ and benchmarks/ are "
        f"{lines['python']['tests_and_benchmarks_over_product']:.1f}x dfpo_trl/'s",
        f"git tracks {size / 2**20:.1f} MiB ({size} bytes)",
        f"README.md has {readme_lines} lines" if readme_lines is not None else "no README.md"]
    figures = {"summary": summary, "lines": lines, "tracked_bytes": size, "readme_lines": readme_lines}
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return figures


if __name__ == "__main__":
    main()
