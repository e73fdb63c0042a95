"""What a run trains and measures on: task, rewards, training prompts, held-out and drift problems, from the recipe.

A mistake in them (an unknown name, a missing column, a filter that drops every prompt) is a RecipeError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .._usercode import UserCodeError, exception_text, user_frame
from . import logger
from .args import DFPOScriptArguments, RecipeError
from .local_inputs import reward_model_given, reward_model_problem, unread_dataset_problem
from .tasks import REWARDS, EquivalentFormsTask, Task, get_reward, get_task, safe_reward

Origin = Callable[[str], str]  # where a field was set ("--task on the command line", "task in r.yaml, line 3")


def _headed(origin: Origin | None, name: str, message: str) -> str:
    """``message`` headed by where ``name`` was set, when the caller knows (the command line does)."""
    return message if origin is None else f"{origin(name)}: {message}"


def failed_at(what: str, exc: BaseException) -> str:
    """``what`` failed, at the user's frame, with the exception: a user's code that raised, said in one line."""
    frame = user_frame(exc)
    return f"{what} failed{f' at {frame}' if frame else ''}: {exception_text(exc)}"


def build_task(script_args: DFPOScriptArguments, origin: Origin | None = None) -> Task:
    """The task ``script_args.task`` names (registered, or an import path), with the dataset fields for ``math``;
    a refusal is headed by where the field was set when ``origin`` says it."""
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
    elif (problem := unread_dataset_problem(script_args.dataset, script_args.task)) is not None:
        raise RecipeError(_headed(origin, "dataset", problem))
    try:
        task = get_task(script_args.task, **options)
    except ValueError as exc:  # an unknown name, a bad import path, the task's own checks (no dataset)
        raise RecipeError(_headed(origin, "task", str(exc))) from exc
    except Exception as exc:  # noqa: BLE001 - the user's task factory (or its module) raised: one line, their frame
        raise UserCodeError(_headed(origin, "task", failed_at(f"task {script_args.task!r}", exc))) from exc
    try:
        check_is_task(task, script_args.task)
    except RecipeError as exc:
        raise RecipeError(_headed(origin, "task", str(exc))) from None
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
        f"{', '.join(missing)}. A task (dfpo_trl.cli.tasks.Task) has a name, a list of reward_funcs and a "
        "build_dataset(split, n, seed) method; task: package.module:factory names a task object, or a class or "
        "function that returns one."
    )


def build_rewards(
    script_args: DFPOScriptArguments, task: Task, revision: str | None = None, origin: Origin | None = None
) -> list[Any]:
    """The task's reward functions, or those named by ``reward_funcs``: registered names and import paths give
    functions, each wrapped so that a failure names the function and the completion index; a local directory or
    a hub id (``org/name``) stays a string, the reward model TRL loads as a sequence classifier, checked here first
    (``revision``: the one the trainer will pass, the model's; ``origin``: where the field was set)."""
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
            raise RecipeError(_headed(origin, "reward_funcs", str(exc))) from exc
    return rewards


def check_reward_model(name: str, revision: str | None) -> None:
    """A reward model TRL can load, refused in one line before any model loads: a local directory needs the
    model's config and its tokenizer (TRL loads both from it); a hub id needs the hub or a cached copy."""
    from .model import check_hub_checkpoint

    problem = reward_model_problem(name)
    if problem is not None:
        raise RecipeError(problem)
    if os.path.isdir(name):
        return
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


def prompt_tokens(prompt: Any, tokenizer: Any, chat_template_kwargs: dict | None) -> int:
    """The number of tokens of ``prompt`` as the trainer sends it (a conversation with the chat template applied
    and the generation prompt added, or a plain string)."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(
        prompt, tokenize=True, add_generation_prompt=True, **(chat_template_kwargs or {})
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def filter_long_prompts(dataset: Any, tokenizer: Any, max_tokens: int, chat_template_kwargs: dict | None) -> Any:
    """Rows whose prompt (chat template applied) is at most ``max_tokens`` tokens."""
    kept = dataset.filter(lambda row: prompt_tokens(row["prompt"], tokenizer, chat_template_kwargs) <= max_tokens)
    dropped = len(dataset) - len(kept)
    if dropped:
        logger.warning("max_prompt_length=%d: dropped %d of %d training prompts", max_tokens, dropped, len(dataset))
    if len(kept) == 0:
        raise RecipeError(f"max_prompt_length={max_tokens} drops every training prompt; raise it.")
    return kept


def hub_dataset(script_args: DFPOScriptArguments) -> str | None:
    """The ``dataset`` a math run loads from the Hugging Face Hub (a name, not a local folder), else None."""
    name = script_args.dataset
    if script_args.task != "math" or not isinstance(name, str) or not name:
        return None
    try:
        return None if os.path.exists(name) or name.startswith((".", "/", "~")) else name
    except (OSError, ValueError):
        return name


def read_datasets_offline_when_hub_unreachable(script_args: DFPOScriptArguments) -> None:
    """Without network, ``datasets`` retries the hub for half a minute before failing; when the hub does not
    answer, read its cache only, so that a cached dataset loads and a missing one fails at once."""
    if hub_dataset(script_args) is None:
        return
    from .model import _go_offline, hub_reachable

    if not hub_reachable():
        import datasets

        _go_offline()
        datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


def dataset_unavailable(script_args: DFPOScriptArguments, exc: BaseException, origin: Origin | None) -> str:
    """The one line for a hub dataset that cannot be read without network: the field, where it was set, and how to
    point it at a local copy."""
    from .model import _is_offline_error

    name = hub_dataset(script_args)
    if name is None or not _is_offline_error(exc):
        return ""
    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
    return _headed(origin, "dataset", (
        f"dataset {name!r} cannot be loaded: no network access to the Hugging Face Hub and no "
        f"cached copy ({detail}). Point dataset at a local copy: a folder of its data files (parquet, json or csv; "
        "e.g. a clone of the hub repository) or one written by datasets' save_to_disk, e.g. --dataset "
        "/data/gsm8k; or run once with network to cache it."
    ))


def dataset_not_found(script_args: DFPOScriptArguments, exc: BaseException, origin: Origin | None) -> str:
    """The one line for a math ``dataset`` that names nothing ``datasets`` can find (a local path that is not
    there, a hub name that does not exist): datasets raises FileNotFoundError (DatasetNotFoundError is one)."""
    if script_args.task != "math" or not isinstance(script_args.dataset, str) or not isinstance(exc, FileNotFoundError):
        return ""
    return _headed(origin, "dataset", (
        f"dataset {script_args.dataset!r} not found ({str(exc).splitlines()[0][:200]}); give a hub name (e.g. "
        "openai/gsm8k with dataset_config main), a folder of the dataset's data files (parquet, json or csv) or a "
        "folder written by save_to_disk"
    ))


def build_datasets(
    script_args: DFPOScriptArguments, task: Task, seed: int, origin: Origin | None = None
) -> tuple[Any, Any | None]:
    """(train dataset, held-out dataset or None) with the columns TRL needs checked; ``origin`` says where a field
    was set (the flag, or the recipe's line) for the messages."""
    read_datasets_offline_when_hub_unreachable(script_args)
    try:
        train = task.build_dataset("train", script_args.train_size, seed)
    except ValueError as exc:  # the task's own checks (a missing column or split): the recipe's fault
        field = getattr(exc, "field", None)  # a missing column: headed by where its field was set
        raise RecipeError(str(exc) if field is None else _headed(origin, field, str(exc))) from exc
    except Exception as exc:  # noqa: BLE001 - a dataset that cannot be found is the recipe's to fix; else re-raised
        said = dataset_unavailable(script_args, exc, origin) or dataset_not_found(script_args, exc, origin)
        if said:
            raise RecipeError(said) from exc
        what = f"task {script_args.task!r} building its training data"
        raise UserCodeError(_headed(origin, "task", failed_at(what, exc))) from exc
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


def build_drift_problems(
    script_args: DFPOScriptArguments, task: Task, seed: int, origin: Origin | None = None
) -> Any | None:
    """The held-out problems the drift meter scores (``drift_every`` > 0), or None; a task without equivalent
    forms is refused."""
    if not script_args.drift_every:
        return None
    if not isinstance(task, EquivalentFormsTask):
        raise RecipeError(_headed(origin, "drift_every", (
            f"drift_every={script_args.drift_every} needs a task whose correct answer comes in equivalent forms "
            f"(two_forms, sum_sentence, or a task with form_names, equivalent_forms and form_of); task "
            f"{script_args.task!r} has none. Set drift_every: 0 or change the task."
        )))
    first = script_args.reward_funcs[0] if script_args.reward_funcs else None
    if first is not None and first not in REWARDS and reward_model_given(first):
        raise RecipeError(_headed(origin, "drift_every", (
            f"drift_every={script_args.drift_every} logs which form each correct completion takes through the first "
            f"reward function, but reward_funcs[0]={first!r} is a reward model. List a reward function first, or "
            "set drift_every: 0."
        )))
    return task.build_dataset("test", script_args.drift_size, seed)
