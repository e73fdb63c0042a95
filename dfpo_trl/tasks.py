"""Tasks: a prompt dataset plus the TRL reward functions that score it.

Kept apart from the trainer so that users can add their own: anything with a ``name``, a list of
``reward_funcs`` and a ``build_dataset(split, n, seed)`` method is a :class:`Task`; register a factory
with :func:`register_task` to make it reachable by name (``get_task``) from the CLI and recipes.

Datasets are in TRL's conversational format: a ``"prompt"`` column holding a list of
``{"role", "content"}`` messages, plus the columns the reward functions read (TRL passes every column
except ``"prompt"`` to them as keyword arguments, one list entry per completion).

Reward functions follow TRL's convention ``f(prompts, completions, **kwargs) -> list[float | None]``
(``None``: not applicable, becomes NaN in TRL). They are callable class instances rather than closures
because TRL's asynchronous rollout workers pickle them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from datasets import Dataset, DatasetDict

__all__ = [
    "HELDOUT_SPLIT",
    "TASKS",
    "TRAIN_SPLIT",
    "ArithmeticReward",
    "ArithmeticTask",
    "EquivalentFormsTask",
    "MathTask",
    "MathVerifyReward",
    "RewardFunc",
    "SafeReward",
    "SumSentenceReward",
    "SumSentenceTask",
    "Task",
    "TwoFormsReward",
    "TwoFormsTask",
    "completion_text",
    "get_task",
    "greedy_accuracy",
    "last_number",
    "register_task",
    "safe_reward",
]

RewardFunc = Callable[..., list[float | None]]

TRAIN_SPLIT = "train"
# The held-out split is what the before/after greedy accuracy is measured on.
HELDOUT_SPLIT = "test"
_SPLITS = (TRAIN_SPLIT, HELDOUT_SPLIT)


@runtime_checkable
class Task(Protocol):
    """What the trainer needs from a task: a name, its reward functions, and a dataset builder."""

    name: str
    reward_funcs: list[RewardFunc]

    def build_dataset(self, split: str, n: int | None, seed: int) -> Dataset:
        """``split`` is ``"train"`` or ``"test"`` (held-out); ``n`` rows (``None``: the task's default)."""
        ...


@runtime_checkable
class EquivalentFormsTask(Task, Protocol):
    """A task whose fully correct answer can be written in several surface forms that its reward scores alike: what
    the equivalent-solution drift meter (dfpo_trl.drift, ``drift_every``) measures. ``equivalent_forms(row)`` gives
    one canonical completion per form (in ``form_names`` order) for a dataset row; ``form_of(completion, row)`` says
    which form a completion is, or None."""

    form_names: tuple[str, ...]

    def equivalent_forms(self, row: Mapping[str, Any]) -> list[str]: ...

    def form_of(self, completion: Any, row: Mapping[str, Any]) -> int | None: ...


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(_SPLITS)}")


# --------------------------------------------------------------------------------------------------
# Reward plumbing


def completion_text(completion: Any) -> str:
    """Text of one TRL completion: a plain string, or a conversational list of messages.

    For conversational completions the assistant messages' contents are joined, so a multi-turn
    completion is scored on everything the model wrote.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence):
        parts = []
        for message in completion:
            if isinstance(message, Mapping):
                if message.get("role", "assistant") == "assistant":
                    content = message.get("content")
                    if isinstance(content, list):  # multimodal content blocks: keep the text blocks
                        content = "".join(b.get("text", "") for b in content if isinstance(b, Mapping))
                    parts.append(str(content or ""))
            else:
                parts.append(str(message))
        return "\n".join(parts)
    raise TypeError(
        f"unsupported completion type {type(completion).__name__}: expected str or list of messages"
    )


def _one(prompts: list[Any], completions: list[Any], kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """The reward call's arguments for completion ``i`` alone: per-completion lists cut to one entry."""
    n = len(completions)
    sliced = {
        key: value[i : i + 1] if isinstance(value, (list, tuple)) and len(value) == n else value
        for key, value in kwargs.items()
    }
    return {"prompts": prompts[i : i + 1], "completions": completions[i : i + 1], **sliced}


def _error(name: str, where: str, exc: BaseException) -> RuntimeError:
    return RuntimeError(f"reward function '{name}' failed on {where}: {exc}")


