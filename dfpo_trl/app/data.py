"""What a run trains and measures on: task, rewards, training prompts, held-out and drift problems, from the recipe.

A mistake in them (an unknown name, a missing column, a filter that drops every prompt) is a RecipeError.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..tasks import REWARDS, EquivalentFormsTask, Task, get_reward, get_task, safe_reward
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


def build_rewards(script_args: DFPOScriptArguments, task: Task, revision: str | None = None) -> list[Any]:
    """The task's reward functions, or those named by ``reward_funcs``: registered names and import paths give
    functions, each wrapped so that a failure names the function and the completion index; a local directory or
    a hub id (``org/name``) stays a string, the reward model TRL loads as a sequence classifier, checked here first
    (``revision``: the one the trainer will pass, the model's)."""
    if not script_args.reward_funcs:
        return [safe_reward(f) for f in task.reward_funcs]
    rewards: list[Any] = []
    for name in script_args.reward_funcs:
        if name not in REWARDS and reward_model_given(name):
            check_reward_model(name, revision)
            rewards.append(name)
            continue
        try:
            rewards.append(get_reward(name))
        except ValueError as exc:  # an unknown name, a bad import path, an object that is not callable
            raise RecipeError(str(exc)) from exc
    return rewards


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def reward_model_given(name: str) -> bool:
    """Whether a ``reward_funcs`` entry names a reward model (a path or a hub id ``org/name``), not a function."""
    return os.path.isdir(name) or name.startswith((".", "/", "~")) or HUB_ID.fullmatch(name) is not None


def check_reward_model(name: str, revision: str | None) -> None:
    """A reward model TRL can load, refused in one line before any model loads: a local directory needs the
    model's config and its tokenizer (TRL loads both from it); a hub id needs the hub or a cached copy."""
    from .model import check_hub_checkpoint

    if os.path.isdir(name):
        missing = [what for what, files in (("config.json", ("config.json",)),
                                            ("tokenizer (tokenizer.json or tokenizer_config.json)",
                                             ("tokenizer.json", "tokenizer_config.json")))
                   if not any(os.path.isfile(os.path.join(name, f)) for f in files)]
        if missing:
            raise RecipeError(
                f"reward_funcs: {name!r} has no {' and no '.join(missing)}; a reward model is a directory saved "
                "with save_pretrained (an AutoModelForSequenceClassification with num_labels=1) and its tokenizer."
            )
        return
    if not HUB_ID.fullmatch(name):
        raise RecipeError(
            f"reward_funcs: {name!r} is not a directory; give a reward model's directory (saved with "
            "save_pretrained), a hub id 'org/name', a registered reward or an import path 'package.module:function'."
        )
    check_hub_checkpoint(
        name, revision, "reward model (reward_funcs)",
        "Give its local copy instead (reward_funcs: /path/to/reward_model, a directory saved with save_pretrained "
        "holding the model and its tokenizer).",
    )


def check_reward_model_templates(rewards: list[Any], train: Any, revision: str | None = None) -> None:
    """TRL renders a chat prompt and its completion for a reward model through that model's own chat template:
    one without a template is refused here, in one line, instead of failing at the first rollout."""
    from transformers import AutoTokenizer
    from trl.data_utils import is_conversational

    if not is_conversational({"prompt": train[0]["prompt"]}):
        return
    for name in (reward for reward in rewards if isinstance(reward, str)):
        if getattr(AutoTokenizer.from_pretrained(name, revision=revision), "chat_template", None) is None:
            raise RecipeError(
                f"reward_funcs: {name!r} has no chat template, and the task's prompts are chat messages, which TRL "
                "renders for a reward model through the reward model's own chat template. Use a reward model whose "
                "tokenizer has one, or set its tokenizer's chat_template and save it there."
            )


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
    first = script_args.reward_funcs[0] if script_args.reward_funcs else None
    if first is not None and first not in REWARDS and reward_model_given(first):
        raise RecipeError(
            f"drift_every={script_args.drift_every} logs which form each correct completion takes through the first "
            f"reward function, but reward_funcs[0]={first!r} is a reward model. List a reward function first, or "
            "set drift_every: 0."
        )
    return task.build_dataset("test", script_args.drift_size, seed)
