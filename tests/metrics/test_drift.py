"""The equivalent-solution drift meter (dfpo_trl.metrics.drift, DriftMeterCallback, FormShareReward) and the tasks
whose answers come in equivalent forms: D1–D4 against hand-computed numbers, the scored log-probabilities against a
bigram model's exact ones, odds moved by hand and followed by the callback, sampled form shares pooled exactly, and
the CLI's ``drift_every`` end to end on a tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny import WORDS, save_tiny_chat_model, tiny_tokenizer, write_tiny_recipe

from dfpo_trl.cli.callbacks import FormShareReward
from dfpo_trl.cli.tasks import EquivalentFormsTask, get_task
from dfpo_trl.metrics.drift import (
    completion_log_probs,
    end_token_ids,
    end_token_mismatch,
    equivalent_set_stats,
    summarise_equivalent_sets,
)
from dfpo_trl.metrics.drift_meter import DriftMeterCallback
from dfpo_trl.metrics.store import MetricStore

pytestmark = pytest.mark.usefixtures("one_thread")
EPS64 = torch.finfo(torch.float64).eps


# ------------------------------------------------------------------------------------------------ D1–D4
def test_equivalent_set_stats_against_hand_values() -> None:
    logps = torch.tensor([[math.log(0.3), math.log(0.1)], [math.log(0.02), math.log(0.02)]], dtype=torch.float64)
    stats = equivalent_set_stats(logps)
    q = 0.75  # 0.3 / (0.3 + 0.1)
    torch.testing.assert_close(stats["log_odds"], torch.tensor([math.log(3.0), 0.0], dtype=torch.float64))
    torch.testing.assert_close(stats["spread"], torch.tensor([math.log(3.0), 0.0], dtype=torch.float64))
    binary = -(q * math.log(q) + (1 - q) * math.log(1 - q))
    torch.testing.assert_close(stats["entropy"], torch.tensor([binary, math.log(2.0)], dtype=torch.float64))
    torch.testing.assert_close(stats["set_logp"], torch.tensor([math.log(0.4), math.log(0.04)], dtype=torch.float64))
    summary = summarise_equivalent_sets(logps)
    assert summary["log_odds_abs_mean"] == pytest.approx(math.log(3.0) / 2, rel=1e-12)
    assert summary["log_odds_abs_std"] == pytest.approx(math.log(3.0) / 2, rel=1e-12)
    assert summary["set_entropy_normalised"] == pytest.approx((binary + math.log(2)) / 2 / math.log(2), rel=1e-12)


def test_three_forms_and_far_below_float_resolution() -> None:
    # three equally likely forms: entropy log 3; odds exact even at log-probabilities of -700 (exp underflows)
    logps = torch.tensor([[-700.0, -700.0, -700.0], [-702.0, -700.0, -701.0]], dtype=torch.float64)
    stats = equivalent_set_stats(logps)
    assert stats["entropy"][0].item() == pytest.approx(math.log(3.0), rel=1e-12)
    assert stats["spread"].tolist() == [0.0, 2.0] and stats["log_odds"].tolist() == [0.0, -2.0]
    weights = torch.tensor([math.exp(-2), 1.0, math.exp(-1)], dtype=torch.float64)
    q = weights / weights.sum()
    assert stats["entropy"][1].item() == pytest.approx(-(q * q.log()).sum().item(), rel=1e-12)
    assert torch.isfinite(stats["set_logp"]).all()


def test_stats_refuse_what_has_no_odds() -> None:
    with pytest.raises(ValueError, match="at least 2 forms"):
        equivalent_set_stats(torch.zeros(3, 1))
    with pytest.raises(ValueError, match="finite"):
        equivalent_set_stats(torch.tensor([[0.0, -math.inf]]))


# ------------------------------------------------------------------------------------------------ scoring
class Bigram(torch.nn.Module):
    """A causal LM whose logits at position t are a table row of the token at t: exact log-probabilities by hand."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any):
        return SimpleNamespace(logits=self.table[input_ids])