class SafeReward:
    """A reward function whose exceptions name the function and the completion index.

    TRL calls rewards on a whole batch, so a bare ``KeyError`` from deep inside a user's parser says
    nothing about which of the B*G completions caused it. On failure (only then, so the normal path costs
    nothing) the batch is re-run one completion at a time to find the first failing index. Picklable
    when the wrapped function is, as TRL's asynchronous rollout workers require.
    """

    def __init__(self, func: RewardFunc, name: str | None = None) -> None:
        self.func = func
        self.__name__ = name or _callable_name(func)
        functools.update_wrapper(self, func, assigned=("__doc__", "__module__", "__qualname__"), updated=())

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        try:
            return self.func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with context below
            for i in range(len(completions)):
                try:
                    self.func(**_one(prompts, completions, kwargs, i))
                except Exception as item_exc:  # noqa: BLE001
                    raise _error(self.__name__, f"completion {i}", item_exc) from item_exc
            raise _error(self.__name__, f"a batch of {len(completions)} completions", exc) from exc

    def __repr__(self) -> str:
        return f"SafeReward({self.__name__})"


class AsyncSafeReward(SafeReward):
    """:class:`SafeReward` for ``async`` reward functions (TRL gathers those concurrently)."""

    async def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        try:
            return await self.func(prompts=prompts, completions=completions, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with context below
            for i in range(len(completions)):
                try:
                    await self.func(**_one(prompts, completions, kwargs, i))
                except Exception as item_exc:  # noqa: BLE001
                    raise _error(self.__name__, f"completion {i}", item_exc) from item_exc
            raise _error(self.__name__, f"a batch of {len(completions)} completions", exc) from exc


def _callable_name(func: Callable[..., Any]) -> str:
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: Callable[..., Any]) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def safe_reward(func: RewardFunc, name: str | None = None) -> SafeReward:
    """Wrap ``func`` so an exception at completion ``i`` re-raises as
    ``RuntimeError("reward function '<name>' failed on completion <i>: <exc>")`` chained to the original.

    Idempotent; keeps ``__name__`` (TRL logs rewards under it) and async-ness (TRL awaits async ones).
    """
    if isinstance(func, SafeReward):
        return func
    return (AsyncSafeReward if _is_async(func) else SafeReward)(func, name)


# --------------------------------------------------------------------------------------------------
# Arithmetic: the embedded default


ARITHMETIC_PROMPT = "Compute {a} + {b}. Give the final answer as: Answer: <number>"
_ALL_PAIRS = [(a, b) for a in range(10) for b in range(10)]
# Fixed stream for the held-out problems, independent of the run seed, so that every run (and the
# before/after comparison in the README) is measured on the same problems.
_HELDOUT_SEED = 20261126
# Training problems come from their own stream keyed by the run seed; the string salt keeps it from ever
# coinciding with the held-out stream even when a user passes the held-out seed as the run seed.
_TRAIN_SALT = "dfpo-arithmetic-train"

# A number: optional minus, digits, optional decimal part ("7.0" is 7; "7." is 7 followed by a period).
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in ``text`` (leading minus allowed), or ``None`` when there is none."""
    matches = _NUMBER.findall(text)
    return float(matches[-1]) if matches else None


class ArithmeticReward:
    """1.0 when the last number in the completion equals ``a + b`` (from the ``answer`` column), else 0.0.

    "Last number" rather than the text after "Answer:" so that the reward does not also grade the
    format; the prompt asks for the format and the model learns it anyway.
    """

    __name__ = "arithmetic_correct"

    def __call__(
        self, prompts: list[Any], completions: list[Any], answer: list[int], **kwargs: Any
    ) -> list[float | None]:
        if len(answer) != len(completions):
            raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
        rewards: list[float | None] = []
        for completion, target in zip(completions, answer, strict=True):
            value = last_number(completion_text(completion))
            rewards.append(1.0 if value is not None and value == float(target) else 0.0)
        return rewards


def _arithmetic_pairs(split: str, n: int, seed: int) -> list[tuple[int, int]]:
    if split == TRAIN_SPLIT:
        rng = random.Random(f"{_TRAIN_SALT}:{seed}")
        return [rng.choice(_ALL_PAIRS) for _ in range(n)]
    rng = random.Random(_HELDOUT_SEED)
    unique = list(_ALL_PAIRS)
    rng.shuffle(unique)
    if n <= len(unique):
        return unique[:n]
    # More than the 100 distinct problems: every pair once, then deterministic draws with replacement.
    return unique + [rng.choice(_ALL_PAIRS) for _ in range(n - len(unique))]


@dataclass
class ArithmeticTask:
    """Single-digit addition "Compute a + b.", reward on the last number of the completion.

    Splits:
      * ``"train"``: ``n`` pairs drawn uniformly with replacement from a stream seeded by ``seed``.
      * ``"test"`` (held-out): a fixed list that ignores ``seed``; for ``n <= 100`` it is ``n`` distinct
        pairs (a fixed permutation of all 100), for ``n > 100`` all 100 pairs once followed by
        ``n - 100`` fixed draws with replacement.

    With only 100 possible problems the splits cannot be disjoint in *pairs* without starving training;
    they are disjoint in *streams*: held-out accuracy measures the policy's greedy answer on a fixed,
    run-independent set, not memorisation of a sampled training order.
    """

    name: str = "arithmetic"
    default_train_size: int = 2000
    default_heldout_size: int = 100
    reward_funcs: list[RewardFunc] = field(default_factory=lambda: [safe_reward(ArithmeticReward())])
    prompt_template: str = ARITHMETIC_PROMPT  # formatted with a and b

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows: ``prompt`` (one user message), ``answer`` (a + b), ``a``, ``b``."""
        _check_split(split)
        if n is None:
            n = self.default_train_size if split == TRAIN_SPLIT else self.default_heldout_size
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        pairs = _arithmetic_pairs(split, n, seed)
        messages = [[{"role": "user", "content": self.prompt_template.format(a=a, b=b)}] for a, b in pairs]
        return Dataset.from_dict(
            {
                "prompt": messages,
                "answer": [a + b for a, b in pairs],
                "a": [a for a, _ in pairs],
                "b": [b for _, b in pairs],
            }
        )


