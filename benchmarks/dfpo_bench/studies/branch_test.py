"""Study v4's branch test: does the transform change one update, from one state, on one rollout?

A *branch point* is taken from a real trajectory: a policy state θ_k (weights and AdamW state) and the micro-batch of a
rollout generated j ≥ 1 optimizer steps earlier, at θ_{k−j} (TRL buffers ``steps_per_generation`` = S + 1 micro-batches
per rollout; after j steps on it, micro-batch j is j steps stale, so j runs over 1..S). From that point two *branch
trainers* are loaded with bit-identical weights and optimizer state and each applies ONE optimizer step on the same
micro-batch (same rows, same order, same RNG state): arm ``a`` with one transform (GSPO: ``none``), arm ``b`` with the
other (``min_replace``). Everything they share is loaded, not recomputed; they differ only in ``group_transform``.

Measured per branch point (docs: benchmarks/README.md, "Study v4"):

* on fixed probe prompts (the task's held-out rows) the rewarded forms' log-odds o_p = log π(y_0|x_p) − log π(y_1|x_p)
  and the set's log-mass log Σ_f π(y_f|x_p) (dfpo_trl.metrics.drift, D1 and D4) at the rollout's θ (generation), at
  θ_k (before) and after each arm's step;
* the term the transform removes, at θ_k on the branch micro-batch (DFPO eq. 44–50): the imbalance
  I = Σ_g |Σ_i Â_i s̄_i| / Σ_g Σ_i |Â_i| s̄_i (the share of the advantage mass that GSPO leaves unbalanced; 0 for
  Min-Replace since Σ_i Â_i = 0) and the removed share R = Σ_g Σ_i |Â_i (s̄_i − s̃_i)| / Σ_g Σ_i |Â_i| s̄_i, s̃ the
  Min-Replace weights;
* each arm's loss, pre-clip gradient norm and shared-prefix residual (the trainer's own backward-hook meter,
  ``cancellation/shared_prefix_residual``, and its two-sided version): the residual "before" (GSPO) and "after" (MR).

:func:`run_trajectory` drives a real ``DFPOTrainer`` (GSPO) and calls :func:`branch` at every branch point from a
callback; the trajectory's RNG is left untouched by the branches (``torch.random.fork_rng``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from dfpo_trl import DFPOConfig, DFPOTrainer, get_transform
from dfpo_trl.testing.measures import (
    completion_log_probs,
    end_token_ids,
    equivalent_set_stats,
    group_index,
    loss_mask,
    post_clip_weights,
)
from transformers import TrainerCallback

ARMS = ("none", "min_replace")
RESIDUAL = "cancellation/shared_prefix_residual"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One registered setting of the branch test: the trajectory's shape and the step both arms take."""

    name: str
    staleness: int  # S: the largest j; steps_per_generation = S + 1
    learning_rate: float
    epsilon: float
    epsilon_high: float
    steps: int  # optimizer steps per trajectory
    num_generations: int = 8
    groups_per_micro_batch: int = 4
    max_completion_length: int = 24
    temperature: float = 1.0
    probe_prompts: int = 32
    min_staleness: int = 1  # branch at j ≥ this

    def config(self, transform: str, output_dir: str, seed: int, **extra: Any) -> DFPOConfig:
        """The DFPOConfig of a trajectory (``transform`` none) or of a branch arm: GSPO's sequence ratio, TRL's
        advantage r − mean r (``scale_rewards`` none), whole groups per micro-batch, one micro-batch per optimizer
        step, a constant learning rate, the mechanism meters on."""
        return DFPOConfig(
            output_dir=output_dir, seed=seed, max_steps=self.steps, learning_rate=self.learning_rate,
            lr_scheduler_type="constant", warmup_steps=0,
            per_device_train_batch_size=self.num_generations * self.groups_per_micro_batch,
            num_generations=self.num_generations, steps_per_generation=self.staleness + 1,
            gradient_accumulation_steps=1, max_completion_length=self.max_completion_length,
            temperature=self.temperature, importance_sampling_level="sequence", loss_type="grpo",
            epsilon=self.epsilon, epsilon_high=self.epsilon_high, scale_rewards="none", group_granular_batches=True,
            group_transform=transform, log_mechanism_metrics=True, logging_steps=1, report_to="none",
            save_strategy="no", disable_tqdm=True, use_vllm=False,
            bf16=False, fp16=False,  # the registration's float32: TRL's GRPOConfig turns bf16 autocast on by default
            **extra)


