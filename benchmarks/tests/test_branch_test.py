"""dfpo_bench.studies.branch_test on the CPU with a tiny model: both branches start bit-identical and differ only by
the transform; the GSPO arm reproduces the trajectory's own next step; transform none on both arms gives an effect of
exactly 0; a group whose s̄ are all equal has no term to remove and Min-Replace's step equals GSPO's; the meter (the
probe before and after each arm's step, the paired effect) agrees with the same step applied by hand and read on a
model no trainer touched, and each arm's probe reads that arm's own weights."""

from __future__ import annotations

import copy
import dataclasses
import pathlib
from typing import Any

import pytest
import torch
from datasets import Dataset
from dfpo_trl.testing import random_batch, tiny_model, tiny_tokenizer, with_old_logps  # noqa: E402
from dfpo_trl.testing.measures import completion_log_probs  # noqa: E402

from dfpo_bench.studies import branch_test as bt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SETTING = bt.Setting(name="tiny", staleness=2, learning_rate=1e-2, epsilon=0.2, epsilon_high=0.28, steps=3,
                     num_generations=4, groups_per_micro_batch=2, max_completion_length=4, temperature=1.5,
                     probe_prompts=4)


def digit_share(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [sum(w.isdigit() for w in c.split()) / 4 for c in completions]


@dataclasses.dataclass
class TinyFormsTask:
    """Single-digit sums in the tiny tokenizer's words; two equivalent forms ("Answer: s", "so s"); the reward is the
    share of digit words in the completion (a random tiny model's groups then almost always have signal)."""

    reward_funcs: list[Any] = dataclasses.field(default_factory=lambda: [digit_share])

    def build_dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        g = torch.Generator().manual_seed(seed + (0 if split == "train" else 1000))  # "test": the probe
        a = torch.randint(0, 5, (n or 16,), generator=g).tolist()
        b = torch.randint(0, 5, (n or 16,), generator=g).tolist()
        return Dataset.from_dict({"prompt": [f"Compute {x} + {y} =" for x, y in zip(a, b, strict=True)],
                                  "answer": [str(x + y) for x, y in zip(a, b, strict=True)]})

    def equivalent_forms(self, row: dict[str, Any]) -> list[str]:
        return [f"Answer: {row['answer']}", f"so {row['answer']}"]


def trajectory(tmp_path: pathlib.Path, arms: tuple[str, str],
               max_points: int | None = None) -> tuple[list[dict[str, Any]], dict[int, Any], Any]:
    """A 3-step GSPO trajectory (S = 2) of the tiny model, branched at every stale point into ``arms``; the records,
    the trajectory's weights after each step, and the arm trainers."""
    task, tokenizer = TinyFormsTask(), tiny_tokenizer()
    model = tiny_model(0)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    probe = bt.Probe.from_task(task, SETTING.probe_prompts, SETTING.temperature)
    trainer = bt.DFPOTrainer(model=model, reward_funcs=task.reward_funcs,
                             args=SETTING.config("none", str(tmp_path), 0, use_cpu=True),
                             train_dataset=task.build_dataset("train", 64, 0), processing_class=tokenizer)
    arm_trainers = bt.branch_trainers(model, tokenizer, task, SETTING, 0, str(tmp_path), arms, use_cpu=True)
    records: list[dict[str, Any]] = []
    after: dict[int, Any] = {}

    def on_point(point: bt.BranchPoint) -> None:
        terms = bt.term_size(trainer, point.batch)
        record = bt.branch(arm_trainers, point, probe, tokenizer, terms, probe.measure(trainer.model, tokenizer))
        record["weights"] = [{k: v.clone() for k, v in t.model.state_dict().items()} for t in arm_trainers]
        record["point"] = point
        records.append(record)

    class Weights(bt.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            after[state.global_step] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    trainer.add_callback(Weights())
    trainer.add_callback(bt.BranchPoints(trainer, SETTING, 0, probe, tokenizer, on_point, max_points))
    trainer.train()
    return records, after, arm_trainers


@pytest.mark.slow
def test_branches_start_identical_differ_by_the_transform_and_gspo_repeats_the_trajectory(
        tmp_path: pathlib.Path) -> None:
    records, after, _ = trajectory(tmp_path, bt.ARMS)
    assert [(r["step"], r["staleness"]) for r in records] == [(1, 1), (2, 2)]  # S = 2: j = 1, 2; step 3 regenerates
    for record in records:
        assert record["identical_start"]
        assert [a["transform"] for a in record["arms"]] == ["none", "min_replace"]
        # the GSPO arm's step is the trajectory's own next step (same micro-batch, state and optimizer): same weights
        nxt = after[record["step"] + 1]
        for name, value in record["weights"][0].items():
            torch.testing.assert_close(value, nxt[name], rtol=0, atol=1e-6 * max(1.0, float(value.abs().max())))
        terms = record["terms"]
        assert 0 <= terms["imbalance"] <= 1 and 0 <= terms["removed_share"] <= 2
    stale = records[-1]
    assert stale["terms"]["s_bar_spread"] > 0 and stale["terms"]["removed_share"] > 0  # two steps stale: a term
    differ = [any(not torch.equal(v, r["weights"][1][k]) for k, v in r["weights"][0].items()) for r in records]
    assert differ[-1]  # Min-Replace changed the update where there was a term
    e = bt.effects(stale)
    assert all(map(lambda v: v == v, e.values()))  # finite numbers, no NaN


@pytest.mark.slow
def test_transform_none_on_both_arms_has_an_effect_of_exactly_zero(tmp_path: pathlib.Path) -> None:
    records, after, _ = trajectory(tmp_path, ("none", "none"), max_points=1)
    assert len(records) == 1 and sorted(after) == [1]  # max_points = 1: the trajectory stops after its point
    for record in records:
        assert record["identical_start"]
        a, b = record["arms"]
        assert a["after"] == b["after"] and a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
        assert all(torch.equal(v, record["weights"][1][k]) for k, v in record["weights"][0].items())
        assert all(value == 0.0 for key, value in bt.effects(record).items() if key != "gspo_move")


def test_equal_weights_in_a_group_leave_no_term_and_min_replace_steps_as_gspo(tmp_path: pathlib.Path) -> None:
    """Every s̄_i of a group equal (the same log-ratio shift on every row of a group): I = R = 0 and the two arms'
    steps from one state are the same (φ = 1 everywhere)."""
    tokenizer = tiny_tokenizer()
    task = TinyFormsTask()
    setting = dataclasses.replace(SETTING, learning_rate=1e-2)
    arms = bt.branch_trainers(tiny_model(3), tokenizer, task, setting, 0, str(tmp_path), bt.ARMS, use_cpu=True)
    ids, mask, adv, _ = random_batch(rows=8, length=6, seed=2, group_size=4)
    shift = torch.tensor([0.05] * 4 + [-0.03] * 4).unsqueeze(1).expand(8, 6).clone()
    batch = with_old_logps(arms[0], ids, mask, adv, shift, group_ids=torch.tensor([0] * 4 + [1] * 4))
    terms = bt.term_size(arms[0], batch)
    # s̄ are equal up to float32 rounding of the log-probs (ε ≈ 1.2e-7 on values near 1)
    assert terms["imbalance"] < 1e-6 and terms["removed_share"] < 1e-6 and terms["s_bar_spread"] < 1e-6
    assert terms["signal_groups"] == 2
    point = bt.BranchPoint(0, 1, 1, {k: v.clone() for k, v in arms[0].model.state_dict().items()},
                           arms[0].optimizer.state_dict(), batch, None)
    steps = []
    for trainer in arms:
        bt.load_state(trainer, point)
        steps.append(bt.one_step(trainer, batch, rng_seed=0))
    assert max_weight_gap(arms) < 1e-6  # the same update, up to float32 rounding
    assert steps[0]["loss"] == pytest.approx(steps[1]["loss"], rel=1e-5)

    # and a group with unequal s̄ is a term: the same check then fails, so the check can fail. Every member shares
    # its first two tokens and has the same length, nothing is clipped: the trainer's shared-prefix meter reads a
    # residual under GSPO and ~0 under Min-Replace (Corollary 3.3)
    ids[:4, :2], ids[4:, :2] = ids[0, :2], ids[4, :2]
    full = torch.ones_like(mask)
    uneven = with_old_logps(arms[0], ids, full, adv, torch.linspace(-0.1, 0.1, 8).unsqueeze(1).expand(8, 6).clone(),
                            group_ids=torch.tensor([0] * 4 + [1] * 4))
    terms = bt.term_size(arms[0], uneven)
    assert terms["removed_share"] > 1e-3 and terms["imbalance"] > 1e-3 and terms["clipped_share"] == 0
    steps = []
    for trainer in arms:
        bt.load_state(trainer, point)
        steps.append(bt.one_step(trainer, uneven, rng_seed=0))
    assert max_weight_gap(arms) > 1e-4
    assert steps[0]["residual"] > 0.01 and steps[1]["residual"] < 1e-5


def max_weight_gap(arms: list[Any]) -> float:
    """The largest |Δ| between the two arms' weights, relative to the step the first arm took (lr = 1e-2)."""
    a, b = arms[0].model.state_dict(), arms[1].model.state_dict()
    return max(float((a[k] - b[k]).abs().max()) for k in a) / SETTING.learning_rate


def plain_log_odds(state: dict[str, torch.Tensor], probe: bt.Probe) -> list[float]:
    """The probe's log-odds log π(form 0) − log π(form 1) on a fresh tiny model holding ``state``: a model no trainer
    has patched or wrapped, in float32, scored with the drift meter's function directly (not ``Probe.measure``)."""
    model = tiny_model(7)
    model.load_state_dict(state)
    tokenizer = tiny_tokenizer()
    prompts = [p for p, forms in zip(probe.prompts, probe.forms, strict=True) for _ in forms]
    logps = completion_log_probs(model, tokenizer, prompts, [f for forms in probe.forms for f in forms],
                                 temperature=probe.temperature).view(len(probe.prompts), -1)
    return (logps[:, 0] - logps[:, 1]).tolist()


def step_by_hand(point: bt.BranchPoint, transform: str,
                 folder: pathlib.Path) -> tuple[dict[str, torch.Tensor], float]:
    """One optimizer step of ``transform`` from ``point``, independent of the meter's copies: a fresh model loaded
    with θ_k, its own DFPOTrainer (the real ``compute_loss``), the AdamW state loaded from the point, backward,
    clipping at max_grad_norm and the step taken here. Returns the stepped weights and the pre-clip gradient norm."""
    task, tokenizer = TinyFormsTask(), tiny_tokenizer()
    model = tiny_model(7)
    model.load_state_dict(point.model_state)
    trainer = bt.DFPOTrainer(model=model, reward_funcs=task.reward_funcs,
                             args=SETTING.config(transform, str(folder), 0, use_cpu=True),
                             train_dataset=task.build_dataset("train", 8, 0), processing_class=tokenizer)
    trainer.create_optimizer()
    trainer.optimizer.load_state_dict(copy.deepcopy(point.optimizer_state))
    trainer.current_gradient_accumulation_steps = 1
    model.train()
    torch.manual_seed(point.seed * 100_003 + point.step)  # the seed the meter's step uses
    trainer.compute_loss(model, dict(point.batch)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, float(norm)


@pytest.mark.slow
def test_the_meter_agrees_with_the_step_applied_by_hand_and_reads_a_nonzero_paired_effect(
        tmp_path: pathlib.Path) -> None:
    """The meter bug: the 2026-11-28 run read an effect of exactly 0 at every point although the arms' gradients
    differed. At the stale point (a term to remove, the arms' gradient norms differ), the meter's probe at the
    rollout, before and after each arm, and its paired effects, against the same quantities computed
    independently."""
    records, _, _ = trajectory(tmp_path, bt.ARMS)
    record = records[-1]  # j = 2: the first test shows it has a term (removed share > 0)
    point = record["point"]
    a_norm, b_norm = (arm["grad_norm"] for arm in record["arms"])
    assert abs(a_norm - b_norm) > 1e-3 * a_norm  # the two arms' gradients differ
    probe = bt.Probe.from_task(TinyFormsTask(), SETTING.probe_prompts, SETTING.temperature)
    generation = plain_log_odds(tiny_model(0).state_dict(), probe)  # θ_rollout of point (2, 2): the initial weights
    before = plain_log_odds(point.model_state, probe)
    stepped, norms = zip(*(step_by_hand(point, transform, tmp_path / transform) for transform in bt.ARMS),
                         strict=True)
    assert [arm["transform"] for arm in record["arms"]] == list(bt.ARMS)
    assert [arm["grad_norm"] for arm in record["arms"]] == pytest.approx(list(norms), rel=1e-5)
    for meter_weights, weights in zip(record["weights"], stepped, strict=True):
        for name, value in weights.items():
            torch.testing.assert_close(meter_weights[name], value, rtol=0,
                                       atol=1e-6 * max(1.0, float(value.abs().max())))
    after = [plain_log_odds(weights, probe) for weights in stepped]

    # the same log-odds, prompt by prompt, to a tolerance scaled by their size (float32 log-probs of a few tokens)
    def close(meter: list[float], truth: list[float]) -> None:
        scale = max(1.0, max(abs(v) for v in truth))
        assert max(abs(x - y) for x, y in zip(meter, truth, strict=True)) <= 1e-5 * scale

    close(record["generation"]["log_odds"], generation)
    close(record["before"]["log_odds"], before)
    for arm, truth in zip(record["arms"], after, strict=True):
        close(arm["after"]["log_odds"], truth)

    n = len(before)
    direction = [(o > g) - (o < g) for o, g in zip(before, generation, strict=True)]
    oriented = sum(d * (x - y) for d, x, y in zip(direction, after[0], after[1], strict=True)) / n
    move = sum(abs(x - o) for x, o in zip(after[0], before, strict=True)) / n
    paired = sum(abs(x - y) for x, y in zip(after[0], after[1], strict=True)) / n
    assert paired > 1e-2 * move > 0  # the arms' steps differ on the probe, by more than rounding could make them
    effects = bt.effects(record)
    assert effects["oriented"] == pytest.approx(oriented, abs=1e-4 * paired)
    assert effects["gspo_move"] == pytest.approx(move, abs=1e-4 * move)
    assert effects["oriented"] != 0.0


def terms_by_hand(point: bt.BranchPoint, eps_low: float, eps_high: float, temperature: float) -> dict[str, float]:
    """Imbalance and removed share (eq. 44–50) at θ_k on the point's micro-batch, from a fresh model's full logits
    in float32, as the registered setting trains (``bf16=False``): ρ_i the masked mean log-ratio to the
    rollout's log-probs, s̄ the sign-aware clip, s̃ the group minimum; groups of ``num_generations`` rows in order."""
    model = tiny_model(7)
    model.load_state_dict(point.model_state)
    batch = point.batch
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1:-1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1).double()
    mask = batch["completion_mask"].double()
    rho = ((logps - batch["old_per_token_logps"].double()) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    s, a = rho.exp(), batch["advantages"].double()
    c = s.clamp(1 - eps_low, 1 + eps_high)
    s_bar = torch.where(a >= 0, torch.minimum(s, c), torch.maximum(s, c)).view(-1, SETTING.num_generations)
    a = a.view(-1, SETTING.num_generations)
    s_tilde = s_bar.amin(-1, keepdim=True)
    mass = (a.abs() * s_bar).sum()
    return {"imbalance": float((a * s_bar).sum(-1).abs().sum() / mass),
            "removed_share": float((a * (s_bar - s_tilde)).abs().sum() / mass)}


@pytest.mark.slow
def test_the_recorded_term_sizes_agree_with_a_recomputation_by_hand(tmp_path: pathlib.Path) -> None:
    """The terms are read on the trajectory's own model, a path the probe bug did not touch: checked against
    eq. 44–50 computed here, in the same float32 (they agree to about 1e-7; at the rollout's θ both terms
    would read about 0, so a term read at the wrong weights fails)."""
    records, _, _ = trajectory(tmp_path, bt.ARMS)
    for record in records:
        point = record["point"]
        assert torch.equal(point.batch["group_ids"].view(-1, SETTING.num_generations)[:, 0].repeat_interleave(
            SETTING.num_generations), point.batch["group_ids"])  # whole groups, in order, as terms_by_hand reads them
        truth = terms_by_hand(point, SETTING.epsilon, SETTING.epsilon_high, SETTING.temperature)
        for key, value in truth.items():
            assert record["terms"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert records[-1]["terms"]["removed_share"] > 1e-2  # a term of a size the check can see


def test_each_arm_probe_reads_its_own_weights_when_the_trajectory_model_is_patched(tmp_path: pathlib.Path) -> None:
    """The cause of the meter bug: the trajectory's trainer patches ``model`` (TRL's fused LM head) before the arms are
    copied from it, and a plain deep copy's forward kept the original's in a closure, so every arm's probe read the
    trajectory's weights. Changing an arm's weights must change its probe; changing the trajectory's must not."""
    task, tokenizer = TinyFormsTask(), tiny_tokenizer()
    model = tiny_model(0)
    bt.DFPOTrainer(model=model, reward_funcs=task.reward_funcs, args=SETTING.config("none", str(tmp_path), 0,
                   use_cpu=True), train_dataset=task.build_dataset("train", 8, 0), processing_class=tokenizer)
    arms = bt.branch_trainers(model, tokenizer, task, SETTING, 0, str(tmp_path), bt.ARMS, use_cpu=True)
    probe = bt.Probe.from_task(task, SETTING.probe_prompts, SETTING.temperature)
    start = [probe.measure(t.model, tokenizer)["log_odds"] for t in arms]
    assert start[0] == start[1] == probe.measure(model, tokenizer)["log_odds"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    assert [probe.measure(t.model, tokenizer)["log_odds"] for t in arms] == start  # the trajectory's are not read
    with torch.no_grad():
        for p in arms[1].model.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    assert probe.measure(arms[0].model, tokenizer)["log_odds"] == start[0]
    moved = probe.measure(arms[1].model, tokenizer)["log_odds"]
    assert moved == pytest.approx(plain_log_odds(arms[1].model.state_dict(), probe), abs=1e-9)
    assert max(abs(x - y) for x, y in zip(moved, start[1], strict=True)) > 1e-3


def test_the_setting_trains_in_float32_as_registered() -> None:
    """The registration says float32 weights: TRL's GRPOConfig turns bf16 autocast on by default, the setting must
    turn it off (the 2026-11-28 run did not)."""
    config = SETTING.config("none", "/tmp/unused", 0, use_cpu=True)
    assert config.bf16 is False and config.fp16 is False
