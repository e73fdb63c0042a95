"""Tasks and rewards: prompts, splits, reward parsing, error messages. No model, no network."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

from dfpo_trl.cli.evaluation import greedy_accuracy
from dfpo_trl.cli.tasks import (
    REWARDS,
    SUM_SENTENCE_LEAD,
    TASKS,
    ArithmeticReward,
    ArithmeticTask,
    MathTask,
    SafeReward,
    SumSentenceReward,
    SumSentenceTask,
    Task,
    completion_text,
    get_reward,
    get_task,
    last_number,
    register_reward,
    register_task,
    safe_reward,
)

PROMPT_RE = re.compile(r"^Compute (\d) \+ (\d)\. Give the final answer as: Answer: <number>$")


def _pairs(ds: Dataset) -> list[tuple[int, int]]:
    return list(zip(ds["a"], ds["b"], strict=True))


# -- arithmetic dataset ---------------------------------------------------------------------------


def test_arithmetic_prompt_format_and_answer() -> None:
    ds = get_task("arithmetic").build_dataset("train", 50, seed=0)
    assert len(ds) == 50
    for row in ds:
        assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        match = PROMPT_RE.match(row["prompt"][0]["content"])
        assert match, row["prompt"][0]["content"]
        a, b = int(match[1]), int(match[2])
        assert (a, b) == (row["a"], row["b"])
        assert row["answer"] == a + b


def test_arithmetic_train_is_deterministic_per_seed() -> None:
    task = ArithmeticTask()
    first = _pairs(task.build_dataset("train", 200, seed=3))
    assert first == _pairs(task.build_dataset("train", 200, seed=3))
    assert first != _pairs(task.build_dataset("train", 200, seed=4))


def test_arithmetic_heldout_is_fixed_unique_and_seed_independent() -> None:
    task = ArithmeticTask()
    held = _pairs(task.build_dataset("test", 100, seed=0))
    assert held == _pairs(task.build_dataset("test", 100, seed=123))
    assert sorted(held) == [(a, b) for a in range(10) for b in range(10)]
    # A smaller held-out set is a prefix of the larger: unique pairs, comparable across sizes.
    assert _pairs(task.build_dataset("test", 30, seed=0)) == held[:30]
    # Beyond 100: every pair once, then fixed draws with replacement.
    big = _pairs(task.build_dataset("test", 250, seed=7))
    assert big[:100] == held and len(big) == 250
    assert big == _pairs(task.build_dataset("test", 250, seed=8))


def test_arithmetic_train_and_heldout_streams_differ() -> None:
    task = ArithmeticTask()
    held = _pairs(task.build_dataset("test", 100, seed=0))
    for seed in range(5):
        assert _pairs(task.build_dataset("train", 100, seed=seed)) != held


def test_arithmetic_defaults_and_bad_split() -> None:
    task = ArithmeticTask()
    assert len(task.build_dataset("test")) == task.default_heldout_size
    with pytest.raises(ValueError, match="unknown split"):
        task.build_dataset("validation", 5, 0)


# -- reward parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 7", 7.0),
        ("3 + 4 = 7. Answer: 7.", 7.0),
        ("Answer: -3", -3.0),
        ("12 then 15", 15.0),
        ("Answer: 7.0", 7.0),
        ("no number here", None),
        ("", None),
    ],
)
def test_last_number(text: str, expected: float | None) -> None:
    assert last_number(text) == expected


def test_arithmetic_reward_strings_and_conversational() -> None:
    reward = get_task("arithmetic").reward_funcs[0]
    completions = [
        "3 + 4 = 7\nAnswer: 7",
        [{"role": "assistant", "content": "Answer: 7"}],
        "Answer: 8",
        [{"role": "assistant", "content": "I think 7, no wait, 9"}],
        "seven",
        [{"role": "assistant", "content": ""}],
    ]
    prompts = [[{"role": "user", "content": "Compute 3 + 4."}]] * len(completions)
    out = reward(prompts=prompts, completions=completions, answer=[7] * len(completions), trainer_state=None)
    assert out == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_arithmetic_reward_negative_target() -> None:
    out = ArithmeticReward()(prompts=["p", "p"], completions=["Answer: -2", "Answer: 2"], answer=[-2, -2])
    assert out == [1.0, 0.0]


def test_reward_names_for_trl_logging() -> None:
    assert get_task("arithmetic").reward_funcs[0].__name__ == "arithmetic_correct"
    assert MathTask(dataset=Dataset.from_dict({})).reward_funcs[0].__name__ == "math_verify_correct"


def test_completion_text_joins_assistant_turns() -> None:
    msgs = [
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "ignored"},
        {"role": "assistant", "content": "b"},
    ]
    assert completion_text(msgs) == "a\nb"
    assert completion_text("x") == "x"


# -- error wrapper --------------------------------------------------------------------------------


def fragile_reward(prompts, completions, **kwargs):
    """Fails on any completion containing "boom"; module level so it pickles."""
    return [float(len(c)) if "boom" not in c else {}["missing"] for c in completions]


def test_safe_reward_names_function_and_index() -> None:
    wrapped = safe_reward(fragile_reward)
    assert wrapped.__name__ == "fragile_reward"
    assert wrapped(prompts=["p"] * 2, completions=["ok", "fine"], answer=[1, 2]) == [2.0, 4.0]
    line = fragile_reward.__code__.co_firstlineno + 2
    with pytest.raises(RuntimeError) as info:
        wrapped(
            prompts=["p"] * 4, completions=["a", "b", "boom", "boom"], answer=[1, 2, 3, 4], log_extra=None
        )
    assert str(info.value) == (
        f"reward function 'fragile_reward' at {_here()}:{line}: raised KeyError: 'missing' on completion 2 of the "
        "rollout's 4; fix the function or drop it from reward_funcs"
    )
    assert isinstance(info.value.__cause__, KeyError)
    wrapped.group_size = 2  # DFPOTrainer sets it (num_generations): the message names the group
    with pytest.raises(RuntimeError, match=r"on completion 3 of the rollout's 4 \(group 1, its completion 1 of 2\);"):
        wrapped(prompts=["p"] * 4, completions=["a", "b", "c", "boom"])


def _here() -> str:
    """This file as the messages show it (relative to the working directory when below it)."""
    return os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__


class FirstCallFails:
    """Raises on its first call only (state the re-run cannot reproduce): the message says the batch."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("not ready")
        return [1.0] * len(completions)