@dataclasses.dataclass
class Probe:
    """Fixed prompts and their equivalent forms (the task's ``equivalent_forms``), scored under the policy."""

    prompts: list[Any]
    forms: list[list[str]]
    temperature: float

    @classmethod
    def from_task(cls, task: Any, n: int, temperature: float, seed: int = 0) -> Probe:
        rows = task.build_dataset("test", n, seed)
        return cls([r["prompt"] for r in rows], [list(task.equivalent_forms(r)) for r in rows], temperature)

    def measure(self, model: Any, tokenizer: Any) -> dict[str, list[float]]:
        """Per prompt, D1 (log-odds, form 0 against 1) and D4 (log-mass of the set), float64 → lists; read through
        the model's own class forward (:func:`class_forward`), so every probe of a branch point (rollout, before,
        each arm after) reads that model's weights in float32, whatever a trainer installed on it."""
        k = len(self.forms[0])
        flat_prompts = [p for p in self.prompts for _ in range(k)]
        flat_forms = [f for forms in self.forms for f in forms]
        with class_forward(model):
            logps = completion_log_probs(model, tokenizer, flat_prompts, flat_forms, temperature=self.temperature,
                                         end_ids=end_token_ids(tokenizer, model)).view(len(self.prompts), k)
        stats = equivalent_set_stats(logps)
        return {"log_odds": stats["log_odds"].tolist(), "set_logp": stats["set_logp"].tolist()}


@contextlib.contextmanager
def class_forward(model: Any) -> Iterator[Any]:
    """``model`` with its instance-level ``forward`` set aside for the block, so a call runs the class's forward on
    ``model``'s own weights. A trainer installs one: TRL's fused LM head (``add_fused_lm_head``) and, once
    prepared, accelerate's bf16 autocast wrapper. Both hold the forward they wrap in a closure bound to the model
    they patched, so on a deep copy of a patched model (whose functions ``copy.deepcopy`` keeps by reference) a plain
    call runs the ORIGINAL model's weights; and the autocast wrapper sits on the trajectory's model only, so its
    probes would be read in bf16 and the arms' in float32."""
    patched = model.__dict__.pop("forward", None)
    try:
        yield model
    finally:
        if patched is not None:
            model.forward = patched


def own_copy(model: Any) -> Any:
    """A deep copy of ``model`` whose forward is its class's (no instance-level ``forward``, see
    :func:`class_forward`): the branch trainer then patches a model whose every path reads the copy's weights."""
    out = copy.deepcopy(model)
    out.__dict__.pop("forward", None)
    out.__dict__.pop("_original_forward", None)  # accelerate's, if ``model`` was prepared
    return out


@dataclasses.dataclass
class BranchPoint:
    """θ_k, its optimizer state and the micro-batch generated ``staleness`` steps earlier, from trajectory ``seed``."""

    seed: int
    step: int
    staleness: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    batch: dict[str, Any]
    generation_probe: dict[str, list[float]] | None


def term_size(trainer: DFPOTrainer, batch: dict[str, Any], transform: str = "min_replace") -> dict[str, float]:
    """The term ``transform`` removes, at the trainer's current θ on ``batch`` (no grad): imbalance
    I = Σ_g |Σ_i Â_i s̄_i| / Σ_g Σ_i |Â_i| s̄_i, removed share R = Σ |Â_i (s̄_i − s̃_i)| / Σ |Â_i| s̄_i (eq. 47, 50), the
    share of rows with Â ≠ 0 outside the clip, and the counts of groups with signal and with both signs."""
    model = trainer.model
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attention, batch["completion_ids"].size(1))
    mask, adv = loss_mask(batch), batch["advantages"]
    old = batch.get("old_per_token_logps")
    old = logps if old is None else old
    w = post_clip_weights(logps.double(), old.double(), mask, adv.double(), trainer.epsilon_low, trainer.epsilon_high)
    index = group_index(batch["group_ids"], trainer.num_generations)
    s_bar, a = w.s_bar[index], adv.double()[index]
    s_tilde = get_transform(transform).apply(s_bar, a, 0.5, 1e-6).double()
    mass = (a.abs() * s_bar).sum()
    signal = a != 0
    return {"imbalance": float((a * s_bar).sum(-1).abs().sum() / mass) if mass > 0 else 0.0,
            "removed_share": float((a * (s_bar - s_tilde)).abs().sum() / mass) if mass > 0 else 0.0,
            "advantage_mass": float(mass), "clipped_share": float((~w.survives[index] & signal).sum() / signal.sum())
            if signal.any() else 0.0, "groups": int(index.size(0)), "signal_groups": int(signal.any(-1).sum()),
            "two_sided_groups": int(((a > 0).any(-1) & (a < 0).any(-1)).sum()),
            "s_bar_spread": float((s_bar.amax(-1) - s_bar.amin(-1)).mean())}


