"""``dfpo-train``: train with DFPO from a YAML recipe, under ``accelerate launch`` or alone (``main``).

    dfpo-train recipes/smollm2_cpu.yaml                       # the offline embedded default, on the CPU
    dfpo-train recipes/smollm2_cpu.yaml --max_steps 10        # any field overridden on the command line
    accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml -m dfpo_trl recipes/qwen3_32b.yaml

A recipe is a flat YAML mapping read by TRL's ``TrlParser`` into three dataclasses: :class:`DFPOScriptArguments`
(task, data, held-out evaluation), :class:`~dfpo_trl.DFPOConfig` (every ``GRPOConfig`` field plus DFPO's) and
TRL's ``ModelConfig`` (model path or id, dtype, LoRA). An ``env:`` mapping sets environment variables. Command
line flags beat the recipe. With no ``model_name_or_path`` the embedded SmolLM2-135M-Instruct is used.

This module imports no torch, transformers or TRL: ``--help`` and the checks of the recipe, the field names and
the paths (:mod:`.precheck`) answer in a fraction of a second; :mod:`.train` (the parse and the run) is imported
once they pass. ``run`` and ``default_process_group`` are :mod:`.train`'s, reachable here as before.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._usercode import UserCodeError
from . import logger
from .allocator import default_allocator
from .args import ModelUnavailableError, RecipeError
from .engine import EngineStartFailed
from .files import removed_if_left_empty
from .first_screen import next_steps
from .help import short_help
from .oom import RunOutOfMemory
from .peers import PeerLost
from .plugins import import_plugins, requested_plugins
from .precheck import given_output_dir, precheck, read_recipe, stored_field_table, stored_help_all
from .signals import exit_code, quiet_exit_on_interrupt, signal_name, sigterm_interrupts

if TYPE_CHECKING:
    from transformers import TrainerCallback

__all__ = ["main"]  # and run, default_process_group (from .train, on first use)


def __getattr__(name: str) -> Any:
    """``run`` and ``default_process_group`` from :mod:`.train`, imported on first use (it imports torch)."""
    if name in ("run", "default_process_group"):
        return getattr(importlib.import_module(".train", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def print_help(args: Sequence[str]) -> int:
    """``--help`` (from the stored field table, or from the parser once plugins registered theirs) or
    ``--help-all`` (argparse's help over every field: stored beside the table, or from the parser with plugins);
    2 when a plugin cannot be imported."""
    plugins = requested_plugins(args)
    stored = stored_field_table()
    if "--help-all" in args:
        stored_all = stored_help_all() if not plugins else None
        if stored_all is not None:
            print(stored_all, end="")
            return 0
    recipe, settings = help_recipe(args)
    if "--help-all" not in args and not plugins and stored is not None:
        print(short_help(stored, recipe=recipe, settings=settings), end="")
        return 0
    try:  # the help lists what the plugins register
        import_plugins(plugins)
    except RecipeError as exc:
        print(f"dfpo-train: error: {exc}", file=sys.stderr)
        return 2
    from .field_builder import help_all_text
    from .fields import build_field_table
    from .parser import make_parser

    if "--help-all" in args:
        print(help_all_text(make_parser()), end="")
    else:
        print(short_help(build_field_table(make_parser()), recipe=recipe, settings=settings), end="")
    return 0


def help_recipe(args: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """The recipe a ``--help`` command names (``dfpo-train RECIPE.yaml --help`` or ``--config RECIPE.yaml``) and the
    fields it sets, for the help to show beside the defaults; (None, {}) without one or when it cannot be read (the
    run itself reports that)."""
    items = list(args)
    recipe = items[0] if items and not items[0].startswith("-") else None
    if "--config" in items and items.index("--config") + 1 < len(items):
        recipe = items[items.index("--config") + 1]
    if recipe is None:
        return None, {}
    try:
        return recipe, read_recipe(recipe)
    except (RecipeError, OSError):
        return None, {}


def main(argv: Sequence[str] | None = None, callbacks: Sequence[TrainerCallback] = ()) -> int:
    """Console entry point of ``dfpo-train`` and ``python -m dfpo_trl``. From Python (``dfpo_train``),
    ``callbacks`` are transformers ``TrainerCallback`` objects the run's trainer gets after its own, so that a
    program running ``dfpo-train`` can observe it (a checkpoint saved, a step logged) without wrapping its code."""
    try:
        return _main(argv, callbacks)
    finally:
        if argv is None:  # the console program (not a caller's Python): Ctrl-C from here on just ends it
            quiet_exit_on_interrupt()


def _main(argv: Sequence[str] | None, callbacks: Sequence[TrainerCallback]) -> int:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logging.getLogger("dfpo_trl").setLevel(logging.INFO)
    args = sys.argv[1:] if argv is None else list(argv)
    if "--preflight" in args:  # the checks to run on every node before a multi-node job (docs/source/guides/cli.md)
        from .preflight import main as preflight

        return preflight([a for a in args if a != "--preflight"])
    if "--help-all" in args or "-h" in args or "--help" in args:
        code = print_help(args)
        if code:
            return code
        raise SystemExit(0)
    try:
        with sigterm_interrupts():  # a scheduler's SIGTERM ends the run as Ctrl-C does (docs/source/guides/cli.md)
            line = precheck(args)  # recipe, field names, paths: before torch, transformers and TRL are imported
            if line is not None and int(os.environ.get("RANK", "0")) == 0:
                logger.info(next_steps(line.value))  # within a second: what runs next, and what it takes
            default_allocator(args)  # expandable segments unless the user chose (allocator.py): before CUDA starts
            with removed_if_left_empty(line.value("output_dir") if line is not None else given_output_dir(args)):
                summary = importlib.import_module(".train", __package__).parse_and_run(args, callbacks)
    except (RecipeError, ModelUnavailableError) as exc:
        print(f"dfpo-train: error: {exc}", file=sys.stderr)
        return 2
    except (UserCodeError, RunOutOfMemory, EngineStartFailed) as exc:  # the user's code failed (their frame), out
        # of memory (oom.py), or vLLM refused to start (engine.py)
        print(f"dfpo-train: error: {exc}", file=sys.stderr)
        return 1
    except PeerLost as exc:  # another process of the run died or hangs (peers.py)
        print(f"dfpo-train: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as exc:  # outside training (loading, saving): nothing partial worth describing
        name = signal_name(exc)
        print(f"\ndfpo-train: {'interrupted' if name == 'SIGINT' else 'stopped by ' + name}", file=sys.stderr)
        return exit_code(name)
    # 128 + the signal's number, the shell's code: 130 for Ctrl-C (SIGINT), 143 for SIGTERM
    return exit_code(summary["signal"] or "SIGINT") if summary.get("interrupted") else 0