def tokenizer_with_template():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def exact_log_prob(table: torch.Tensor, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> float:
    total, previous = 0.0, prompt_ids[-1]
    for token in completion_ids:
        total += torch.log_softmax(table[previous].double() / temperature, -1)[token].item()
        previous = token
    return total


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_log_probs_equal_a_bigram_models_exact_values(temperature: float) -> None:
    tokenizer = tokenizer_with_template()
    table = torch.randn(len(WORDS), len(WORDS), generator=torch.Generator().manual_seed(0))
    model = Bigram(table)
    prompts = [[{"role": "user", "content": "Compute 3 + 4"}], "Compute 1 + 1 =", [{"role": "user", "content": "so"}]]
    completions = ["the 7", "2", "Answer: 1 + 1 is 2"]
    got = completion_log_probs(model, tokenizer, prompts, completions, temperature=temperature, batch_size=2)
    eos = tokenizer.eos_token_id
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True
        )
        p_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
        want = exact_log_prob(table, p_ids, c_ids, temperature)
        # float32 logits: a log-softmax over |V| terms per token, a few tokens: a few float32 ulps of the sum's size
        assert got[i].item() == pytest.approx(want, abs=64 * torch.finfo(torch.float32).eps * (1 + abs(want)))
    assert got.dtype == torch.float64 and model.training  # the model's mode is restored


def test_a_completion_ends_with_any_of_the_end_tokens_trl_stops_at() -> None:
    """With two end tokens (the tokenizer's and another the generation config lists, as TRL stops at both), the scored
    end is log(π(e1) + π(e2)) after the completion: a sampled completion is the form whichever end comes."""
    tokenizer = tokenizer_with_template()
    table = torch.randn(len(WORDS), len(WORDS), generator=torch.Generator().manual_seed(3))
    model = Bigram(table)
    model.generation_config = SimpleNamespace(eos_token_id=[WORDS.index("so"), tokenizer.eos_token_id])
    ends = end_token_ids(tokenizer, model)
    assert ends == [tokenizer.eos_token_id, WORDS.index("so")]  # TRL's order: the tokenizer's first, no repeats
    prompt, completion = "Compute 1 + 1 =", "the 2"
    got = completion_log_probs(model, tokenizer, [prompt], [completion], end_ids=ends)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    body = exact_log_prob(table, p_ids, c_ids, 1.0)
    last = torch.log_softmax(table[c_ids[-1]].double(), -1)
    want = body + math.log(last[ends[0]].exp().item() + last[ends[1]].exp().item())
    assert got.item() == pytest.approx(want, abs=64 * torch.finfo(torch.float32).eps * (1 + abs(want)))
    only_tokenizer = completion_log_probs(model, tokenizer, [prompt], [completion])  # default: the tokenizer's end
    assert only_tokenizer.item() == pytest.approx(body + last[ends[0]].item(), abs=1e-5 * (1 + abs(want)))
    with pytest.raises(ValueError, match="end_ids is empty"):
        completion_log_probs(model, tokenizer, [prompt], [completion], end_ids=[])


def test_end_token_mismatch_names_both_tokens() -> None:
    tokenizer = tokenizer_with_template()
    agree = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=tokenizer.eos_token_id))
    assert end_token_mismatch(tokenizer, agree) is None
    assert end_token_mismatch(tokenizer, SimpleNamespace()) is None  # nothing declared: nothing to contradict
    wrong = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[WORDS.index("is")]))
    message = end_token_mismatch(tokenizer, wrong)
    assert message is not None and "'<eos>'" in message and "['is']" in message and "align_end_token" in message



def test_end_token_mismatch_sees_the_template_after_trl_aligned_the_model():
    """transformers' Trainer adds the tokenizer's end token to the generation config, so after alignment the
    config lists both; the chat template still says which token ends a turn."""
    tokenizer = tokenizer_with_template()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    )
    tokenizer.eos_token = "<|im_start|>"  # the GGUF reader's fault
    ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    aligned = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=ids))
    message = end_token_mismatch(tokenizer, aligned)
    assert message is not None and "'<|im_start|>'" in message and "ends a turn with '<|im_end|>'" in message
    tokenizer.eos_token = "<|im_end|>"
    assert end_token_mismatch(tokenizer, aligned) is None


class HandTask:
    """Two forms of the sum that differ in their first token only: 'the <s>' and 'so <s>'."""

    name = "hand"
    form_names = ("the", "so")
    reward_funcs: list[Any] = []

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
        return [{"prompt": [{"role": "user", "content": f"Compute {a} + {a}"}], "answer": 2 * a} for a in range(4)]

    def equivalent_forms(self, row: dict[str, Any]) -> list[str]:
        return [f"the {row['answer'] % 10}", f"so {row['answer'] % 10}"]

    def form_of(self, completion: Any, row: dict[str, Any]) -> int | None:
        forms = self.equivalent_forms(row)
        return forms.index(completion) if completion in forms else None