def load_state(trainer: DFPOTrainer, point: BranchPoint) -> None:
    """The branch point's weights and optimizer state (lr included) into ``trainer``'s model and optimizer."""
    trainer.model.load_state_dict(point.model_state)
    trainer.optimizer.load_state_dict(copy.deepcopy(point.optimizer_state))


def identical_states(a: DFPOTrainer, b: DFPOTrainer) -> bool:
    """Bit-identical weights and optimizer state (every tensor equal, every hyperparameter equal)."""
    params = all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(),
                                                     strict=True))
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    groups = [{k: v for k, v in g.items()} for g in sa["param_groups"]] == [dict(g) for g in sb["param_groups"]]
    state = sa["state"].keys() == sb["state"].keys() and all(
        sa["state"][k].keys() == sb["state"][k].keys()
        and all(torch.equal(torch.as_tensor(sa["state"][k][n]), torch.as_tensor(sb["state"][k][n]))
                for n in sa["state"][k]) for k in sa["state"])
    return bool(params and groups and state)


def one_step(trainer: DFPOTrainer, batch: dict[str, Any], rng_seed: int) -> dict[str, float]:
    """One optimizer step of ``trainer`` on ``batch`` as the Trainer takes it with gradient accumulation 1: the
    real ``compute_loss`` (DFPO's rewrite and meters), backward, gradient clipping at ``max_grad_norm``, AdamW step.
    Returns the loss, the pre-clip gradient norm and the shared-prefix residuals the trainer's meter logged."""
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.optimizer.zero_grad(set_to_none=True)
    for values in trainer._metrics["train"].values():
        values.clear()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(rng_seed)
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.flush_dfpo_metrics("train")
    logged = trainer._metrics["train"]

    def last(key: str) -> float | None:
        return float(logged[key][-1]) if logged.get(key) else None

    return {"loss": float(loss.detach()), "grad_norm": float(norm), "residual": last(RESIDUAL),
            "residual_two_sided": last(RESIDUAL + "_two_sided"), "phi_mean": last("transform/phi_mean")}


def branch(arms: Sequence[DFPOTrainer], point: BranchPoint, probe: Probe, tokenizer: Any, terms: dict[str, float],
           before: dict[str, list[float]], repeat: DFPOTrainer | None = None) -> dict[str, Any]:
    """Both arms from ``point``: load, check that they start bit-identical, one step each, probe after. A record.
    With ``repeat`` (a second trainer of arm 0's transform) the step of arm 0 is taken again from the same point:
    ``aa_floor`` = mean_p |o_p^a − o_p^repeat| after the step, the device's nondeterminism floor (0 on the CPU)."""
    for trainer in arms:
        load_state(trainer, point)
    identical = identical_states(arms[0], arms[1])
    out: dict[str, Any] = {"seed": point.seed, "step": point.step, "staleness": point.staleness,
                           "identical_start": identical, "terms": terms, "generation": point.generation_probe,
                           "before": before, "arms": []}
    for trainer in arms:
        step = one_step(trainer, point.batch, rng_seed=point.seed * 100_003 + point.step)
        out["arms"].append({"transform": trainer.args.group_transform, **step,
                            "after": probe.measure(trainer.model, tokenizer)})
    if repeat is not None:
        load_state(repeat, point)
        one_step(repeat, point.batch, rng_seed=point.seed * 100_003 + point.step)
        again = probe.measure(repeat.model, tokenizer)["log_odds"]
        first = out["arms"][0]["after"]["log_odds"]
        out["aa_floor"] = sum(abs(x - y) for x, y in zip(first, again, strict=True)) / len(first)
    return out


