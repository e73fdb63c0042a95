"""DelTA through the real trainer (docs/source/concepts/delta.md): rollout-time weights, alignment, loss, metrics,
processes."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_delta import config_options
from tiny import (
    WORDS,
    addition_dataset,
    base_args,
    capturing,
    free_port,
    hand_batch,
    loss_and_grads,
    tiny_model,
    tiny_tokenizer,
)
from tolerance import assert_close_to_rounding

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.delta.rollout import (
    DELTA_WEIGHTS_KEY,
    side_means,
    sum_over_processes,
    token_table,
)
from dfpo_trl.delta.rollout import _rollout_weights as rollout_weights
from dfpo_trl.delta.weights import _token_weights_from_hidden as token_weights_from_hidden
from dfpo_trl.objectives.normalise import self_normalise

DELTA = dict(token_weighting="delta", loss_type="dapo")


def digit_count_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Number of digit tokens: varied enough that every group has both advantage signs."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def make(trainer_cls: type = DFPOTrainer, seed: int = 0, **overrides: Any):
    trainer = trainer_cls(
        model=tiny_model(seed),
        reward_funcs=digit_count_reward,
        args=DFPOConfig(**base_args(**{**DELTA, "temperature": 1.3, **overrides})),
        train_dataset=addition_dataset(),
        processing_class=tiny_tokenizer(),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def rollout_rows(trainer, prompts: int = 2) -> list[dict[str, Any]]:
    ds = trainer.train_dataset
    return [ds[i] for i in range(prompts) for _ in range(trainer.num_generations)]


def loss_mask(output: dict[str, Any]) -> torch.Tensor:
    mask = output["completion_mask"]
    return mask * output["tool_mask"] if "tool_mask" in output else mask


@torch.no_grad()
def manual_hidden_and_probs(trainer, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """h and p by hand: the backbone's last hidden state at the position *before* each completion token, and
    the temperature-scaled probability the LM head gives that token from it."""
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    length = batch["completion_ids"].size(1)
    full = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    hidden = full[:, -(length + 1) : -1]
    logits = model.lm_head(hidden).float() / trainer.temperature
    probs = torch.softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return hidden, probs


def expected_weights(trainer, batch: dict[str, Any]) -> torch.Tensor:
    hidden, probs = manual_hidden_and_probs(trainer, batch)
    mask = loss_mask(batch)
    raw = token_weights_from_hidden(hidden, probs, batch["advantages"], mask, **config_options(trainer.args))
    if trainer.args.loss_type == "grpo":
        return self_normalise(raw, mask, dim=-1) * mask
    return self_normalise(raw, mask) * mask


class CountingTrainer(DFPOTrainer):
    """Counts the policy log-prob forwards (TRL's helper called on the policy model)."""

    policy_forwards = 0

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if model is self.model:
            self.policy_forwards += 1
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)


# ------------------------------------------------------------------------------------------------- config
def config(**overrides):
    return DFPOConfig(**base_args(**overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(token_weighting="delta_ta"), r"token_weighting='delta_ta' is not valid"),
        (dict(**DELTA, delta_lambda_min=0.0), r"0 < delta_lambda_min <= delta_lambda_max"),
        (dict(**DELTA, delta_lambda_min=1.3), r"delta_lambda_min=1.3 with delta_lambda_max=1.2"),
        (dict(**DELTA, delta_refine_steps=-1), r"delta_refine_steps=-1 must be an integer >= 0"),
        (dict(**DELTA, delta_gamma=0.0), r"delta_gamma=0.0 is not valid: it must be 'std', 'mean_abs' or a finite"),
        (dict(**DELTA, delta_gamma=None), r"delta_gamma=None is no longer accepted"),
        (dict(**DELTA, delta_assignment="argmax"), r"delta_assignment='argmax' is not valid"),
        (dict(**DELTA, delta_contrast="both"), r"delta_contrast='both' is not valid"),
        (dict(token_weighting="delta", importance_sampling_level="sequence", loss_type="grpo"),
         r"only rescale each sequence.*importance_sampling_level='token'"),
        (dict(token_weighting="delta", loss_type="cispo"), r"loss_type='cispo' is not a token-level clipped loss"),
        (dict(token_weighting="delta", loss_type="sapo"), r"loss_type='sapo'"),
        (dict(token_weighting="delta", loss_type="vespo"), r"loss_type='vespo'"),
        (dict(token_weighting="delta", loss_type="luspo"), r"loss_type='luspo'"),
        (dict(delta_random=True), r"delta_random: DelTA options have no effect unless token_weighting='delta'"),
        (dict(delta_gamma="mean_abs"), r"delta_gamma: DelTA options have no effect unless token_weighting='delta'"),
    ],
)
def test_delta_config_refusals_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_delta_config_accepts_token_level_and_grpo_fix():
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        assert config(token_weighting="delta", loss_type=loss_type, symmetric_clip=True).token_weighting == "delta"


