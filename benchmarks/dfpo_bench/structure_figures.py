"""The repository's figures the docs state (docs/source/concepts/architecture.md): how much of it is the product, how
many bytes git tracks, and how long the README is. Measured, not estimated, so that the sentences can be re-checked
with one command::

    python -m dfpo_bench.structure_figures [--root DIR] [--out PATH]

It prints one JSON object (and writes it to ``--out``). CPU only, a few seconds.

**1. Hand-written lines.** A line count is only a figure with its definition; this one is:

- *Which files*: the files git tracks (``git ls-files`` in the checkout ``--root``, default the repository holding
  the current directory; anything else is refused with a clear message), read from the work tree. Symbolic links,
  submodules and tracked files missing from the work tree are left out.
- *Generated or data files are left out*: everything under a ``results`` folder inside ``benchmarks/`` (run
  outputs, logs, archives), and every file not of a hand-written kind. The hand-written kinds are the suffixes
  :data:`TEXT_SUFFIXES` (``.py .md .yaml .yml .sh .toml .cfg .ini .txt .sbatch``), extensionless files that start
  with ``#!`` (scripts such as ``.ci/run``), and notebooks (``.ipynb``), which count **only the lines of their
  cells' sources** (code, markdown and raw cells; outputs and the JSON around them are left out). So JSON, JSONL,
  CSV, logs, images and archives never count, ``dfpo_trl/cli/field_table.json`` (generated) included.
- *Which lines*: every physical line of such a file (a last line without a newline counts), blank and comment
  lines included; ``nonblank`` is reported beside it.
- *Parts*: by the path's first folder: ``dfpo_trl`` (the product), ``tests``, ``benchmarks`` (its code and
  documents, results excluded), ``docs``, ``recipes``, ``examples``, ``notebooks``; everything else (the README,
  ``pyproject.toml``, ``.ci/``) is ``other``.
- *Figures*: the product's share of all hand-written lines, and, for ``.py`` files only, the lines of ``tests/`` and
  ``benchmarks/`` together divided by the lines of ``dfpo_trl/``.

**2. The tracked size.** The bytes of every tracked file present in the work tree (what ``git ls-files -z | xargs -0
du -cb`` sums; a symbolic link counts its own size), and **3. the README's length**: the physical lines of
``README.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

#: Suffixes of the hand-written text kinds (notebooks and extensionless ``#!`` scripts count too, see above).
TEXT_SUFFIXES = frozenset({".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".ini", ".txt", ".sbatch"})
NOTEBOOK_SUFFIX = ".ipynb"
PRODUCT = "dfpo_trl"
#: The parts a path's first folder names; anything else is ``other``.
PARTS = (PRODUCT, "tests", "benchmarks", "docs", "recipes", "examples", "notebooks")
OTHER = "other"
#: The parts whose ``.py`` lines are set against the product's: the code that tests and measures it.
CHECKING_PARTS = ("tests", "benchmarks")

DEFINITION = (
    "tracked files (git ls-files) read from the work tree; left out: anything under a 'results' folder in "
    "benchmarks/, symlinks, submodules, and files not of a hand-written kind ("
    + " ".join(sorted(TEXT_SUFFIXES))
    + ", extensionless '#!' scripts, and .ipynb counted by its cells' source lines only); every physical line counts"
)

# ------------------------------------------------------------------------------------------ hand-written lines
class NotAGitCheckout(RuntimeError):
    """The line count reads what git tracks: a folder that is not a git checkout has no such list."""


def _git(where: Path, *args: str) -> str:
    """``git -C where args`` its output; a clear :class:`NotAGitCheckout` when git fails or is missing."""
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, check=False)
    except FileNotFoundError as err:
        raise NotAGitCheckout("git is not installed: the hand-written lines are the files git tracks") from err
    if done.returncode != 0:
        raise NotAGitCheckout(
            f"{where} is not a git checkout (git {' '.join(args)}: {done.stderr.strip()}); the hand-written lines "
            "are the files git tracks, so --root must be (inside) a git checkout"
        )
    return done.stdout


def repository_root(start: Path) -> Path:
    """The top folder of the git checkout holding ``start`` (``git rev-parse --show-toplevel``)."""
    return Path(_git(Path(start), "rev-parse", "--show-toplevel").strip())


def part_of(path: str) -> str:
    """The part a repository path belongs to: its first folder when that is one of :data:`PARTS`, else ``other``."""
    parts = PurePosixPath(path).parts
    return parts[0] if len(parts) > 1 and parts[0] in PARTS else OTHER


def is_generated(path: str) -> bool:
    """Whether a path lies under a ``results`` folder of ``benchmarks/`` (run outputs: data, not writing)."""
    parts = PurePosixPath(path).parts
    return len(parts) > 2 and parts[0] == "benchmarks" and "results" in parts[1:-1]


def hand_written_kind(path: str, head: bytes) -> str | None:
    """``"text"``, ``"notebook"`` or None (not hand-written) for a file of this path starting with ``head``."""
    suffix = PurePosixPath(path).suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix == NOTEBOOK_SUFFIX:
        return "notebook"
    if suffix == "" and head.startswith(b"#!"):
        return "text"
    return None


def line_counts(text: str) -> tuple[int, int]:
    """(physical lines, non-blank lines) of a text: a last line without a newline counts, an empty text has none."""
    rows = text.split("\n")
    if rows[-1] == "":
        rows.pop()
    return len(rows), sum(1 for row in rows if row.strip())


def notebook_line_counts(raw: str) -> tuple[int, int]:
    """(lines, non-blank lines) of a notebook's cell sources, every cell type; outputs and metadata are not
    written by hand and do not count."""
    lines = nonblank = 0
    for cell in json.loads(raw).get("cells", []):
        source = cell.get("source", "")
        counts = line_counts("".join(source) if isinstance(source, list) else source)
        lines, nonblank = lines + counts[0], nonblank + counts[1]
    return lines, nonblank


@dataclass
class PartCount:
    """The hand-written files of one part and their lines; ``python_*`` counts its ``.py`` files alone."""

    files: int = 0
    lines: int = 0
    nonblank: int = 0
    python_files: int = 0
    python_lines: int = 0

    def add(self, other: PartCount) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


@dataclass
class LineCount:
    """The hand-written lines of a checkout by part, and what was left out (by reason, in files)."""

    root: str
    commit: str
    uncommitted_changes: bool
    parts: dict[str, PartCount] = field(default_factory=lambda: {p: PartCount() for p in (*PARTS, OTHER)})
    excluded: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> PartCount:
        total = PartCount()
        for count in self.parts.values():
            total.add(count)
        return total

    @property
    def product_share(self) -> float:
        """dfpo_trl/'s lines over all hand-written lines."""
        return self.parts[PRODUCT].lines / max(self.total.lines, 1)

    @property
    def checking_over_product(self) -> float:
        """The ``.py`` lines of tests/ and benchmarks/ together over dfpo_trl/'s ``.py`` lines."""
        checking = sum(self.parts[p].python_lines for p in CHECKING_PARTS)
        return checking / max(self.parts[PRODUCT].python_lines, 1)

    def as_dict(self) -> dict[str, Any]:
        total = self.total
        return {
            "definition": DEFINITION,
            "root": self.root,
            "commit": self.commit,
            "uncommitted_changes": self.uncommitted_changes,
            "parts": {name: asdict(count) for name, count in self.parts.items()},
            "total": asdict(total),
            "product_lines": self.parts[PRODUCT].lines,
            "product_share": round(self.product_share, 4),
            "product_share_nonblank": round(self.parts[PRODUCT].nonblank / max(total.nonblank, 1), 4),
            "python": {
                "product_lines": self.parts[PRODUCT].python_lines,
                **{f"{p}_lines": self.parts[p].python_lines for p in CHECKING_PARTS},
                "tests_and_benchmarks_over_product": round(self.checking_over_product, 3),
            },
            "excluded_files": dict(sorted(self.excluded.items())),
        }