def test_safe_reward_failure_without_a_completion_names_the_batch() -> None:
    wrapped = safe_reward(FirstCallFails())
    line = FirstCallFails.__call__.__code__.co_firstlineno + 3
    with pytest.raises(RuntimeError) as info:
        wrapped(prompts=["p"] * 2, completions=["a", "b"])
    assert str(info.value) == (
        f"reward function 'FirstCallFails' at {_here()}:{line}: raised ValueError: not ready on the rollout's batch "
        "of 2 completions; fix the function or drop it from reward_funcs"
    )


def short_reward(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def nan_reward(prompts, completions, **kwargs):
    return [1.0, float("nan"), 0.0][: len(completions)]


def test_safe_reward_refuses_a_wrong_length_and_nan() -> None:
    line = short_reward.__code__.co_firstlineno
    with pytest.raises(RuntimeError) as info:
        safe_reward(short_reward)(prompts=["p"] * 3, completions=["a", "b", "c"])
    assert str(info.value) == (
        f"reward function 'short_reward' at {_here()}:{line}: returned 2 rewards for 3 completions, on the rollout's "
        "batch of 3 completions; return one float per completion, in order (None where the reward does not apply)"
    )
    wrapped = safe_reward(nan_reward)
    wrapped.group_size = 3
    line = nan_reward.__code__.co_firstlineno
    with pytest.raises(RuntimeError) as info:
        wrapped(prompts=["p"] * 3, completions=["a", "b", "c"])
    assert str(info.value) == (
        f"reward function 'nan_reward' at {_here()}:{line}: returned nan, not a finite number, on completion 1 of the "
        "rollout's 3 (group 0, its completion 1 of 3); return one float per completion, in order (None where the "
        "reward does not apply)"
    )
    assert safe_reward(nan_reward)(prompts=["p"], completions=["a"]) == [1.0]


def test_safe_reward_is_idempotent_and_picklable() -> None:
    wrapped = safe_reward(fragile_reward)
    assert safe_reward(wrapped) is wrapped
    clone = pickle.loads(pickle.dumps(wrapped))
    assert clone.__name__ == "fragile_reward"
    assert clone(prompts=["p"], completions=["abc"]) == [3.0]
    for task in (ArithmeticTask(), MathTask(dataset="unused")):
        pickle.dumps(task.reward_funcs)


def test_safe_reward_async() -> None:
    from trl.trainer.utils import is_async_callable

    async def areward(prompts, completions, **kwargs):
        if any(c == "bad" for c in completions):
            raise ValueError("bad completion")
        return [1.0] * len(completions)

    wrapped = safe_reward(areward)
    assert is_async_callable(wrapped)
    assert not is_async_callable(safe_reward(fragile_reward))
    assert asyncio.run(wrapped(prompts=["p"], completions=["good"])) == [1.0]
    expected = r"reward function 'areward' at .*: raised ValueError: bad completion on completion 1 of the rollout's 2"
    with pytest.raises(RuntimeError, match=expected):
        asyncio.run(wrapped(prompts=["p", "p"], completions=["good", "bad"]))


# -- sum_sentence: arithmetic answered in a required sentence ----------------------------------------


def _sum_sentence_reward(texts: list[str], a: int, b: int, answer: int | None = None) -> list[float | None]:
    n = len(texts)
    return SumSentenceReward()(
        prompts=[None] * n, completions=texts, answer=[a + b if answer is None else answer] * n, a=[a] * n, b=[b] * n
    )


def test_sum_sentence_prompt_spells_out_the_sentence_and_shares_arithmetic_splits() -> None:
    task = get_task("sum_sentence")
    assert isinstance(task, SumSentenceTask) and isinstance(task, Task)
    arithmetic = ArithmeticTask()
    for split, seed in (("train", 0), ("train", 5), ("test", 0), ("test", 9)):
        rows = task.build_dataset(split, 120, seed=seed)
        assert _pairs(rows) == _pairs(arithmetic.build_dataset(split, 120, seed=seed))
        for row in rows.select(range(5)):
            content = row["prompt"][0]["content"]
            assert content.startswith(f"Compute {row['a']} + {row['b']}.")
            assert SUM_SENTENCE_LEAD.format(a=row["a"], b=row["b"]) + " <number>." in content
            assert row["answer"] == row["a"] + row["b"]
    held = _pairs(task.build_dataset("test", 100, seed=0))
    assert held == _pairs(task.build_dataset("test", 100, seed=77))  # fixed, seed-independent
    assert len(set(held)) == 100
    assert _pairs(task.build_dataset("train", 50, seed=1)) == _pairs(task.build_dataset("train", 50, seed=1))
    assert _pairs(task.build_dataset("train", 50, seed=1)) != _pairs(task.build_dataset("train", 50, seed=2))
    assert len(task.build_dataset("test")) == 100
    with pytest.raises(ValueError, match="unknown split"):
        task.build_dataset("validation")


def test_sum_sentence_reward_needs_the_sentence_and_the_sum() -> None:
    lead = SUM_SENTENCE_LEAD.format(a=3, b=5)
    texts = [
        f"{lead} 8.",  # right
        f'"{lead} 8."',  # the quotes of a copied template do not matter
        f"\n  {lead} 8.\nAnswer: 8",  # leading blanks and a trailing answer line: last number still 8
        f"{lead} 9.",  # wrong sum
        "The sum is 8.",  # right sum, no sentence: half
        f"Sure! {lead} 8.",  # the sentence, but not first (rewarded completions must share the lead): half
        f"{lead} 8. Also 3 + 5 + 1 = 9",  # last number is not the sum
        "To compute 3 + 5, we add them: eight.",  # no number after the sentence's own
        "",
    ]
    assert _sum_sentence_reward(texts, 3, 5) == [1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    assert SumSentenceReward(unformatted=0.0)(
        prompts=[None], completions=["The sum is 8."], answer=[8], a=[3], b=[5]
    ) == [0.0]
    # The sentence must carry the problem's own numbers, in order, for the full reward.
    assert _sum_sentence_reward([f"{SUM_SENTENCE_LEAD.format(a=5, b=3)} 8."], 3, 5) == [0.5]
    conversational = [[{"role": "assistant", "content": f"{lead} 8."}]]
    assert SumSentenceReward()(prompts=[None], completions=conversational, answer=[8], a=[3], b=[5]) == [1.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        SumSentenceReward()(prompts=[None, None], completions=["x", "y"], answer=[8], a=[3], b=[5])


def test_sum_sentence_task_reward_reads_the_dataset_columns() -> None:
    """The task's reward reads the dataset's own columns, as TRL and greedy_accuracy pass them."""
    task = SumSentenceTask()
    rows = task.build_dataset("test", 4)
    completions = [f"{SUM_SENTENCE_LEAD.format(a=r['a'], b=r['b'])} {r['answer']}." for r in rows]
    completions[0] = completions[0].replace(f" {rows[0]['answer']}.", f" {rows[0]['answer'] + 1}.")
    completions[1] = f"It is {rows[1]['answer']}."
    values = task.reward_funcs[0](
        prompts=rows["prompt"], completions=completions, answer=rows["answer"], a=rows["a"], b=rows["b"]
    )
    assert values == [0.0, 0.5, 1.0, 1.0]
    assert task.reward_funcs[0].__name__ == "sum_sentence_correct"


# -- registry -------------------------------------------------------------------------------------


def test_unknown_task_lists_known() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'nope'; known tasks: \['arithmetic', 'math'") as info:
        get_task("nope")
    assert "arithmetic" in str(info.value)


def test_register_task_and_protocol() -> None:
    assert isinstance(get_task("arithmetic"), Task)
    register_task("arith_copy", ArithmeticTask)
    try:
        assert isinstance(get_task("arith_copy"), ArithmeticTask)
    finally:
        TASKS.pop("arith_copy")


def test_registries_accept_import_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks and rewards are found the same way: a registered name, or an import path 'module:name' (a task factory
    is called with the options, a task object is taken as it is; a reward function is wrapped by safe_reward)."""
    (tmp_path / "my_plugin.py").write_text(
        "from dfpo_trl.cli.tasks import ArithmeticTask\n"
        "def make_task(**options):\n"
        "    return ArithmeticTask(name='plugin', **options)\n"
        "READY = ArithmeticTask(name='ready')\n"
        "class MyTask(ArithmeticTask):\n"
        "    pass\n"
        "def half(prompts, completions, **kwargs):\n"
        "    return [0.5] * len(completions)\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = get_task("my_plugin:make_task", default_train_size=7)
    assert task.name == "plugin" and len(task.build_dataset("train")) == 7
    assert get_task("my_plugin:READY").name == "ready"
    built = get_task("my_plugin:MyTask", default_train_size=5)  # a task class is a factory: called, not returned
    assert not isinstance(built, type) and len(built.build_dataset("train")) == 5
    reward = get_reward("my_plugin:half")
    assert isinstance(reward, SafeReward) and reward.__name__ == "half"
    assert reward(prompts=["p", "p"], completions=["a", "b"]) == [0.5, 0.5]
    with pytest.raises(ValueError, match=r"reward function 'my_plugin:NOT_CALLABLE' is not callable"):
        get_reward("my_plugin:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"module 'my_plugin' has no 'nope' \(from 'my_plugin:nope'\)"):
        get_task("my_plugin:nope")
    with pytest.raises(ValueError, match=r"cannot import 'no_such_plugin' for 'no_such_plugin:f'"):
        get_reward("no_such_plugin:f")


def test_register_reward_and_the_named_rewards() -> None:
    """Our rewards and TRL's named ones (trl.rewards, imported on first use) sit in one registry; a registered
    reward is logged under its registered name; an unknown name lists the known ones and the closest."""
    from trl.rewards import accuracy_reward, think_format_reward

    assert {"arithmetic_correct", "math_verify_correct", "accuracy_reward", "reasoning_accuracy_reward",
            "think_format_reward"} <= set(REWARDS)  # fmt: skip
    assert get_reward("accuracy_reward").func is accuracy_reward
    assert get_reward("think_format_reward").func is think_format_reward
    arithmetic = get_reward("arithmetic_correct")
    assert isinstance(arithmetic.func, ArithmeticReward) and arithmetic.__name__ == "arithmetic_correct"
    register_reward("always_one", lambda: lambda prompts, completions, **kw: [1.0] * len(completions))
    try:
        reward = get_reward("always_one")
        assert reward.__name__ == "always_one" and reward(prompts=["p"], completions=["c"]) == [1.0]
    finally:
        REWARDS.pop("always_one")
    with pytest.raises(ValueError, match=r"unknown reward function 'acuracy_reward'; known: \[.*\], or an import "
                       r"path 'module:function'\. Did you mean 'accuracy_reward'\?"):
        get_reward("acuracy_reward")
    with pytest.raises(ValueError, match=r"Did you mean 'arithmetic'\?"):
        get_task("arithmetik")


# -- math task ------------------------------------------------------------------------------------


def _math_data() -> DatasetDict:
    train = Dataset.from_dict(
        {"question": ["What is 2 + 2?", "What is 1/2 + 1/2?", "x?"], "final": ["4", "1", "x^2+1"]}
    )
    test = Dataset.from_dict({"question": ["What is 3 + 3?"], "final": ["6"]})
    return DatasetDict({"train": train, "test": test})


def test_math_missing_column_error() -> None:
    task = get_task("math", dataset=_math_data())
    with pytest.raises(ValueError) as info:
        task.build_dataset("train", None, 0)
    msg = str(info.value)
    assert "'problem'" in msg and "['question', 'final']" in msg and "problem_column" in msg
    assert "(CLI: --problem_column)" in msg and getattr(info.value, "field", None) == "problem_column"
    task = get_task("math", dataset=_math_data(), problem_column="question")
    with pytest.raises(ValueError, match=r"column 'answer' not found.*answer_column"):
        task.build_dataset("train", None, 0)


def test_math_needs_a_dataset() -> None:
    with pytest.raises(ValueError, match=r"no dataset given; set dataset \(CLI: --dataset\)"):
        get_task("math")


def test_math_missing_split_error() -> None:
    task = get_task("math", dataset=_math_data(), test_split="validation")
    with pytest.raises(ValueError, match=r"split 'validation'.*\['train', 'test'\].*test_split"):
        task.build_dataset("test", None, 0)
    bare = get_task("math", dataset=_math_data()["train"], problem_column="question", answer_column="final")
    assert len(bare.build_dataset("train", None, 0)) == 3
    with pytest.raises(ValueError, match="DatasetDict"):
        bare.build_dataset("test", None, 0)


def test_math_dataset_columns_and_reward() -> None:
    task = get_task("math", dataset=_math_data(), problem_column="question", answer_column="final")
    ds = task.build_dataset("train", 2, seed=0)
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 2
    assert ds[0]["prompt"][0]["role"] == "user" and "\\boxed{}" in ds[0]["prompt"][0]["content"]
    held = task.build_dataset("test", 5, seed=9)
    assert held["answer"] == ["6"] and held["prompt"][0][0]["content"].startswith("What is 3 + 3?")

    reward = task.reward_funcs[0]
    completions = [
        [{"role": "assistant", "content": "So the result is \\boxed{4}"}],
        "The answer is \\boxed{5}",
        "no answer",
        "$\\frac{2}{2}$ hence \\boxed{1}",
        "\\boxed{x^2 + 1}",
        "\\boxed{4}",
    ]
    answers = ["4", "4", "4", "1", "x^2+1", "#### 4"]
    out = reward(prompts=["p"] * len(completions), completions=completions, answer=answers)
    assert out == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_math_answer_column_named_answer_kept() -> None:
    data = Dataset.from_dict({"problem": ["1+1?"], "answer": [2], "extra": ["dropped"]})
    ds = get_task("math", dataset=data).build_dataset("train", None, 0)
    assert ds.column_names == ["prompt", "answer"] and ds["answer"] == ["2"]


# -- greedy accuracy with a stub model -------------------------------------------------------------


class _StubTokenizer:
    """Character-level stand-in: enough of the tokenizer API that greedy_accuracy uses."""

    pad_token_id = 0
    eos_token_id = 0
    padding_side = "right"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        assert not tokenize and add_generation_prompt and kwargs in ({}, {"enable_thinking": False})
        return messages[-1]["content"]

    def __call__(self, texts, return_tensors, padding, add_special_tokens):
        import torch

        assert self.padding_side == "left"
        width = max(len(t) for t in texts)
        ids = torch.tensor([[0] * (width - len(t)) + [ord(c) for c in t] for t in texts])
        return _Batch(input_ids=ids, attention_mask=(ids != 0).long())

    def batch_decode(self, ids, skip_special_tokens):
        return ["".join(chr(int(i)) for i in row if int(i)) for row in ids]


class _Batch(dict):
    def to(self, device):
        return self


class _StubModel:
    """Pretends to generate: the right sum for even a, a wrong one for odd a; counts prompts it sees."""

    device = "cpu"
    training = True

    def __init__(self) -> None:
        self.seen = 0

    def eval(self):
        self.training = False
        return self

    def train(self, mode=True):
        self.training = mode
        return self

    def generate(self, input_ids, attention_mask, do_sample, max_new_tokens, pad_token_id, **kwargs):
        import torch

        assert do_sample is False
        rows = []
        for row in input_ids:
            text = "".join(chr(int(i)) for i in row if int(i))
            a, b = map(int, PROMPT_RE.match(text).groups())
            answer = f"Answer: {a + b if a % 2 == 0 else a + b + 1}"
            rows.append(row.tolist() + [ord(c) for c in answer.ljust(12, "\0")])
        self.seen += len(rows)
        return torch.tensor(rows)


def test_greedy_accuracy_batches_dedups_and_restores_state() -> None:
    task = ArithmeticTask()
    problems = task.build_dataset("test", 150, seed=0)
    tok, model = _StubTokenizer(), _StubModel()
    acc = greedy_accuracy(model, tok, problems, task, batch_size=16)
    expected = sum(1 for a in problems["a"] if a % 2 == 0) / len(problems)
    assert acc == pytest.approx(expected)
    assert model.seen == 100  # 150 problems, 100 distinct prompts
    assert model.training is True and tok.padding_side == "right"
    assert greedy_accuracy(model, tok, [], task) == 0.0
    kwargs = {"enable_thinking": False}
    assert greedy_accuracy(model, tok, problems, task, chat_template_kwargs=kwargs) == pytest.approx(expected)
