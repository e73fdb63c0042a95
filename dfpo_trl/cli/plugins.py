"""Plugin modules of ``dfpo-train``: imported before the recipe's dataclasses are built, so that what they register
(a group transform with :func:`dfpo_trl.register_transform`, a task, a reward) exists when ``DFPOConfig`` checks
``group_transform`` against the registry (docs/source/guides/custom_transform.md).

They are named by the ``plugins`` field, on the command line (``--plugins my_pkg.transforms``) or in the recipe
(``plugins: [my_pkg.transforms]``); the flag beats the recipe, as for every field. The working directory is
importable, as for tasks and rewards given by import path.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._usercode import exception_text, user_frame
from .args import RecipeError

__all__ = ["as_module_list", "flag_plugins", "import_plugins", "requested_plugins"]


def as_module_list(value: Any) -> list[str]:
    """The ``plugins`` field as a list of module names: a recipe may give one name or a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise RecipeError(f"plugins={value!r} is not valid; give module names, e.g. plugins: [my_pkg.transforms]")


def flag_plugins(argv: Sequence[str]) -> list[str] | None:
    """The modules ``--plugins`` names on the command line (the last one given wins), or None without the flag."""
    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    flags.add_argument("--plugins", nargs="+", default=None)
    try:
        known, _ = flags.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise RecipeError(f"--plugins on the command line: {exc.message}; give one or more module names") from None
    return known.plugins


def requested_plugins(argv: Sequence[str]) -> list[str]:
    """The plugins of a command line before it is parsed (for ``--help``): the flag's, else the recipe's
    (``dfpo-train RECIPE.yaml`` or ``--config RECIPE.yaml``). A recipe that cannot be read names none here: the
    parse reports it."""
    flagged = flag_plugins(argv)
    if flagged is not None:
        return flagged
    args = list(argv)
    recipe = args[0] if args and not args[0].startswith("-") else None
    if "--config" in args and args.index("--config") + 1 < len(args):
        recipe = args[args.index("--config") + 1]
    if recipe is None or not os.path.isfile(recipe):
        return []
    import yaml

    try:
        data = yaml.safe_load(Path(recipe).read_text())
    except yaml.YAMLError:
        return []
    return as_module_list(data.get("plugins")) if isinstance(data, dict) else []


def import_plugins(modules: Sequence[str], origin: str = "plugins") -> None:
    """Import each module once (Python caches them); a module that fails is a one-line :class:`RecipeError` naming
    ``origin`` (where the plugins were named: the flag, or the recipe's line)."""
    if modules and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise RecipeError(
                f"{origin}: cannot import {name!r} ({exc}); a plugin is a module on PYTHONPATH or in the working "
                "directory, named as in an import statement (my_pkg.transforms, not my_pkg/transforms.py)"
            ) from None
        except Exception as exc:  # the plugin's own code failed (e.g. register_transform refused a transform)
            frame = user_frame(exc)
            raise RecipeError(
                f"{origin}: importing {name!r} failed{f' at {frame}' if frame else ''}: {exception_text(exc)}; fix "
                "the module or drop it from plugins"
            ) from exc
