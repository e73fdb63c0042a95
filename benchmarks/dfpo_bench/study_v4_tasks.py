"""Study v4 part 3's task, given to ``dfpo-train --task`` by import path (the runs start in the repository root):

* ``dfpo_bench.study_v4_tasks:two_digit`` — two-digit addition "Compute a + b" (a, b in 10..99), answered in
  "The sum is n." or "The answer is n." (study v3's two forms). Reward 1 for either form with the right sum and 0
  otherwise (:class:`dfpo_trl.cli.TwoFormsReward` with ``unformatted=0``): a wrong sum in either form gets 0, so the
  form is not the reward signal; what separates the rewarded half of a group from the rest is the number.

Why two-digit addition: single-digit addition is solved at once (nearly every group all-correct, no signal), while
two-digit sums with carries are not, so that a group of 8 is split (the pilot measures how evenly: registered gate).
The two forms have the same token length for every number under SmolLM2's tokenizer ('The', ' sum'/' answer', ' is',
' ', digits, '.'): they differ in one token, and a form's length never says which form it is
(``benchmarks/tests/test_study_v4_long.py`` checks it for every sum 0..198 on the cached tokenizer files).

Splits: the held-out split is a fixed list of pairs (its own stream, independent of the run seed); the train split
and the warm start's SFT set draw from the other pairs only, each from its own stream, so the drift meter's and the
gate's held-out prompts are never trained on.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset
from dfpo_trl import RewardFunc, safe_reward
from dfpo_trl.cli import TwoFormsReward, TwoFormsTask

FORMS = ("The sum is {s}.", "The answer is {s}.")  # the same strings as dfpo_trl's two_forms (v3's forms)
PROMPT = 'Compute {a} + {b}. Reply with "The sum is <number>." or "The answer is <number>."'
PAIRS = [(a, b) for a in range(10, 100) for b in range(10, 100)]
HELDOUT_SIZE = 256
_HELDOUT_SEED = "dfpo-v4-two-digit-heldout"
_TRAIN_SALT = "dfpo-v4-two-digit-train"
_SFT_SALT = "dfpo-v4-two-digit-sft"
_WRITTEN = [re.compile("^" + re.escape(f).replace(re.escape("{s}"), "(-?[0-9]+)") + "$") for f in FORMS]


def heldout_pairs() -> list[tuple[int, int]]:
    """The fixed held-out pairs (HELDOUT_SIZE distinct ones)."""
    pairs = list(PAIRS)
    random.Random(_HELDOUT_SEED).shuffle(pairs)
    return pairs[:HELDOUT_SIZE]


def training_pairs() -> list[tuple[int, int]]:
    """Every pair not held out, in a fixed order."""
    held = set(heldout_pairs())
    return [p for p in PAIRS if p not in held]


def draw(salt: str, n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(f"{salt}:{seed}")
    pool = training_pairs()
    return [rng.choice(pool) for _ in range(n)]


def written_form(text: str) -> tuple[int, int] | None:
    """(form index, the number written) when ``text`` (blanks stripped) is one of the forms with any integer."""
    for index, pattern in enumerate(_WRITTEN):
        match = pattern.match(text.strip())
        if match:
            return index, int(match.group(1))
    return None


@dataclass
class TwoDigitTwoFormsTask(TwoFormsTask):
    """Two-digit addition in v3's two forms, strict reward (other wordings 0, a wrong sum in a form 0)."""

    name: str = "two_digit_two_forms"
    default_train_size: int = 2048
    default_heldout_size: int = HELDOUT_SIZE
    reward_funcs: list[RewardFunc] = field(default_factory=lambda: [safe_reward(TwoFormsReward(unformatted=0.0))])
    prompt_template: str = PROMPT

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows: ``prompt``, ``answer`` (a + b), ``a``, ``b``, ``row_id``. ``"test"``: the first n held-out pairs
        (n ≤ HELDOUT_SIZE); ``"train"``: n draws from the other pairs, a stream keyed by ``seed``."""
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}")
        if split == "test":
            n = self.default_heldout_size if n is None else n
            if n > HELDOUT_SIZE:
                raise ValueError(f"the held-out split has {HELDOUT_SIZE} pairs, asked for {n}")
            pairs = heldout_pairs()[:n]
        else:
            pairs = draw(_TRAIN_SALT, self.default_train_size if n is None else n, seed)
        return rows(pairs, self.prompt_template)

    def written_form(self, completion: Any) -> int | None:
        """The form a completion is written in, whatever number it gives (None: neither form)."""
        found = written_form(text_of(completion))
        return None if found is None else found[0]


def text_of(completion: Any) -> str:
    """A TRL completion's text: a string, or the assistant messages' contents joined (dfpo_trl's own reader is not
    in its root ``__all__``, which is all the benchmarks import)."""
    if isinstance(completion, str):
        return completion
    return "\n".join(str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant")


def rows(pairs: list[tuple[int, int]], template: str = PROMPT) -> Dataset:
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": template.format(a=a, b=b)}] for a, b in pairs],
        "answer": [a + b for a, b in pairs], "a": [a for a, _ in pairs], "b": [b for _, b in pairs],
        "row_id": list(range(len(pairs)))})


def sft_examples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """The warm start's supervised set: n / 2 training-split problems from their own stream, each written in both
    forms with the correct sum (examples 2k and 2k + 1: problem k in form 0, then form 1), so the cross-entropy's
    optimum for every problem is an even split of the two forms, not only on average over problems. Rows: prompt
    (messages), completion (text), form, a, b."""
    if n % 2:
        raise ValueError(f"the SFT set needs an even size (every problem in both forms), got {n}")
    return [{"prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
             "completion": form.format(s=a + b), "form": f, "a": a, "b": b}
            for a, b in draw(_SFT_SALT, n // 2, seed) for f, form in enumerate(FORMS)]


def forms_of(row: Mapping[str, Any]) -> list[str]:
    return [f.format(s=row["answer"]) for f in FORMS]


def two_digit() -> TwoDigitTwoFormsTask:
    return TwoDigitTwoFormsTask()
