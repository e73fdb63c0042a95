"""The files a run writes to ``output_dir``, and the earlier runs' set aside in ``previous_run/``, ``previous_run.1/``,
... (docs/source/guides/cli.md, "An earlier run's results").

Nothing here deletes: an earlier run's results move to the first aside folder that does not exist yet, and every
aside folder already there stays as it is. Standard library only: the script arguments and the command line's fast
checks read these names before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CHECKPOINT_DIR", "PLOT_FILE", "PREVIOUS_RUN_DIR", "SAVED_MODEL_PATTERNS", "SUMMARY_FILE", "SetAside",
    "aside_folders", "earlier_results", "names_said", "next_aside_folder", "removed_if_left_empty",
    "set_aside_previous_outputs",
]  # fmt: skip

SUMMARY_FILE = "dfpo_summary.json"
PLOT_FILE = "dfpo_metrics.png"
# Where a run moves the results an earlier run left in its output_dir (docs/source/guides/cli.md): previous_run/
# first, then previous_run.1/, previous_run.2/, ... (the largest number is the latest); none is replaced or deleted.
PREVIOUS_RUN_DIR = "previous_run"
ASIDE_DIR = re.compile(rf"^{PREVIOUS_RUN_DIR}(?:\.(\d+))?$")
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR + "-" + step
# What `save_model` writes, for summaries written before they listed their files ("files").
SAVED_MODEL_PATTERNS = (
    "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
    "model.safetensors.index.json", "pytorch_model*.bin", "adapter_config.json", "adapter_model.safetensors",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "added_tokens.json", "training_args.bin",
)  # fmt: skip


@dataclass
class SetAside:
    """What became of the earlier runs' results in an ``output_dir``: the names moved and where to (None: nothing
    moved), and the aside folders of the runs before, left where they are."""

    moved: list[str] = field(default_factory=list)
    target: Path | None = None
    kept: list[Path] = field(default_factory=list)


def aside_folders(output_dir: str | Path) -> list[Path]:
    """The aside folders in ``output_dir`` (``previous_run/``, ``previous_run.1/``, ...), oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = {int(m.group(1) or 0): p for p in out.iterdir() if (m := ASIDE_DIR.match(p.name))}
    return [found[n] for n in sorted(found)]


def next_aside_folder(output_dir: str | Path) -> Path:
    """The first of ``previous_run/``, ``previous_run.1/``, ``previous_run.2/``, ... in ``output_dir`` that does not
    exist (as a folder, a file or a link): where the next earlier run goes, replacing nothing."""
    out = Path(output_dir)
    taken = [int(m.group(1) or 0) for p in aside_folders(out) if (m := ASIDE_DIR.match(p.name))]
    number = max(taken) + 1 if taken else 0
    while True:  # a larger number than every one there, so the order of the numbers is the order of the runs
        candidate = out / (PREVIOUS_RUN_DIR if number == 0 else f"{PREVIOUS_RUN_DIR}.{number}")
        if not candidate.exists() and not candidate.is_symlink():
            return candidate
        number += 1


def _listed_files(out: Path) -> set[str]:
    """The files the summary in ``out`` lists as its run's (the summary and figure included), or, for a summary
    from before the summaries listed them, what ``save_model`` writes."""
    names = {PLOT_FILE}
    summary = out / SUMMARY_FILE
    if not summary.is_file():
        return names
    names.add(SUMMARY_FILE)
    try:
        listed = json.loads(summary.read_text()).get("files")
    except (ValueError, OSError, AttributeError):
        listed = None
    if isinstance(listed, list):
        names.update(str(n) for n in listed if Path(str(n)).name == str(n) and str(n) not in ("", ".", ".."))
    else:  # a summary from before the files were listed
        names.update(p.name for pattern in SAVED_MODEL_PATTERNS for p in out.glob(pattern))
    return names


def earlier_results(output_dir: str | Path, keep_checkpoints_to: int | None = None) -> list[str]:
    """The names at the top of ``output_dir`` that an earlier run left there as its results: the files its summary
    lists (summary, figure, saved model) and its ``checkpoint-N/`` folders, sorted. ``keep_checkpoints_to``: this
    run resumes from ``checkpoint-K/`` of this folder, so ``checkpoint-N/`` with N <= K are its own history and
    stay (the later ones would be overwritten by the resumed run's). Other files (your notes) are not results."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    names = {n for n in _listed_files(out) if (out / n).is_file()}
    for path in out.iterdir():
        match = CHECKPOINT_DIR.match(path.name)
        if match and path.is_dir() and (keep_checkpoints_to is None or int(match.group(1)) > keep_checkpoints_to):
            names.add(path.name)
    return sorted(names)


def names_said(names: list[str], limit: int = 4) -> str:
    """``names`` for a one-line message: all of them up to ``limit``, else the summary, the weights and the
    checkpoints first and how many more ("dfpo_summary.json, model.safetensors, checkpoint-2 and 6 more")."""
    if len(names) <= limit:
        return ", ".join(names)
    first = sorted(names, key=lambda n: (n != SUMMARY_FILE, "safetensors" not in n, not n.startswith("checkpoint-"), n))
    return f"{', '.join(first[: limit - 1])} and {len(names) - limit + 1} more"


def set_aside_previous_outputs(output_dir: str | Path, keep_checkpoints_to: int | None = None) -> SetAside:
    """Move what an earlier run left in ``output_dir`` (:func:`earlier_results`) into the first free aside folder
    (:func:`next_aside_folder`), so that nothing at the top of ``output_dir`` can be taken for this run's results,
    and nothing is lost: no aside folder is replaced or deleted (docs/source/guides/cli.md)."""
    out = Path(output_dir)
    kept = aside_folders(out)
    present = earlier_results(out, keep_checkpoints_to)
    if not present:
        return SetAside(kept=kept)
    target = next_aside_folder(out)
    target.mkdir()
    for name in present:
        (out / name).rename(target / name)
    return SetAside(moved=present, target=target, kept=kept)


@contextlib.contextmanager
def removed_if_left_empty(path: str | Path | None) -> Iterator[None]:
    """On the way out of the block, remove the folders of ``path`` that did not exist when it began (``path`` and
    the parents created with it) if they are still empty: a run that wrote nothing (refused after the fast checks,
    failed or stopped before writing, ``--preflight``) leaves no empty ``output_dir`` behind. A folder that was
    there before, or that holds anything, stays. Process 0 only: the others never remove what process 0 writes."""
    if path is None or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    missing = []
    folder = Path(path).expanduser().absolute()
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)  # the deepest first
        folder = folder.parent
    try:
        yield
    finally:
        for created in missing:
            try:
                created.rmdir()  # only an empty folder; one that holds anything raises, and so do its parents
            except OSError:
                break