# --------------------------------------------------------------------------------------------------
# Sum sentence: the arithmetic problems with a required answer sentence (a long shared stretch)


# The untrained SmolLM2-135M-Instruct's own greedy phrasing, so it follows the format from the start.
SUM_SENTENCE_LEAD = "To compute {a} + {b}, we add the numbers: {a} + {b} ="
SUM_SENTENCE_PROMPT = (
    "Compute {a} + {b}. Reply in exactly this format:\n" + SUM_SENTENCE_LEAD + " <number>."
)
# Characters a reply may open with before the required sentence (a quote the model copies from the prompt).
_OPENING = " \t\n\"'`*"


class SumSentenceReward:
    """1.0 when the completion opens with the prompt's required sentence (``SUM_SENTENCE_LEAD`` with the
    problem's numbers; leading blanks, quotes, backticks and asterisks ignored) and its last number equals
    ``a + b``; ``unformatted`` (0.5) when the last number is the sum without that opening; else 0.0.

    The format is rewarded on purpose: it makes the best completions of a group share the lead's tokens, so the
    group's positive- and negative-advantage members share a long stretch whose gradients should cancel (the
    shared-prefix residual has something to measure). Only partly, because at temperature 1 the untrained
    model opens with the exact sentence too rarely (about 3%) for an all-or-nothing reward to give a signal.
    """

    __name__ = "sum_sentence_correct"

    def __init__(self, unformatted: float = 0.5) -> None:
        self.unformatted = unformatted

    def __call__(
        self, prompts: list[Any], completions: list[Any], answer: list[int], a: list[int], b: list[int],
        **kwargs: Any,
    ) -> list[float | None]:
        if not len(answer) == len(a) == len(b) == len(completions):
            raise ValueError(
                f"got {len(completions)} completions but {len(answer)} answers, {len(a)} a's and {len(b)} b's"
            )
        rewards: list[float | None] = []
        for completion, target, x, y in zip(completions, answer, a, b, strict=True):
            text = completion_text(completion).lstrip(_OPENING)
            value = last_number(text)
            if value is None or value != float(target):
                rewards.append(0.0)
            else:
                rewards.append(1.0 if text.startswith(SUM_SENTENCE_LEAD.format(a=x, b=y)) else self.unformatted)
        return rewards


