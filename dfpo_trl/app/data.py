"""What a run trains and measures on: task, rewards, training prompts, held-out and drift problems, from the recipe.

A mistake in them (an unknown name, a missing column, a filter that drops every prompt) is a RecipeError.
"""

from __future__ import annotations

from typing import Any

from ..tasks import EquivalentFormsTask, Task, get_reward, get_task, safe_reward
from . import logger
from .args import DFPOScriptArguments, RecipeError


def build_task(script_args: DFPOScriptArguments) -> Task:
    """The task ``script_args.task`` names (registered, or an import path), with the dataset fields for ``math``."""
    options: dict[str, Any] = {}
    if script_args.task == "math":
        options = {
            "dataset": script_args.dataset,
            "config": script_args.dataset_config,
            "split": script_args.split,
            "test_split": script_args.test_split,
            "problem_column": script_args.problem_column,
            "answer_column": script_args.answer_column,
            **({} if script_args.instruction is None else {"instruction": script_args.instruction}),
        }
    elif script_args.dataset is not None:
        raise RecipeError(
            f"dataset={script_args.dataset!r} is set but task={script_args.task!r} does not read it; set task: math "
            "to train on a `datasets` dataset."
        )
    try:
        task = get_task(script_args.task, **options)
    except ValueError as exc:  # an unknown name, a bad import path, the task's own checks (no dataset)
        raise RecipeError(str(exc)) from exc
    check_is_task(task, script_args.task)
    return task


def check_is_task(task: Any, name: str) -> None:
    """Refuse what a task factory built when it is not a :class:`Task` (``task: os:getcwd`` gives a str), naming
    its type and what it lacks, before anything reads it."""
    missing = [attr for attr in ("name", "reward_funcs") if not hasattr(task, attr)]
    if not callable(getattr(task, "build_dataset", None)):
        missing.append("build_dataset(split, n, seed)")
    if not missing and isinstance(task.reward_funcs, (list, tuple)):
        return
    if not missing:
        missing.append(f"a list of reward_funcs (it has a {type(task.reward_funcs).__name__})")
    kind = type(task).__qualname__
    kind = kind if type(task).__module__ == "builtins" else f"{type(task).__module__}.{kind}"
    shown = repr(task)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise RecipeError(
        f"task {name!r} gave a {kind} ({shown}), not a task: it lacks "
        f"{', '.join(missing)}. A task (dfpo_trl.tasks.Task) has a name, a list of reward_funcs and a "
        "build_dataset(split, n, seed) method; task: package.module:factory names a task object, or a class or "
        "function that returns one."
    )


def build_rewards(script_args: DFPOScriptArguments, task: Task) -> list[Any]:
    """The task's reward functions, or those named by ``reward_funcs`` (registered, or import paths); each wrapped
    so that a failure names the function and the completion index."""
    if not script_args.reward_funcs:
        return [safe_reward(f) for f in task.reward_funcs]
    try:
        return [get_reward(name) for name in script_args.reward_funcs]
    except ValueError as exc:  # an unknown name, a bad import path, an object that is not callable
        raise RecipeError(str(exc)) from exc


def filter_long_prompts(dataset: Any, tokenizer: Any, max_tokens: int, chat_template_kwargs: dict | None) -> Any:
    """Rows whose prompt (chat template applied) is at most ``max_tokens`` tokens."""

    def length(row: dict[str, Any]) -> int:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        ids = tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    kept = dataset.filter(lambda row: length(row) <= max_tokens)
    dropped = len(dataset) - len(kept)
    if dropped:
        logger.warning("max_prompt_length=%d: dropped %d of %d training prompts", max_tokens, dropped, len(dataset))
    if len(kept) == 0:
        raise RecipeError(f"max_prompt_length={max_tokens} drops every training prompt; raise it.")
    return kept


def build_datasets(script_args: DFPOScriptArguments, task: Task, seed: int) -> tuple[Any, Any | None]:
    """(train dataset, held-out dataset or None) with the columns TRL needs checked."""
    try:
        train = task.build_dataset("train", script_args.train_size, seed)
    except ValueError as exc:  # the task's own checks (a missing column or split): the recipe's fault
        raise RecipeError(str(exc)) from exc
    if "prompt" not in train.column_names:
        raise RecipeError(
            f"task {script_args.task!r} built a training dataset without a 'prompt' column (columns: "
            f"{train.column_names}); TRL's GRPOTrainer reads the prompts from 'prompt'."
        )
    if len(train) == 0:
        raise RecipeError(f"task {script_args.task!r} built an empty training dataset")
    heldout = None
    if not script_args.skip_eval and script_args.eval_size > 0:
        try:
            heldout = task.build_dataset("test", script_args.eval_size, seed)
        except ValueError as exc:
            raise RecipeError(f"{exc} (or set skip_eval: true to train without the held-out accuracy)") from exc
    return train, heldout


def build_drift_problems(script_args: DFPOScriptArguments, task: Task, seed: int) -> Any | None:
    """The held-out problems the drift meter scores (``drift_every`` > 0), or None; a task without equivalent
    forms is refused."""
    if not script_args.drift_every:
        return None
    if not isinstance(task, EquivalentFormsTask):
        raise RecipeError(
            f"drift_every={script_args.drift_every} needs a task whose correct answer comes in equivalent forms "
            f"(two_forms, sum_sentence, or a task with form_names, equivalent_forms and form_of); task "
            f"{script_args.task!r} has none. Set drift_every: 0 or change the task."
        )
    return task.build_dataset("test", script_args.drift_size, seed)