def count_hand_written_lines(root: Path) -> LineCount:
    """The hand-written lines of the git checkout holding ``root`` (the module docstring's definition)."""
    top = repository_root(root)
    commit = _head(top)
    dirty = bool(_git(top, "status", "--porcelain", "--untracked-files=no").strip())
    count = LineCount(root=str(top), commit=commit, uncommitted_changes=dirty)

    def leave_out(reason: str) -> None:
        count.excluded[reason] = count.excluded.get(reason, 0) + 1

    # -s: "mode sha stage\tpath", to tell symlinks (120000) and submodules (160000) from files.
    for entry in _git(top, "ls-files", "-s", "-z").split("\0"):
        if not entry:
            continue
        meta, path = entry.split("\t", 1)
        if meta.split()[0] in ("120000", "160000"):
            leave_out("symlink or submodule")
            continue
        if is_generated(path):
            leave_out("benchmarks results")
            continue
        file = top / path
        if not file.is_file():
            leave_out("missing from the work tree")
            continue
        raw = file.read_bytes()
        kind = hand_written_kind(path, raw[:2])
        if kind is None:
            leave_out("not a hand-written kind")
            continue
        text = raw.decode("utf-8", errors="replace")
        lines, nonblank = notebook_line_counts(text) if kind == "notebook" else line_counts(text)
        is_python = PurePosixPath(path).suffix == ".py"
        count.parts[part_of(path)].add(PartCount(1, lines, nonblank, int(is_python), lines if is_python else 0))
    return count