def test_drift_meter_follows_odds_moved_by_hand() -> None:
    """A uniform bigram model gives both forms the same probability (D1 = 0, entropy log 2); raising the logit of
    'the' by δ in every row moves every prompt's log-odds by exactly δ (the rows after 'the' and 'so' gain the same
    normaliser), which the callback logs at its step through the metric store."""
    task = HandTask()
    assert isinstance(task, EquivalentFormsTask)
    tokenizer = tokenizer_with_template()
    model = Bigram(torch.zeros(len(WORDS), len(WORDS)))
    store = MetricStore()
    meter = DriftMeterCallback(task, task.build_dataset("test"), every=2, metrics=store)
    state = SimpleNamespace(global_step=0, max_steps=10)
    meter.on_train_begin(None, state, None, model=model, processing_class=tokenizer)
    first = meter.results["curve"][0]
    assert first["step"] == 0 and first["log_odds_abs_mean"] == 0.0
    assert first["set_entropy"] == pytest.approx(math.log(2.0), rel=1e-12)
    assert store.flush("train", "cpu") == {}  # step 0 is kept in the curve, not logged at step 1
    delta = 1.5
    with torch.no_grad():
        model.table[:, WORDS.index("the")] += delta
    state.global_step = 1
    meter.on_step_end(None, state, None, model=model, processing_class=tokenizer)
    assert len(meter.results["curve"]) == 1  # not a multiple of every
    state.global_step = 2
    meter.on_step_end(None, state, None, model=model, processing_class=tokenizer)
    logged = store.flush("train", "cpu")
    tolerance = 64 * torch.finfo(torch.float32).eps * 10  # float32 logits of size ~δ, summed over 3 tokens
    assert logged["drift/log_odds_mean"] == pytest.approx(delta, abs=tolerance)
    assert logged["drift/log_odds_abs_mean"] == pytest.approx(delta, abs=tolerance)
    assert logged["drift/log_odds_abs_std"] == pytest.approx(0.0, abs=tolerance)
    q = 1 / (1 + math.exp(-delta))
    assert logged["drift/set_entropy"] == pytest.approx(-(q * math.log(q) + (1 - q) * math.log(1 - q)), abs=tolerance)
    assert [point["step"] for point in meter.results["curve"]] == [0, 2]


def test_drift_meter_warns_when_the_tokenizer_ends_completions_elsewhere(caplog: pytest.LogCaptureFixture) -> None:
    """The GGUF fault: the tokenizer's end token is not the model's. The meter warns once, records it, and scores
    both end tokens (its number stays the sampling probability)."""
    task = HandTask()
    tokenizer = tokenizer_with_template()
    model = Bigram(torch.zeros(len(WORDS), len(WORDS)))
    model.generation_config = SimpleNamespace(eos_token_id=WORDS.index("is"))
    meter = DriftMeterCallback(task, task.build_dataset("test"), every=2)
    with caplog.at_level("WARNING", logger="dfpo_trl.cli.callbacks"):
        meter.on_train_begin(None, SimpleNamespace(global_step=0, max_steps=2), None, model=model,
                             processing_class=tokenizer)
    assert "drift meter" in caplog.text and "'<eos>'" in caplog.text
    assert "generation config" in meter.results["end_token_warning"]
    # uniform model: each form is two tokens then one of two end tokens, each 1/|V|
    vocab = len(WORDS)
    assert meter.results["curve"][0]["set_logp_mean"] == pytest.approx(math.log(2 * 2 / vocab**3), rel=1e-5)


def test_drift_meter_refuses_what_it_cannot_measure() -> None:
    task = HandTask()
    with pytest.raises(ValueError, match="every must be >= 1"):
        DriftMeterCallback(task, task.build_dataset("test"), every=0)
    with pytest.raises(ValueError, match="at least one held-out problem"):
        DriftMeterCallback(task, [], every=5)


# ------------------------------------------------------------------------------------------------ tasks
@pytest.mark.parametrize("name", ["two_forms", "sum_sentence"])
def test_every_equivalent_form_gets_full_credit_and_is_recognised(name: str) -> None:
    task = get_task(name)
    assert isinstance(task, EquivalentFormsTask) and len(task.form_names) >= 2
    rows = [dict(r) for r in task.build_dataset("test", 100)]
    reward = task.reward_funcs[0]
    for row in rows:
        forms = task.equivalent_forms(row)
        assert len(set(forms)) == len(task.form_names)
        columns = {k: [row[k]] * len(forms) for k in row if k != "prompt"}
        assert reward(prompts=[row["prompt"]] * len(forms), completions=forms, **columns) == [1.0] * len(forms)
        assert [task.form_of(f, row) for f in forms] == list(range(len(forms)))
        conversational = [[{"role": "assistant", "content": f"  {f}\n"}] for f in forms]
        assert [task.form_of(c, row) for c in conversational] == list(range(len(forms)))