@dataclass
class SumSentenceTask(ArithmeticTask):
    """The arithmetic task's problems ("Compute a + b", single digits, the same train and held-out splits),
    but the prompt spells out the one sentence to answer with, and only that sentence earns the full reward:

        Compute 3 + 5. Reply in exactly this format:
        To compute 3 + 5, we add the numbers: 3 + 5 = <number>.

    A correct completion is that sentence with the sum: 20 tokens (SmolLM2's tokenizer) fixed by the prompt
    before the first one that can differ between right and wrong answers (the sum's digits), so once the
    policy follows the format the members of a group share a long prefix and differ at the number. That is
    the case where shared-token cancellation (docs/cancellation.md, docs/metrics.md) has something to act on;
    ``arithmetic``'s completions vary in wording and share little. The sentence is the untrained
    SmolLM2-135M-Instruct's own greedy phrasing, so the format is reachable at once: on the CPU (the embedded
    Q4_1 GGUF) greedy decoding followed it on all of 40 random problems and scores 0.925 on 40 held-out ones;
    sampling at temperature 1 (TRL's setting; 80 completions) scores 0.16 on average: 6% the sentence with the
    right sum, 19% the right sum without it (``arithmetic``: 0.38 sampled in the same setup, 0.33 on the GPU), so
    the reward starts low but non-zero and most of what there is to learn is the format, i.e. the shared stretch.
    Reward: :class:`SumSentenceReward`: 1 for the sentence with the correct sum, 0.5 for the correct sum
    without the sentence, 0 otherwise (held-out "accuracy" is its mean under greedy decoding). Splits: exactly
    :class:`ArithmeticTask`'s (the same streams), so the two tasks differ only in the required answer format.
    """

    name: str = "sum_sentence"
    reward_funcs: list[RewardFunc] = field(default_factory=lambda: [safe_reward(SumSentenceReward())])
    prompt_template: str = SUM_SENTENCE_PROMPT
    form_names: tuple[str, ...] = ("period", "no_period")

    def equivalent_forms(self, row: Mapping[str, Any]) -> list[str]:
        """The completions the reward scores alike at full credit and that differ only in surface form (the
        drift meter's equivalent set, dfpo_trl.drift): the required sentence with the sum, with and without its
        final period."""
        sentence = f"{SUM_SENTENCE_LEAD.format(a=row['a'], b=row['b'])} {row['answer']}"
        return [sentence + ".", sentence]

    def form_of(self, completion: Any, row: Mapping[str, Any]) -> int | None:
        """Index of the equivalent form ``completion`` is (blanks and the reward's allowed opening characters
        stripped), or None."""
        text = completion_text(completion).lstrip(_OPENING).rstrip()
        forms = self.equivalent_forms(row)
        return forms.index(text) if text in forms else None


# --------------------------------------------------------------------------------------------------
# Two forms: one answer, two equally rewarded sentences (equivalent-solution drift)


TWO_FORMS = ("The sum is {s}.", "The answer is {s}.")
TWO_FORMS_PROMPT = 'Compute {a} + {b}. Reply with "The sum is <number>." or "The answer is <number>."'


class TwoFormsReward:
    """1.0 when the whole completion (blanks stripped) is one of ``TWO_FORMS`` with the sum ``a + b``, either form
    alike; ``unformatted`` (0.5) when it is not but its last number is the sum; else 0.0."""

    __name__ = "two_forms_correct"

    def __init__(self, unformatted: float = 0.5) -> None:
        self.unformatted = unformatted

    def __call__(
        self, prompts: list[Any], completions: list[Any], answer: list[int], **kwargs: Any
    ) -> list[float | None]:
        if len(answer) != len(completions):
            raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
        rewards: list[float | None] = []
        for completion, target in zip(completions, answer, strict=True):
            text = completion_text(completion).strip()
            if text in [form.format(s=target) for form in TWO_FORMS]:
                rewards.append(1.0)
            else:
                value = last_number(text)
                rewards.append(self.unformatted if value is not None and value == float(target) else 0.0)
        return rewards


@dataclass
class TwoFormsTask(ArithmeticTask):
    """The arithmetic task's problems, answered in either of two sentences the reward treats alike:

        Compute 3 + 5. Reply with "The sum is <number>." or "The answer is <number>."

    Full reward for "The sum is 8." and for "The answer is 8." (the whole completion), 0.5 for the right sum in any
    other wording (:class:`TwoFormsReward`). The two forms are an equivalent set in the sense of the DFPO paper's
    Corollary 3.2: equal reward, equal advantage in a group, different surface form, so any drift of their
    log-odds during training is reward-irrelevant (the drift meter, dfpo_trl.drift and docs/metrics.md). They were
    chosen because the untrained SmolLM2-135M-Instruct gives them similar probability under this prompt (mean
    log-odds "sum" against "answer" −0.8, standard deviation 0.8 over 16 problems; the pair in the prompt's order
    "Answer: <number>" / "The answer is <number>." was −4.6), so the equivalent set starts mixed and a collapse
    onto one form is visible. Splits: exactly :class:`ArithmeticTask`'s.
    """

    name: str = "two_forms"
    reward_funcs: list[RewardFunc] = field(default_factory=lambda: [safe_reward(TwoFormsReward())])
    prompt_template: str = TWO_FORMS_PROMPT
    form_names: tuple[str, ...] = ("sum", "answer")

    def equivalent_forms(self, row: Mapping[str, Any]) -> list[str]:
        """The full-credit completions of ``row``'s problem, one per form (the drift meter's equivalent set)."""
        return [form.format(s=row["answer"]) for form in TWO_FORMS]

    def form_of(self, completion: Any, row: Mapping[str, Any]) -> int | None:
        """Index of the form ``completion`` is (blanks stripped), or None."""
        text = completion_text(completion).strip()
        forms = self.equivalent_forms(row)
        return forms.index(text) if text in forms else None