def _head(top: Path) -> str:
    """The checkout's HEAD commit, or "" in a repository without one yet."""
    try:
        return _git(top, "rev-parse", "--verify", "-q", "HEAD").strip()
    except NotAGitCheckout:
        return ""


def tracked_bytes(root: Path) -> int:
    """The bytes of the tracked files present in the work tree (``git ls-files -z | xargs -0 du -cb``)."""
    top = repository_root(root)
    paths = [top / p for p in _git(top, "ls-files", "-z").split("\0") if p]
    return sum(p.lstat().st_size for p in paths if p.is_symlink() or p.exists())


# ------------------------------------------------------------------------------------------------------- main
def summary(lines: LineCount, size: int, readme_lines: int | None) -> list[str]:
    """The figures as the docs state them."""
    product, total = lines.parts[PRODUCT].lines, lines.total.lines
    return [
        f"dfpo_trl/ is {product / 1000:.1f}k of {total / 1000:.1f}k hand-written lines ({lines.product_share:.0%}); "
        f"the .py lines of tests/ and benchmarks/ are {lines.checking_over_product:.1f}x dfpo_trl/'s",
        f"git tracks {size / 2**20:.1f} MiB ({size} bytes)",
        f"README.md has {readme_lines} lines" if readme_lines is not None else "no README.md",
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure the figures, print them as JSON (and write them to ``--out``); returns them."""
    parser = argparse.ArgumentParser(
        prog="python -m dfpo_bench.structure_figures",
        description="The repository's figures: the product's share of the hand-written lines, the tracked size and "
        "the README's length (definitions: this module's docstring).",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="a folder of the git checkout to count (default: the one holding the current directory)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    try:
        lines = count_hand_written_lines(args.root if args.root is not None else Path.cwd())
    except NotAGitCheckout as err:
        parser.error(str(err))
    size = tracked_bytes(Path(lines.root))
    readme = Path(lines.root) / "README.md"
    readme_lines = line_counts(readme.read_text())[0] if readme.is_file() else None
    figures = {"summary": summary(lines, size, readme_lines), "lines": lines.as_dict(), "tracked_bytes": size,
               "readme_lines": readme_lines}
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return figures


if __name__ == "__main__":
    main()