# ---------------------------------------------------------------------------------------------- alignment
def test_captured_hidden_is_the_final_norm_output_before_each_completion_token():
    trainer = make()
    model = trainer.model
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, len(WORDS), (3, 4), generator=g)
    prompt_mask = torch.ones(3, 4, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_ids[0, :2] = 0
    completion_ids = torch.randint(3, len(WORDS), (3, 5), generator=g)
    completion_mask = torch.ones(3, 5, dtype=torch.long)
    completion_mask[2, 3:] = 0  # right padding
    ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)

    norm_out = []
    handle = model.model.norm.register_forward_hook(lambda m, a, o: norm_out.append(o.detach()))
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask)
    capture = trainer.capture_hidden_states(batch, batch_size=2)  # two chunks
    handle.remove()
    assert capture.hidden.shape == (3, 5, model.config.hidden_size)
    hidden = capture.hidden
    with torch.no_grad():  # the capture was for that forward only: a later one leaves it alone
        trainer._get_per_token_logps_and_entropies(model, ids, attention, 5, batch_size=2)
    assert capture.hidden is hidden
    norm_full = torch.cat(norm_out)  # (3, 4 + 5, d)
    for t in range(5):  # completion token t (absolute position 4 + t) is predicted from position 4 + t - 1
        assert torch.equal(capture.hidden[:, t], norm_full[:, 4 + t - 1])
        logits = model.lm_head(norm_full[:, 4 + t - 1]) / trainer.temperature
        p = torch.softmax(logits, -1).gather(-1, completion_ids[:, t : t + 1]).squeeze(-1)
        valid = completion_mask[:, t].bool()
        assert torch.allclose(capture.logps[valid, t].exp(), p[valid], atol=1e-5)


# -------------------------------------------------------------------------------------- rollout weights
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize(
    ("steps_per_generation", "extra_forwards"),
    [(2, 0), (1, 1)],  # off-policy: TRL's old-log-prob forward is reused; on-policy: one forward is paid
)
def test_rollout_weights_equal_the_function_with_at_most_one_extra_forward(
    loss_type, steps_per_generation, extra_forwards
):
    counts, outputs = {}, {}
    for weighting in ("none", "delta"):
        trainer = make(CountingTrainer, token_weighting=weighting, loss_type=loss_type,
                       steps_per_generation=steps_per_generation)
        torch.manual_seed(11)
        outputs[weighting] = trainer._generate_and_score_completions(rollout_rows(trainer))
        counts[weighting] = trainer.policy_forwards
    assert counts["delta"] - counts["none"] == extra_forwards
    out = outputs["delta"]
    assert DELTA_WEIGHTS_KEY not in outputs["none"]
    assert torch.equal(out["completion_ids"], outputs["none"]["completion_ids"])  # same rollout
    assert ("old_per_token_logps" in out) == (steps_per_generation == 2)
    adv, mask = out["advantages"], loss_mask(out)
    assert (adv > 0).any() and (adv < 0).any()
    weights = out[DELTA_WEIGHTS_KEY]
    assert weights.shape == out["completion_ids"].shape
    assert torch.allclose(weights, expected_weights(trainer, out), atol=1e-5)
    assert weights[mask.bool() & (adv != 0)[:, None]].std() > 1e-3  # non-trivial weights
    if loss_type == "grpo":
        assert torch.allclose((weights * mask).sum(1), mask.sum(1).float(), atol=1e-5)
    else:
        assert_close_to_rounding((weights * mask).sum(), mask.sum().float())  # λ̄ averages 1 over the batch
    trainer.flush_dfpo_metrics("train")  # DelTA's metrics reach TRL's log through the metric store
    log = trainer._metrics["train"]
    assert 0.8 <= log["delta/lambda_pos_mean"][-1] <= 1.2 and 0.8 <= log["delta/lambda_neg_mean"][-1] <= 1.2