def test_two_forms_reward_grades_format_and_sum() -> None:
    task = get_task("two_forms")
    row = {"a": 3, "b": 5, "answer": 8}
    completions = ["The sum is 8.", " The answer is 8. ", "The sum is 8", "8", "The answer is 9.", "nothing"]
    rewards = task.reward_funcs[0](prompts=[None] * 6, completions=completions, answer=[8] * 6)
    assert rewards == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert [task.form_of(c, row) for c in completions] == [0, 1, None, None, None, None]
    assert "first_number" not in task.prompt_template and "The sum is <number>." in task.prompt_template


def test_form_share_reward_logs_exact_pooled_shares() -> None:
    """One 0/1 value per fully correct completion and form: TRL's pooling (sum / count, over processes too) is then
    the exact share. Rewards pass through unchanged, the name stays the wrapped reward's."""
    task = get_task("sum_sentence")
    row = {"a": 3, "b": 5, "answer": 8}
    period, bare = task.equivalent_forms(row)
    completions = [period, period, bare, period + " Done", "8", "To compute 3 + 5, we get 9."]
    logged: dict[str, list[float]] = {}
    wrapped = FormShareReward(task.reward_funcs[0], task)
    columns = {"answer": [8] * 6, "a": [3] * 6, "b": [5] * 6}
    rewards = wrapped(prompts=[None] * 6, completions=completions,
                      log_metric=lambda name, value: logged.setdefault(name, []).append(value), **columns)
    assert rewards == task.reward_funcs[0](prompts=[None] * 6, completions=completions, **columns)
    assert rewards == [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    shares = {name: sum(v) / len(v) for name, v in logged.items()}
    assert shares == {"drift/form_share/period": 0.5, "drift/form_share/no_period": 0.25,
                      "drift/form_share/other": 0.25}
    assert wrapped.__name__ == task.reward_funcs[0].__name__
    assert wrapped(prompts=[None], completions=[period], **{k: v[:1] for k, v in columns.items()}) == [1.0]


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny_drift_model"))


RUN = dict(plot=False, seed=None, max_steps=4, learning_rate=None, temperature=None)  # changes to the tiny recipe


def test_cli_drift_meter_and_periodic_heldout_end_to_end(tmp_path: Path, tiny_model_dir: Path) -> None:
    from dfpo_trl.cli.main import main

    out = tmp_path / "out"
    argv = write_tiny_recipe(tmp_path, tiny_model_dir, out, **RUN, task="two_forms", drift_every=2, drift_size=3,
                             eval_every=2)
    assert main(argv) == 0
    summary = json.loads((out / "dfpo_summary.json").read_text())
    assert [p["step"] for p in summary["drift"]["curve"]] == [0, 2, 4]
    assert summary["drift"]["forms"] == ["sum", "answer"] and summary["drift"]["n"] == 3
    assert [step for step, _ in summary["heldout"]["curve"]] == [0, 2, 4]
    logged = {row["step"]: row for row in summary["log_history"] if "drift/log_odds_abs_mean" in row}
    assert sorted(logged) == [2, 4]
    for point in summary["drift"]["curve"][1:]:
        assert logged[point["step"]]["drift/set_entropy"] == pytest.approx(point["set_entropy"], rel=1e-6)
    assert [row["step"] for row in summary["log_history"] if "heldout/accuracy" in row] == [2]


def test_cli_refuses_drift_on_a_task_without_equivalent_forms(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dfpo_trl.cli.main import main

    assert main(write_tiny_recipe(tmp_path, tiny_model_dir, tmp_path / "o", **RUN, task="arithmetic",
                                  drift_every=2)) == 2
    err = capsys.readouterr().err
    assert "drift_every=2" in err and "two_forms" in err and "'arithmetic'" in err
    assert main(write_tiny_recipe(tmp_path, tiny_model_dir, tmp_path / "o", **RUN, task="two_forms",
                                  eval_every=-1)) == 2
    assert "eval_every must be >= 0" in capsys.readouterr().err
