"""The paths a run is given, checked before anything loads or moves: ``output_dir`` and ``resume_from_checkpoint``.

Standard library only, so that the command line's fast checks can use them before torch and TRL are imported.
Each bad path is a one-line :class:`RecipeError` naming where it was set, what is wrong and what to give instead.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path

from .args import RecipeError
from .files import CHECKPOINT_DIR

__all__ = [
    "CHECKPOINT_WEIGHTS", "PROCESS_FILES", "check_output_dir", "latest_checkpoint", "latest_whole_checkpoint",
    "missing_process_files", "resolve_resume_checkpoint", "shown_path", "too_long",
]

# What transformers' Trainer.train(resume_from_checkpoint=...) reads back (Trainer._load_from_checkpoint, and
# deepspeed_load_checkpoint under DeepSpeed): one of these weight files, or FSDP's or DeepSpeed's own layout.
CHECKPOINT_WEIGHTS = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
    "adapter_model.safetensors", "adapter_model.bin",
)  # fmt: skip
TRAINER_STATE = "trainer_state.json"
# The files each process writes into a checkpoint of a multi-process run, without waiting for the others:
# transformers' RNG state (indexed only when there are several processes) and DFPOTrainer's rollout state
# (dfpo_trl/trl_hooks/resume.py's ROLLOUT_STATE_FILE). A process killed during the save leaves its files out.
PROCESS_FILES = (re.compile(r"^rng_state_(\d+)\.pth$"), re.compile(r"^dfpo_rollout_state_(\d+)\.pt$"))
CHECKPOINT_HELP = (
    f"a checkpoint is a checkpoint-N/ folder a run wrote to its output_dir (save_strategy 'steps' or 'epoch'), "
    f"holding {TRAINER_STATE} and the model's weights ({CHECKPOINT_WEIGHTS[0]}, or {CHECKPOINT_WEIGHTS[4]} with "
    "LoRA, or an FSDP or DeepSpeed global_step* folder); give its path, or true for the latest checkpoint-N/ in "
    "output_dir"
)


def shown_path(path: str, limit: int = 80) -> str:
    """``path`` quoted for a one-line message: a long one as its head and tail with its length."""
    if len(path) <= limit:
        return repr(path)
    return f"{path[:40]!r}...{path[-24:]!r} ({len(path)} characters)"


def too_long(path: str) -> str | None:
    """Why the file system cannot take ``path`` (a folder name over its NAME_MAX, or the whole path over its
    PATH_MAX: ``OSError: File name too long`` on any use), or None when it can."""
    anchor = next((p for p in (os.getcwd(), "/") if os.path.isdir(p)), "/")
    try:
        name_max = os.pathconf(anchor, "PC_NAME_MAX")
        path_max = os.pathconf(anchor, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows): the common Linux limits
        name_max, path_max = 255, 4096
    longest = max(Path(path).parts, key=len, default="")
    if len(longest.encode()) > name_max:
        return (f"a folder name in it has {len(longest.encode())} bytes ({longest[:20]!r}...), over the file "
                f"system's limit of {name_max}")
    if len(os.path.abspath(path).encode()) >= path_max:
        return f"it has {len(os.path.abspath(path).encode())} bytes, over the file system's limit of {path_max - 1}"
    return None


def _refuse_long_path(field: str, path: str, origin: str, example: str) -> None:
    """A path the file system cannot take, refused before anything stats it (a traceback otherwise)."""
    reason = too_long(path)
    if reason is not None:
        raise RecipeError(f"{origin}: {field} {shown_path(path)} is too long: {reason}; give a shorter path, e.g. "
                          f"{example}")


def _stat_error(field: str, path: str, origin: str, exc: OSError) -> RecipeError:
    """Any other OSError of looking at ``path`` (ENAMETOOLONG on a file system with other limits, ELOOP, EACCES)."""
    if exc.errno == errno.ENAMETOOLONG:
        return RecipeError(f"{origin}: {field} {shown_path(path)} is too long for the file system "
                           f"({exc.strerror}); give a shorter path")
    return RecipeError(f"{origin}: {field} {shown_path(path)} cannot be read ({exc.strerror or type(exc).__name__});"
                       " give a path you can reach")


def check_output_dir(path: str, origin: str) -> None:
    """``output_dir`` must be a directory this process can create or write. Probed by creating (and removing) a
    scratch folder in it or in its nearest existing parent: permission bits say nothing for root, nor for /proc."""
    _refuse_long_path("output_dir", path, origin, "--output_dir outputs/run1")
    try:
        _check_output_dir(path, origin)
    except OSError as exc:
        raise _stat_error("output_dir", path, origin, exc) from None


def _check_output_dir(path: str, origin: str) -> None:
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise RecipeError(
            f"{origin}: output_dir {path!r} is an existing file, not a directory; name a directory (created if "
            f"missing), e.g. --output_dir {path}.d"
        )
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise RecipeError(f"{origin}: output_dir {path!r} cannot be created: {str(existing)!r} is a file; name "
                          "a directory elsewhere.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dfpo-write-check-", dir=existing))
    except OSError as exc:
        verb = "is not writable" if existing == target else "cannot be created"
        raise RecipeError(
            f"{origin}: output_dir {path!r} {verb} ({exc.strerror or type(exc).__name__} in {str(existing)!r}); "
            "name a directory you can write, e.g. --output_dir outputs/run1"
        ) from None


def latest_checkpoint(output_dir: str) -> str | None:
    """The ``checkpoint-N/`` folder with the largest N in ``output_dir`` that is a whole checkpoint (transformers'
    get_last_checkpoint takes the largest N, even one a run was killed while writing); the latest folder when none
    is whole, for the refusal to name."""
    folders = _checkpoint_folders(output_dir)
    return latest_whole_checkpoint(output_dir) or (folders[0] if folders else None)


def latest_whole_checkpoint(output_dir: str) -> str | None:
    """The ``checkpoint-N/`` folder with the largest N in ``output_dir`` that a resume can start from, or None."""
    return next((folder for folder in _checkpoint_folders(output_dir) if _checkpoint_problem(Path(folder)) is None),
                None)


def _checkpoint_folders(output_dir: str) -> list[str]:
    """The ``checkpoint-N/`` folders in ``output_dir``, the largest N first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    steps = {int(m.group(1)): p for p in folder.iterdir() if (m := CHECKPOINT_DIR.match(p.name)) and p.is_dir()}
    return [str(steps[step]) for step in sorted(steps, reverse=True)]


