"""The offline single-digit addition tasks and their rewards: ``arithmetic``, ``sum_sentence`` and ``two_forms``.

All three draw the same problems "Compute a + b" (single digits) from the same train and held-out streams and
differ in the answer format their reward asks for.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset

from ...rewards import safe_reward
from .base import TRAIN_SPLIT, RewardFunc, check_split, completion_text

# --------------------------------------------------------------------------------------------------
# Arithmetic: the embedded default


ARITHMETIC_PROMPT = "Compute {a} + {b}. Give the final answer as: Answer: <number>"
_ALL_PAIRS = [(a, b) for a in range(10) for b in range(10)]
# Fixed stream for the held-out problems, independent of the run seed, so that every run (and the
# summary's before/after comparison) is measured on the same problems.
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


def _ends_with_sum(text: str, target: int) -> bool:
    """Whether the last number in ``text`` is ``target``."""
    value = last_number(text)
    return value is not None and value == float(target)


def _texts(completions: list[Any], answer: list[int]) -> list[tuple[str, int]]:
    """(text, gold sum) per completion, the ``answer`` column checked to have one entry per completion."""
    if len(answer) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
    return [(completion_text(c), target) for c, target in zip(completions, answer, strict=True)]


class ArithmeticReward:
    """1.0 when the last number in the completion equals ``a + b`` (from the ``answer`` column), else 0.0.

    "Last number" rather than the text after "Answer:" so that the reward does not also grade the
    format; the prompt asks for the format and the model learns it anyway.
    """

    __name__ = "arithmetic_correct"

    def __call__(
        self, prompts: list[Any], completions: list[Any], answer: list[int], **kwargs: Any
    ) -> list[float | None]:
        return [1.0 if _ends_with_sum(text, target) else 0.0 for text, target in _texts(completions, answer)]


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
        check_split(split)
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
    the case where shared-token cancellation (docs/source/concepts/cancellation.md, docs/source/concepts/metrics.md) has
    something to act on; ``arithmetic``'s completions vary in wording and share little. The sentence is the untrained
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
        drift meter's equivalent set, dfpo_trl.metrics.drift): the required sentence with the sum, with and without its
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
        rewards: list[float | None] = []
        for text, target in _texts(completions, answer):
            if text.strip() in [form.format(s=target) for form in TWO_FORMS]:
                rewards.append(1.0)
            else:
                rewards.append(self.unformatted if _ends_with_sum(text, target) else 0.0)
        return rewards


@dataclass
class TwoFormsTask(ArithmeticTask):
    """The arithmetic task's problems, answered in either of two sentences the reward treats alike:

        Compute 3 + 5. Reply with "The sum is <number>." or "The answer is <number>."

    Full reward for "The sum is 8." and for "The answer is 8." (the whole completion), 0.5 for the right sum in any
    other wording (:class:`TwoFormsReward`). The two forms are an equivalent set in the sense of the DFPO paper's
    Corollary 3.2: equal reward, equal advantage in a group, different surface form, so any drift of their
    log-odds during training is reward-irrelevant (the drift meter, dfpo_trl.metrics.drift and
    docs/source/concepts/metrics.md). They were chosen because the untrained SmolLM2-135M-Instruct gives them similar
    probability under this prompt (mean log-odds "sum" against "answer" −0.8, standard deviation 0.8 over 16 problems;
    the pair in the prompt's order "Answer: <number>" / "The answer is <number>." was −4.6), so the equivalent set
    starts mixed and a collapse onto one form is visible. Splits: exactly :class:`ArithmeticTask`'s.
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