class BranchPoints(TrainerCallback):
    """At each optimizer step's end of the trajectory trainer: when the next micro-batch is j ≥ ``min_staleness``
    steps stale, hand a :class:`BranchPoint` to ``on_point``; when the next step generates, score the probe at the
    generating θ (the rollout's policy, against which "the direction the policy has moved since the rollout" is
    read). After ``max_points`` points the trajectory stops."""

    def __init__(self, trainer: DFPOTrainer, setting: Setting, seed: int, probe: Probe, tokenizer: Any,
                 on_point: Callable[[BranchPoint], None], max_points: int | None = None) -> None:
        self.trainer, self.setting, self.seed, self.probe, self.tokenizer = trainer, setting, seed, probe, tokenizer
        self.on_point, self.max_points, self.points, self.generation = on_point, max_points, 0, None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.generation = self.probe.measure(self.trainer.model, self.tokenizer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        j = state.global_step % (self.setting.staleness + 1)
        if j == 0:
            self.generation = self.probe.measure(self.trainer.model, self.tokenizer)
            return
        if j < self.setting.min_staleness or (self.max_points is not None and self.points >= self.max_points):
            return
        trainer = self.trainer
        batch = trainer._buffered_inputs[j]
        point = BranchPoint(self.seed, state.global_step, j,
                            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                            copy.deepcopy(trainer.optimizer.state_dict()), batch, self.generation)
        self.points += 1
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            self.on_point(point)
        trainer.model.train()
        if self.max_points is not None and self.points >= self.max_points:
            control.should_training_stop = True  # nothing left to branch: the trajectory ends here


def branch_trainers(model: Any, tokenizer: Any, task: Any, setting: Setting, seed: int, output_dir: str,
                    arms: Sequence[str] = ARMS, **extra: Any) -> list[DFPOTrainer]:
    """One DFPOTrainer per arm, each on its own copy of ``model`` (:func:`own_copy`: ``model`` may already be the
    trajectory trainer's, patched), with its optimizer created."""
    out = []
    for transform in arms:
        trainer = DFPOTrainer(model=own_copy(model), reward_funcs=task.reward_funcs,
                              args=setting.config(transform, output_dir, seed, **extra),
                              train_dataset=task.build_dataset("train", 8, seed), processing_class=tokenizer)
        trainer.create_optimizer()
        out.append(trainer)
    return out


def run_trajectory(model: Any, tokenizer: Any, task: Any, setting: Setting, seed: int, output_dir: str,
                   on_record: Callable[[dict[str, Any]], None], arms: Sequence[str] = ARMS,
                   max_points: int | None = None, train_size: int = 512, aa_every: int | None = None,
                   **extra: Any) -> DFPOTrainer:
    """A GSPO trajectory of ``setting.steps`` optimizer steps on ``task`` from ``model``; every branch point (j ≥
    ``min_staleness``, at most ``max_points``) branched into ``arms`` and its record handed to ``on_record``; every
    ``aa_every``-th point also repeats arm 0 (the A/A floor, :func:`branch`)."""
    probe = Probe.from_task(task, setting.probe_prompts, setting.temperature)
    trainer = DFPOTrainer(model=model, reward_funcs=task.reward_funcs,
                          args=setting.config("none", output_dir, seed, **extra),
                          train_dataset=task.build_dataset("train", train_size, seed), processing_class=tokenizer)
    arm_trainers = branch_trainers(model, tokenizer, task, setting, seed, output_dir, arms, **extra)
    repeat = branch_trainers(model, tokenizer, task, setting, seed, output_dir, arms[:1], **extra)[0] \
        if aa_every else None
    count = [0]

    def on_point(point: BranchPoint) -> None:
        terms = term_size(trainer, point.batch)
        before = probe.measure(trainer.model, tokenizer)
        again = repeat if aa_every and count[0] % aa_every == 0 else None
        count[0] += 1
        on_record({"setting": setting.name, **branch(arm_trainers, point, probe, tokenizer, terms, before, again)})

    trainer.add_callback(BranchPoints(trainer, setting, seed, probe, tokenizer, on_point, max_points))
    trainer.train()
    return trainer


def effects(record: dict[str, Any]) -> dict[str, float]:
    """The paired effects of one branch record (arm a − arm b), averaged over the probe prompts:

    * ``oriented``: d_p (Δo_p^a − Δo_p^b), d_p = sign(o_p(θ_k) − o_p(θ_gen)), the direction the policy moved since the
      rollout (the form whose s̄ grew is the one the coupling favours); prompts with d_p = 0 count 0. Predicted > 0;
    * ``abs_log_odds``: |o_p^a| − |o_p^b| after the step (the forms' spread; > 0: a drifts further apart);
    * ``set_logp``: D4^a − D4^b after the step; ``gspo_move``: mean_p |Δo_p^a| (the scale of a's own step);
    * ``relative``: oriented / gspo_move (0 when a did not move)."""
    before, gen = record["before"], record["generation"] or record["before"]
    a, b = record["arms"][0]["after"], record["arms"][1]["after"]
    n = len(before["log_odds"])
    direction = [math.copysign(1.0, o - g) if o != g else 0.0 for o, g in zip(before["log_odds"], gen["log_odds"],
                                                                             strict=True)]
    oriented = sum(d * (x - y) for d, x, y in zip(direction, a["log_odds"], b["log_odds"], strict=True)) / n
    move = sum(abs(x - o) for x, o in zip(a["log_odds"], before["log_odds"], strict=True)) / n
    return {"oriented": oriented, "gspo_move": move, "relative": oriented / move if move > 0 else 0.0,
            "abs_log_odds": sum(abs(x) - abs(y) for x, y in zip(a["log_odds"], b["log_odds"], strict=True)) / n,
            "set_logp": sum(x - y for x, y in zip(a["set_logp"], b["set_logp"], strict=True)) / n}