# --------------------------------------------------------------------------------------------------
# Math: any `datasets` dataset, graded with math-verify


def _gold_text(answer: Any) -> str:
    text = str(answer).strip()
    # GSM8K-style answers carry the worked solution before "#### <final answer>".
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text


class MathVerifyReward:
    """1.0 when math-verify judges the completion's answer equal to the gold ``answer``, else 0.0.

    A gold answer math-verify cannot parse even when boxed also gets 0.0, so the whole group has zero
    advantage and contributes no gradient (instead of NaN rows).
    """

    __name__ = "math_verify_correct"

    def __call__(
        self, prompts: list[Any], completions: list[Any], answer: list[Any], **kwargs: Any
    ) -> list[float | None]:
        from math_verify import parse, verify

        # math-verify times out with signal.alarm, which works only in the main thread.
        main = threading.current_thread() is threading.main_thread()
        if not main:
            logging.getLogger("math_verify").setLevel(logging.ERROR)
        parse_timeout = 10 if main else None
        verify_timeout = 5 if main else None
        golds: dict[str, list[Any]] = {}  # a group's G completions share one gold answer: parse it once
        rewards: list[float | None] = []
        for completion, gold_raw in zip(completions, answer, strict=True):
            gold_text = _gold_text(gold_raw)
            if gold_text not in golds:
                gold = parse(gold_text, parsing_timeout=parse_timeout)
                if not gold:  # bare LaTeX such as "x^2+1" is only found inside delimiters
                    gold = parse(f"\\boxed{{{gold_text}}}", parsing_timeout=parse_timeout)
                golds[gold_text] = gold
            gold = golds[gold_text]
            if not gold:
                rewards.append(0.0)
                continue
            pred = parse(completion_text(completion), parsing_timeout=parse_timeout)
            rewards.append(float(bool(pred) and verify(gold, pred, timeout_seconds=verify_timeout)))
        return rewards


MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass
class MathTask:
    """Problems and answers from any Hugging Face ``datasets`` dataset, graded by math-verify.

    ``dataset`` is a hub name or local path (loaded with ``datasets.load_dataset(dataset, config)``), or
    an in-memory ``DatasetDict`` / ``Dataset`` (a bare ``Dataset`` serves only the train split).
    ``split`` and ``test_split`` name the dataset's splits used for training and held-out evaluation.
    The held-out rows are the first ``n`` of ``test_split`` whatever the seed, for comparability.
    """

    dataset: str | Dataset | DatasetDict | None = None
    split: str = "train"
    test_split: str = "test"
    problem_column: str = "problem"
    answer_column: str = "answer"
    config: str | None = None
    instruction: str | None = MATH_INSTRUCTION
    name: str = "math"
    reward_funcs: list[RewardFunc] = field(default_factory=lambda: [safe_reward(MathVerifyReward())])

    def __post_init__(self) -> None:
        if self.dataset is None or self.dataset == "":
            raise ValueError(
                "math task: no dataset given; set dataset (CLI: --dataset) to a hub name or local path with "
                f"columns {self.problem_column!r} and {self.answer_column!r}"
            )

    def _load(self, split_name: str) -> Dataset:
        source = self.dataset
        if isinstance(source, Dataset):
            if split_name != self.split:
                raise ValueError(
                    f"math task: an in-memory Dataset serves only the train split ({self.split!r}); pass a "
                    f"DatasetDict with a {split_name!r} split for held-out evaluation"
                )
            return source
        if isinstance(source, str):
            import datasets

            # Only the splits we need are materialised; a missing split raises datasets' own ValueError
            # listing the available ones, which we extend with the field to set.
            try:
                return datasets.load_dataset(source, self.config, split=split_name)
            except ValueError as exc:
                if "split" in str(exc).lower():
                    raise ValueError(
                        f"math task: dataset {source!r} has no split {split_name!r} ({exc}); set split / "
                        f"test_split (CLI: --split / --test-split)"
                    ) from exc
                raise
        if split_name not in source:
            raise ValueError(
                f"math task: split {split_name!r} not in the dataset; available splits: {list(source)}; set "
                f"split / test_split (CLI: --split / --test-split)"
            )
        return source[split_name]

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows: ``prompt`` (one user message: problem + instruction) and ``answer`` (gold, as text)."""
        _check_split(split)
        raw = self._load(self.split if split == TRAIN_SPLIT else self.test_split)
        for column, fld in ((self.problem_column, "problem_column"), (self.answer_column, "answer_column")):
            if column not in raw.column_names:
                flag = "--" + fld.replace("_", "-")
                raise ValueError(
                    f"math task: column {column!r} not found; available columns: {raw.column_names}; set "
                    f"{fld} (CLI: {flag}) to the dataset's column"
                )
        if split == TRAIN_SPLIT:
            raw = raw.shuffle(seed=seed)
        if n is not None:
            raw = raw.select(range(min(n, len(raw))))
        suffix = f"\n\n{self.instruction}" if self.instruction else ""
        # Only the columns the reward reads (TRL hands every column to every reward call); gold answers as
        # text whatever the source type, since math-verify parses strings.
        return Dataset.from_dict(
            {
                "prompt": [
                    [{"role": "user", "content": f"{problem}{suffix}"}]
                    for problem in raw[self.problem_column]
                ],
                "answer": [str(answer) for answer in raw[self.answer_column]],
            }
        )


# --------------------------------------------------------------------------------------------------
# Registry


TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask, "math": MathTask, "sum_sentence": SumSentenceTask, "two_forms": TwoFormsTask,
}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make ``get_task(name, **kwargs)`` build ``factory(**kwargs)``."""
    TASKS[name] = factory


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task; ``kwargs`` go to its factory (e.g. ``dataset=`` for ``math``)."""
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None
    return factory(**kwargs)


# --------------------------------------------------------------------------------------------------
# Held-out greedy accuracy


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Dataset | Sequence[Mapping[str, Any]],
    task: Task | RewardFunc,
    max_new_tokens: int = 32,
    batch_size: int = 32,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> float:
    """Mean reward of greedy completions on ``problems`` (rows from ``task.build_dataset``).

    Scored with the task's first reward function (its correctness reward), or with ``task`` itself when
    it is a reward function; rows scored ``None`` are left out of the mean. The prompt is rendered with
    the tokenizer's chat template (generation prompt added) and left-padded so a batch's completions
    start at the same position. Greedy decoding is deterministic, so each distinct prompt is generated
    once (a held-out set larger than the 100 arithmetic problems repeats them). Model mode and
    tokenizer padding side are restored afterwards, so it can run between training steps.
    ``chat_template_kwargs`` go to ``apply_chat_template`` (e.g. ``{"enable_thinking": False}`` for Qwen3), as
    TRL passes its ``chat_template_kwargs`` during training.
    """
    import torch

    reward = task.reward_funcs[0] if hasattr(task, "reward_funcs") else task
    rows = [dict(r) for r in problems]
    if not rows:
        return 0.0
    conversational = not isinstance(rows[0]["prompt"], str)
    texts = [
        tokenizer.apply_chat_template(
            r["prompt"], tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
        )
        if conversational
        else r["prompt"]
        for r in rows
    ]
    # Distinct prompts, longest first: similar lengths share a batch (less padding) and an out-of-memory
    # error, if any, comes at the start.
    unique = sorted(set(texts), key=len, reverse=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    old_side = tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    generated: dict[str, str] = {}
    try:
        for start in range(0, len(unique), batch_size):
            chunk = unique[start : start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(model.device)
            with torch.inference_mode():
                out = model.generate(
                    **enc,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad_id,
                )
            decoded = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            generated.update(zip(chunk, decoded, strict=True))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)

    decoded_rows = [generated[t] for t in texts]
    completions: list[Any] = (
        [[{"role": "assistant", "content": d}] for d in decoded_rows] if conversational else decoded_rows
    )
    extra = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    values = reward(prompts=[r["prompt"] for r in rows], completions=completions, **extra)
    scores = [float(v) for v in values if v is not None]
    return sum(scores) / len(scores) if scores else 0.0