def missing_process_files(path: Path) -> list[str]:
    """The per-process files (:data:`PROCESS_FILES`) a checkpoint of several processes lacks: for each kind it
    holds, every index below the largest of any kind's, and 0 and 1 when it holds transformers' indexed RNG files
    (written only by several processes). A process killed after the others saved leaves only its own out; when
    that is the last process and it wrote none, nothing in the folder tells, and DFPOTrainer's load refuses it
    from the process count its rollout files record (trl_hooks/resume.py)."""
    found: list[set[int]] = [set() for _ in PROCESS_FILES]
    for name in os.listdir(path):
        for indices, pattern in zip(found, PROCESS_FILES, strict=True):
            if m := pattern.match(name):
                indices.add(int(m.group(1)))
    if not any(found):
        return []
    processes = max(max(indices) for indices in found if indices) + 1
    processes = max(processes, 2 if found[0] else 1)
    kinds = ("rng_state_{}.pth", "dfpo_rollout_state_{}.pt")
    return [kind.format(p) for kind, indices in zip(kinds, found, strict=True) if indices
            for p in range(processes) if p not in indices]


def _checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` is not a checkpoint transformers can resume from, or None when it is one."""
    if not path.exists():
        return "no such directory"
    if not path.is_dir():
        return "a file, not a directory"
    if not (path / TRAINER_STATE).is_file():
        return f"no {TRAINER_STATE} in it"
    sharded = any(p.is_dir() and (p.name.startswith("global_step") or "pytorch_model_fsdp" in p.name)
                  for p in path.iterdir())
    if not sharded and not any((path / name).is_file() for name in CHECKPOINT_WEIGHTS):
        return "no model weights in it"
    missing = missing_process_files(path)
    if missing:
        return (f"half-written: {', '.join(missing)} missing, the files of a process stopped while the checkpoint "
                "was saved; resume from the checkpoint before it")
    return None


def resolve_resume_checkpoint(value: str | None, output_dir: str | None, origin: str) -> str | None:
    """``resume_from_checkpoint`` as the path train() is given: None for unset, ``false`` or empty; the latest
    ``checkpoint-N/`` in ``output_dir`` for ``true`` (what ``Trainer.train(resume_from_checkpoint=True)`` picks);
    else the path, which must hold a checkpoint."""
    if value is None or value.strip().lower() in ("", "false"):
        return None
    if value.strip().lower() == "true":
        found = latest_checkpoint(output_dir) if output_dir else None
        if found is None:
            raise RecipeError(
                f"{origin}: resume_from_checkpoint true resumes from the latest checkpoint-N/ in output_dir "
                f"{output_dir!r}, and there is none; {CHECKPOINT_HELP}"
            )
        value = found
    _refuse_long_path("resume_from_checkpoint", value, origin, "outputs/run1/checkpoint-8")
    try:
        problem = _checkpoint_problem(Path(value))
    except OSError as exc:
        raise _stat_error("resume_from_checkpoint", value, origin, exc) from None
    if problem is not None:
        raise RecipeError(f"{origin}: resume_from_checkpoint {value!r} is not a checkpoint ({problem}); "
                          f"{CHECKPOINT_HELP}")
    return value
