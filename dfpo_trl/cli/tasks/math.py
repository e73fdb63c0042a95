"""The ``math`` task: problems and gold answers from any Hugging Face ``datasets`` dataset, graded by math-verify."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict

from ...config.rules import missing_column
from ...rewards import safe_reward
from .base import TRAIN_SPLIT, RewardFunc, check_split, completion_text


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


def _saved_to_disk(path: str) -> bool:
    """Whether ``path`` is a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    folder = Path(path)
    try:
        return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()
    except OSError:  # not a path this file system can take: a hub name, for load_dataset to judge
        return False


MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class MissingColumnError(ValueError):
    """The dataset lacks the column ``field`` names: ``dfpo-train`` heads the message with where that field was set."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class MathTask:
    """Problems and answers from any Hugging Face ``datasets`` dataset, graded by math-verify.

    ``dataset`` is a hub name or local path (loaded with ``datasets.load_dataset(dataset, config)``; a folder
    written by ``save_to_disk`` with ``datasets.load_from_disk``), or
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
        if isinstance(source, str) and _saved_to_disk(source):
            import datasets

            source = datasets.load_from_disk(source)  # a folder written by save_to_disk (load_dataset cannot read it)
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
                        f"test_split (CLI: --split / --test_split)"
                    ) from exc
                raise
        if split_name not in source:
            raise ValueError(
                f"math task: split {split_name!r} not in the dataset; available splits: {list(source)}; set "
                f"split / test_split (CLI: --split / --test_split)"
            )
        return source[split_name]

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows: ``prompt`` (one user message: problem + instruction) and ``answer`` (gold, as text)."""
        check_split(split)
        raw = self._load(self.split if split == TRAIN_SPLIT else self.test_split)
        for column, fld in ((self.problem_column, "problem_column"), (self.answer_column, "answer_column")):
            if column not in raw.column_names:
                raise MissingColumnError(fld, missing_column(column, fld, raw.column_names))
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

