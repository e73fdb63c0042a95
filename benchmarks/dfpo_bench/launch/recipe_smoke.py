"""Derive a short offline run of a shipped recipe: its objective, batch, LoRA, DeepSpeed and precision kept; a local
model, the built-in arithmetic task, the run length, completion length and checkpointing changed, each change printed
(the GPU machine has no network). ``--set KEY=VALUE`` (repeatable, read as YAML) changes anything else on purpose, as
``launch/two_node.py`` does.
"""

from __future__ import annotations

import argparse
import pathlib

import yaml

# Keys that only the hub dataset of the `math` task reads.
DATASET_KEYS = ("dataset", "dataset_config", "split", "test_split", "problem_column", "answer_column")


def smoke_recipe(recipe: dict, model: str, max_steps: int, output_dir: str, **limits: int) -> dict:
    """The recipe with the model, task, run length and output changed (see module docstring)."""
    out = {k: v for k, v in recipe.items() if k not in (*DATASET_KEYS, "save_steps")}
    out.update(model_name_or_path=model, task="arithmetic", max_steps=max_steps, output_dir=output_dir,
               save_strategy="no", report_to="none", **{k: v for k, v in limits.items() if v is not None})
    return out


def parse_set(items: list[str]) -> dict:
    """``KEY=VALUE`` pairs, each value read as YAML (``false`` -> False, ``4`` -> 4, ``sdpa`` -> 'sdpa')."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe", type=pathlib.Path)
    p.add_argument("--model", required=True, help="local checkpoint directory")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--max-prompt-length", type=int, default=None)
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--output-dir", default="/tmp/dfpo-recipe-smoke")
    p.add_argument("--out", type=pathlib.Path, required=True, help="where to write the derived recipe")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="set any recipe key (value read as YAML); repeatable; applied last")
    args = p.parse_args(argv)
    recipe = yaml.safe_load(args.recipe.read_text())
    derived = smoke_recipe(recipe, args.model, args.max_steps, args.output_dir,
                           max_completion_length=args.max_completion_length, max_prompt_length=args.max_prompt_length,
                           eval_size=args.eval_size, eval_max_new_tokens=args.eval_max_new_tokens)
    derived.update(parse_set(args.overrides))
    for key in sorted(set(recipe) | set(derived)):
        if recipe.get(key) != derived.get(key):
            print(f"  {key}: {recipe.get(key)!r} -> {derived.get(key, '(removed)')!r}")
    args.out.write_text(yaml.safe_dump(derived, sort_keys=False))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
