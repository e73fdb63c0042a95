"""The structure figures the README states: how much of the repository is the product, and how
deep one Min-Replace micro-step runs from TRL's ``compute_loss``. Measured, not estimated, so that the README's
sentences can be re-checked with one command::

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

**2. The hops of one Min-Replace micro-step.** A tiny trainer (``dfpo_trl.testing.tiny_trainer``, the GSPO setting
of the benchmarks' Min-Replace method, ``steps_per_generation=2`` so that the weights are off-policy and the transform
acts) trains one step under ``sys.setprofile``. The first time a function whose code is named ``min_replace`` and
whose file lies under the ``dfpo_trl`` package folder (found from ``dfpo_trl.__file__``: no internal module is
imported) is called below a frame of a function named ``compute_loss``, the Python stack from the nearest such frame
down to it is the path. Its hops are its call edges (``compute_loss -> a`` is one hop, ``... -> min_replace`` the
last); the report lists the (module, function) of every frame and the distinct modules entered, those of the
package and the others (TRL, ...). It fails loudly when ``min_replace`` is never reached.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from types import FrameType
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

# The setting of the traced step: the benchmarks' Min-Replace method (GSPO, eps 3e-4/4e-4) on the tiny trainer, off
# policy (two optimizer steps per generation) so that the transform is not the identity, one optimizer step.
MIN_REPLACE_SETTING: dict[str, Any] = dict(
    importance_sampling_level="sequence",
    loss_type="grpo",
    epsilon=3e-4,
    epsilon_high=4e-4,
    group_transform="min_replace",
    steps_per_generation=2,
    max_steps=1,
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


# ------------------------------------------------------------------------------------ the Min-Replace call path
class TargetNotReached(RuntimeError):
    """The traced run never called the target function of the package below the start function."""


@dataclass(frozen=True)
class Frame:
    """One frame of the path: its module (the frame's ``__name__``), function and whether it is the package's."""

    module: str
    function: str
    in_package: bool


@dataclass
class CallPath:
    """The frames from the nearest ``start`` function down to the target, in call order."""

    frames: list[Frame]
    package_dir: str

    @property
    def hops(self) -> int:
        """Call edges from the start frame to the target: one fewer than the frames."""
        return len(self.frames) - 1

    @property
    def package_modules(self) -> list[str]:
        """The distinct modules of the package the path enters, in order of first entry."""
        return list(dict.fromkeys(f.module for f in self.frames if f.in_package))

    @property
    def other_modules(self) -> list[str]:
        """The distinct modules outside the package on the path (TRL's, ...), in order of first entry."""
        return list(dict.fromkeys(f.module for f in self.frames if not f.in_package))

    def as_dict(self) -> dict[str, Any]:
        return {
            "hops": self.hops,
            "path": [[f.module, f.function] for f in self.frames],
            "package_dir": self.package_dir,
            "package_modules": self.package_modules,
            "other_modules": self.other_modules,
            "other_packages": list(dict.fromkeys(m.split(".")[0] for m in self.other_modules)),
        }


def _under(filename: str, package_dir: Path, cache: dict[str, bool]) -> bool:
    """Whether a code object's file lies in the package folder (cached: the profiler sees many calls)."""
    if filename not in cache:
        try:
            cache[filename] = Path(filename).resolve().is_relative_to(package_dir)
        except (OSError, ValueError):  # "<string>" and the like
            cache[filename] = False
    return cache[filename]


def _path_from(frame: FrameType, start: str, package_dir: Path, cache: dict[str, bool]) -> list[Frame] | None:
    """The frames from the nearest enclosing ``start`` function down to ``frame``, or None when none encloses it."""
    stack: list[Frame] = []
    current: FrameType | None = frame
    while current is not None:
        code = current.f_code
        module = str(current.f_globals.get("__name__", "?"))
        stack.append(Frame(module, code.co_name, _under(code.co_filename, package_dir, cache)))
        if code.co_name == start and current is not frame:
            return stack[::-1]
        current = current.f_back
    return None


def trace_call_path(
    run: Callable[[], Any], package_dir: Path | str, target: str = "min_replace", start: str = "compute_loss"
) -> CallPath:
    """Run ``run()`` under ``sys.setprofile`` (this thread) and return the path of the first call of a function
    named ``target`` defined under ``package_dir`` that a ``start`` function encloses. The target is found by code
    name and file, so that nothing internal to the package needs importing. Raises :class:`TargetNotReached` when
    no such call happens (saying whether the target ran outside any ``start``)."""
    package = Path(package_dir).resolve()
    cache: dict[str, bool] = {}
    found: list[list[Frame]] = []
    outside = [0]  # target calls with no start frame above them

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or found or frame.f_code.co_name != target:
            return
        if not _under(frame.f_code.co_filename, package, cache):
            return
        path = _path_from(frame, start, package, cache)
        if path is None:
            outside[0] += 1
        else:
            found.append(path)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    if not found:
        where = f"; it ran {outside[0]} time(s), never below a {start!r} frame" if outside[0] else ""
        raise TargetNotReached(f"no function {target!r} defined under {package} was called{where}")
    return CallPath(found[0], str(package))


def min_replace_path(setting: dict[str, Any] | None = None) -> CallPath:
    """The path of one Min-Replace micro-step from ``compute_loss`` to ``min_replace``: one optimizer step of the
    tiny trainer in :data:`MIN_REPLACE_SETTING` (or ``setting``), on the CPU. Only public names are imported; the
    package folder comes from ``dfpo_trl.__file__``. The trainer's printed logs are kept off stdout, which carries
    the JSON."""
    import dfpo_trl
    from dfpo_trl.testing import tiny_trainer

    package_dir = Path(dfpo_trl.__file__).resolve().parent
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        trainer = tiny_trainer(output_dir=out, **(MIN_REPLACE_SETTING if setting is None else setting))
        return trace_call_path(trainer.train, package_dir)


# ------------------------------------------------------------------------------------------------------- main
def summary(lines: LineCount, path: CallPath) -> list[str]:
    """The figures as the README would state them."""
    product, total = lines.parts[PRODUCT].lines, lines.total.lines
    return [
        f"dfpo_trl/ is {product / 1000:.1f}k of {total / 1000:.1f}k hand-written lines ({lines.product_share:.0%}); "
        f"the .py lines of tests/ and benchmarks/ are {lines.checking_over_product:.1f}x dfpo_trl/'s",
        f"one Min-Replace micro-step runs {path.hops} hops from compute_loss to min_replace, through "
        f"{len(path.package_modules)} dfpo_trl modules ({', '.join(path.package_modules)}) and "
        f"{', '.join(path.other_modules) or 'no other module'}",
    ]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure both figures, print them as JSON (and write them to ``--out``); returns them."""
    parser = argparse.ArgumentParser(
        prog="python -m dfpo_bench.structure_figures",
        description="The README's structure figures: the product's share of the hand-written lines, and the hops "
        "of one Min-Replace micro-step from compute_loss to min_replace (definitions: this module's docstring).",
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
    path = min_replace_path()
    figures = {"summary": summary(lines, path), "lines": lines.as_dict(), "min_replace_path": path.as_dict()}
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return figures


if __name__ == "__main__":
    main()