@pytest.mark.parametrize(("steps_per_generation", "extra_forwards"), [(2, 0), (1, 1)])
def test_peft_policy_with_adapter_disabled_reference_is_captured_correctly(steps_per_generation, extra_forwards):
    """With PEFT and β ≠ 0 the reference forward also runs through the policy (adapter disabled): the weights
    must come from the adapter-enabled policy forward, TRL's or our own."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    counts = {}
    for weighting in ("none", "delta"):
        trainer = CountingTrainer(
            model=tiny_model(0), reward_funcs=digit_count_reward, train_dataset=addition_dataset(),
            processing_class=tiny_tokenizer(), peft_config=lora,
            args=DFPOConfig(**base_args(token_weighting=weighting, loss_type="dapo", beta=0.04, temperature=1.3,
                                        steps_per_generation=steps_per_generation)),
        )
        trainer.model.train()
        torch.manual_seed(11)
        out = trainer._generate_and_score_completions(rollout_rows(trainer))
        counts[weighting] = trainer.policy_forwards
    assert counts["delta"] - counts["none"] == extra_forwards
    assert "ref_per_token_logps" in out
    expected = expected_weights(trainer, out)
    assert torch.allclose(out[DELTA_WEIGHTS_KEY], expected, atol=1e-5)
    with trainer.model.disable_adapter():  # the reference's h would give other weights
        reference = expected_weights(trainer, out)
    assert not torch.allclose(out[DELTA_WEIGHTS_KEY], reference, atol=1e-4)


def test_eval_rollouts_carry_no_weights():
    trainer = make()
    trainer.model.eval()
    out = trainer._generate_and_score_completions(rollout_rows(trainer, 1))
    assert DELTA_WEIGHTS_KEY not in out


# ------------------------------------------------------------------------------------------------- loss
def off_policy_batch(trainer, seed: int = 1):
    """Random completions with padding, zero-mean advantages per group, old log-probs putting some tokens
    outside the clip range, and positive DelTA-like weights."""
    g = torch.Generator().manual_seed(seed)
    rows, length = 8, 6
    ids = torch.randint(3, len(WORDS), (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, 4:] = 0
    mask[5, 3:] = 0
    rewards = torch.randn(rows, generator=g).view(-1, 4)
    adv = (rewards - rewards.mean(1, keepdim=True)).view(-1)
    batch = hand_batch(ids, mask, adv, None)
    with torch.no_grad():
        cur, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], ids], 1), torch.cat([batch["prompt_mask"], mask], 1),
            length,
        )
    batch["old_per_token_logps"] = cur - 0.4 * torch.randn(rows, length, generator=g)
    batch[DELTA_WEIGHTS_KEY] = 0.8 + 0.4 * torch.rand(rows, length, generator=g)
    return batch


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("symmetric_clip", [False, True])
def test_token_coefficients_are_scaled_exactly_by_lambda_bar(loss_type, symmetric_clip):
    common = dict(loss_type=loss_type, symmetric_clip=symmetric_clip, steps_per_generation=2)
    plain = make(capturing(DFPOTrainer), token_weighting="none", **common)
    weighted = make(capturing(DFPOTrainer), token_weighting="delta", **common)
    batch = off_policy_batch(plain)
    loss_and_grads(plain, batch)
    loss_and_grads(weighted, batch)
    c_plain, c_weighted = plain.captured.grad, weighted.captured.grad
    lam = batch[DELTA_WEIGHTS_KEY]
    mask = batch["completion_mask"]
    if loss_type == "bnpo":  # bnpo normalises by the micro-batch's tokens: λ̄ averages 1 over them
        lam = self_normalise(lam, mask)
    assert (c_plain == 0).any() and (c_plain.abs() > 1e-4).any()  # some tokens clipped, others not
    assert_close_to_rounding(c_weighted, c_plain * lam)
    assert batch["advantages"].dim() == 1  # the rollout dict is never mutated


# ------------------------------------------------------------------------------------- across iterations
class RecordingTrainer(DFPOTrainer):
    records: list[dict[str, torch.Tensor]]

    def _compute_loss(self, model, inputs):
        fresh = self.capture_hidden_states(inputs)  # λ̄ recomputed at the current θ, for comparison
        mask = loss_mask(inputs)
        _, recomputed = rollout_weights(fresh.hidden, fresh.logps, inputs["advantages"], mask, self.args)
        self.records.append(
            {"ids": inputs["completion_ids"].clone(), "stored": inputs[DELTA_WEIGHTS_KEY].clone(),
             "recomputed": recomputed}
        )
        return super()._compute_loss(model, inputs)


def test_weights_are_computed_once_per_rollout_and_held_across_iterations():
    trainer = make(RecordingTrainer, num_iterations=2, max_steps=2, learning_rate=0.05)
    trainer.records = []
    trainer.train()
    first, second = trainer.records
    assert torch.equal(first["ids"], second["ids"])  # iteration 2 trains on the same rollout ...
    assert torch.equal(first["stored"], second["stored"])  # ... with the same weights
    assert torch.allclose(first["stored"], first["recomputed"], atol=1e-5)  # rollout-time θ: the function
    assert not torch.allclose(second["stored"], second["recomputed"], atol=1e-6)  # θ moved, weights did not


# ----------------------------------------------------------------------------------------------- logging
def test_training_with_grpo_fix_logs_delta_metrics_and_a_token_table(caplog):
    caplog.set_level(logging.INFO, logger="dfpo_trl.delta.weighting")
    trainer = make(symmetric_clip=True, max_steps=2, steps_per_generation=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "delta/lambda_pos_mean" in h]
    assert logs, trainer.state.log_history
    for h in logs:
        for key in ("delta/lambda_pos_mean", "delta/lambda_neg_mean"):
            assert 0.8 <= h[key] <= 1.2
        assert h["delta/lambda_bar_pos_mean"] > 0
    assert any("grpo_fix/negative_capped_fraction" in h for h in trainer.state.log_history)
    table = trainer.delta_token_table
    assert {r["rank"] for r in table} == {"high", "low"}
    assert all(isinstance(r["token"], str) and r["count"] >= 1 for r in table)
    high = [r["mean_lambda"] for r in table if r["rank"] == "high"]
    assert high == sorted(high, reverse=True)
    assert "DelTA token weights" in caplog.text


def test_token_table_ranks_token_ids_by_mean_weight():
    ids = torch.tensor([[5, 6, 7], [5, 8, 9]])
    weights = torch.tensor([[1.2, 0.8, 1.0], [1.0, 9.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, 0.0])  # the second row has Â = 0: not weighted, not in the table
    rows = token_table(weights, ids, adv, torch.ones(2, 3), decode=lambda i: WORDS[i], k=2)
    assert [(r["rank"], r["token_id"], r["mean_lambda"]) for r in rows] == [
        ("high", 5, 1.2), ("high", 7, 1.0), ("low", 6, 0.8), ("low", 7, 1.0)
    ]


# ------------------------------------------------------------------------------------------- processes
def _distributed_worker(
    rank: int, world: int, port: int, data: dict[str, torch.Tensor], configs: dict[str, DFPOConfig], out: Any
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = slice(rank * data["adv"].numel() // world, (rank + 1) * data["adv"].numel() // world)
        for loss_type, cfg in configs.items():
            _, weights = rollout_weights(
                data["hidden"][rows], data["probs"][rows].log(), data["adv"][rows], data["mask"][rows], cfg,
                all_reduce=sum_over_processes,
            )
            out.put((rank, loss_type, weights.numpy()))  # by value (see below)
        means = side_means(data["probs"][rows], data["adv"][rows], data["mask"][rows], sum_over_processes)
        out.put((rank, "side_means", means.numpy()))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_distributed_weights_equal_the_single_process_computation():
    g = torch.Generator().manual_seed(0)
    rows, length, d = 8, 7, 16
    data = {
        "hidden": torch.randn(rows, length, d, generator=g).to(torch.bfloat16),
        "probs": torch.rand(rows, length, generator=g),
        "adv": torch.tensor([1.0, -0.5, 0.0, -0.5, 0.7, -0.7, 0.2, -0.2]),
        "mask": (torch.rand(rows, length, generator=g) > 0.2).long(),
    }
    data["mask"][4:, 5:] = 0  # the second process has fewer tokens
    configs = {loss_type: config(**{**DELTA, "loss_type": loss_type}) for loss_type in ("dapo", "grpo")}
    port = free_port()
    ctx = mp.get_context("fork")  # the children inherit the imports: well under the 30 s budget
    out = ctx.Queue()
    procs = [ctx.Process(target=_distributed_worker, args=(r, 2, port, data, configs, out)) for r in range(2)]
    for p in procs:
        p.start()
    # The ranks send numpy copies: a tensor would travel as a shared-memory handle that cannot be opened once
    # its rank has exited (EOFError or FileNotFoundError here, intermittently).
    results = [out.get(timeout=120) for _ in range(6)]  # a rank that dies or hangs fails here, not CI
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    got = {(rank, key): torch.from_numpy(value) for rank, key, value in results}
    for loss_type, cfg in configs.items():
        _, single = rollout_weights(data["hidden"], data["probs"].log(), data["adv"], data["mask"], cfg)
        both = torch.cat([got[(0, loss_type)], got[(1, loss_type)]])
        assert torch.allclose(both, single, atol=1e-5), loss_type
        assert both.std() > 1e-3
    single_means = side_means(data["probs"], data["adv"], data["mask"])
    assert torch.allclose(got[(0, "side_means")], single_means) and torch.allclose(got[(1, "side_means")], single_means)
