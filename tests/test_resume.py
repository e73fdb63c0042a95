"""Resuming from a checkpoint: exact at a generation boundary, TRL's own behaviour elsewhere.

What TRL 1.16 / transformers 5 checkpoint: weights, optimizer, scheduler, ``TrainerState`` (global step, log
history, ``num_input_tokens_seen``) and the python/numpy/torch RNG states, restored right before the first
resumed step. What they do not: the rollout buffer (``_buffered_inputs``), the micro-step counter ``_step`` and
the state of ``RepeatSampler``'s private shuffle generator. DFPO keeps nothing else across steps: its group
shuffle draws from its own generator seeded per rollout from (seed, process, optimizer step) (it used to draw
from torch's global RNG, which checkpoints restore; both resume exactly, the new stream leaves TRL's global RNG
stream untouched), the pre-pass and DelTA's λ̄ are recomputed from each rollout, its metrics are flushed at every
log and its settings come from the config; DelTA's ``delta_random`` control seeds its generator the same way.
Hence (each case tested below, for
``trl.GRPOTrainer`` and ``DFPOTrainer`` alike):

* checkpoint at a generation boundary of the first epoch: the resumed run *is* the uninterrupted one (every
  logged value and every weight bit-identical);
* checkpoint inside a generation buffer: TRL regenerates at the resume step with the resumed policy and restarts
  its generation schedule there, so the run continues differently (but every micro-batch still holds whole groups);
* checkpoint in a later epoch: the new sampler replays the first epoch's prompt order.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer

OFF_POLICY = dict(
    importance_sampling_level="sequence", loss_type="grpo", per_device_train_batch_size=4, num_generations=2,
    steps_per_generation=4, temperature=1.5, learning_rate=0.05,
)
TRAINERS = {
    "grpo": (GRPOTrainer, GRPOConfig, {}),
    "dfpo": (DFPOTrainer, DFPOConfig, dict(group_transform="min_replace")),
}
UNTIMED = {"step_time"}  # wall-clock, the only logged value that may differ


pytestmark = pytest.mark.usefixtures("one_thread")


def recording(trainer_cls: type) -> type:
    """Records each rollout (global step, prompts) and each micro-batch's group ids (DFPO)."""

    class Recording(trainer_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.generations: list[tuple[int, list[str]]] = []
            self.micro_batch_groups: list[torch.Tensor] = []
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            self.generations.append((self.state.global_step, [x["prompt"] for x in inputs]))
            return super()._generate_and_score_completions(inputs)

        def _compute_loss(self, model, inputs):
            if "group_ids" in inputs:
                self.micro_batch_groups.append(inputs["group_ids"].clone())
            return super()._compute_loss(model, inputs)

    return Recording


def train(name: str, output_dir: Path, resume: Path | None = None, prompts: int = 16, **overrides: Any):
    trainer_cls, config_cls, extra = TRAINERS[name]
    settings = {**OFF_POLICY, **extra, **overrides}
    args = config_cls(**base_args(output_dir=str(output_dir), save_strategy="steps", **settings))
    trainer = recording(trainer_cls)(
        model=tiny_model(0), reward_funcs=last_digit_reward, args=args, train_dataset=addition_dataset(prompts),
        processing_class=tiny_tokenizer(),
    )
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def step_logs(trainer, after: int) -> dict[int, dict[str, Any]]:
    return {
        h["step"]: {k: v for k, v in h.items() if k not in UNTIMED}
        for h in trainer.state.log_history
        if "loss" in h and h["step"] > after
    }


def same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps of each trainer, a generation every 4 steps (G=2, 4 rows a step), checkpoints at 2, 4, 6."""
    runs = {}
    for name in TRAINERS:
        out = tmp_path_factory.mktemp(f"uninterrupted-{name}")
        runs[name] = (train(name, out, max_steps=8, save_steps=2), out)
    return runs


@pytest.mark.parametrize("name", list(TRAINERS))
def test_resume_at_a_generation_boundary_is_exact(name, uninterrupted, tmp_path):
    """Checkpoint 4 = a generation boundary: losses, rewards, grad norms, DFPO's mechanism metrics and the
    final weights of the resumed run equal the uninterrupted run's bit for bit (TRL and DFPO alike)."""
    full, out = uninterrupted[name]
    resumed = train(name, tmp_path, resume=out / "checkpoint-4", max_steps=8, save_steps=2)
    logs = step_logs(resumed, 4)
    assert sorted(logs) == [5, 6, 7, 8]
    assert logs == step_logs(full, 4)
    assert any("reward" in h for h in logs.values()) and all("grad_norm" in h for h in logs.values())
    if name == "dfpo":
        assert all("transform/phi_min" in h for h in logs.values())
        assert min(h["transform/phi_min"] for h in logs.values()) < 1.0  # the transform did act
    assert resumed.generations == [g for g in full.generations if g[0] >= 4]
    assert same_weights(full, resumed)


DELTA = dict(group_transform="none", importance_sampling_level="token", token_weighting="delta")


@pytest.mark.parametrize(
    ("overrides", "save", "steps"),
    [
        pytest.param(dict(gradient_accumulation_steps=2), 2, 4, id="accumulation"),
        pytest.param(dict(steps_per_generation=2, num_iterations=2), 4, 6, id="num_iterations"),
        # groups of 4 over micro-batches of 2 rows: s̄, s̃ from a no-grad pre-pass at every optimizer step
        pytest.param(dict(per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=2), 2, 4,
                     id="pre_pass_layout"),
        # DelTA λ̄ computed once per rollout and carried in the buffer, with GRPO-fix
        pytest.param(dict(**DELTA, symmetric_clip=True), 4, 6, id="delta"),
        # the random-λ control draws from a generator seeded per rollout, so it resumes exactly too
        pytest.param(dict(**DELTA, delta_random=True), 4, 8, id="delta_random"),
    ],
)
def test_dfpo_resume_is_exact_with_accumulation_iterations_layouts_and_delta(overrides, save, steps, tmp_path):
    """Exactness holds whenever save_steps is a multiple of the generation period in optimizer steps,
    steps_per_generation * num_iterations / gradient_accumulation_steps: also with accumulation, reused
    rollouts, the pre-pass layout and DelTA token weights."""
    full = train("dfpo", tmp_path / "full", max_steps=steps, save_steps=save, **overrides)
    resumed = train("dfpo", tmp_path / "resumed", resume=tmp_path / "full" / f"checkpoint-{save}",
                    max_steps=steps, save_steps=save, **overrides)
    logs = step_logs(resumed, save)
    assert sorted(logs) == list(range(save + 1, steps + 1))
    assert logs == step_logs(full, save)
    assert same_weights(full, resumed)


def test_mid_buffer_resume_regenerates_as_trl_does(uninterrupted, tmp_path):
    """Checkpoint 2 lies inside a 4-step buffer. TRL does not save the buffer or its micro-step counter: the
    resumed run regenerates at step 2 (same prompts, resumed policy) and its next rollout comes at step 6, not 4.
    GRPOTrainer and DFPOTrainer do exactly the same; neither continues the uninterrupted run; DFPO's
    micro-batches still hold whole groups."""
    resumed = {name: train(name, tmp_path / name, resume=out / "checkpoint-2", max_steps=8, save_steps=2)
               for name, (_, out) in uninterrupted.items()}
    for name, (full, _) in uninterrupted.items():
        (_, first), (_, second) = full.generations
        assert [step for step, _ in full.generations] == [0, 4]
        assert resumed[name].generations == [(2, first), (6, second)]
        assert step_logs(resumed[name], 2) != step_logs(full, 2)
        assert not same_weights(full, resumed[name])
    assert resumed["grpo"].generations == resumed["dfpo"].generations
    groups = resumed["dfpo"].micro_batch_groups
    assert len(groups) == 6
    assert all(set(Counter(ids.tolist()).values()) == {2} for ids in groups)


@pytest.mark.parametrize("name", list(TRAINERS))
def test_resume_in_a_later_epoch_replays_the_first_epoch_order(name, tmp_path):
    """RepeatSampler's shuffle generator is not checkpointed: resumed in epoch 1, the run draws epoch 0's prompt
    order again (TRL behaviour, the same for both trainers), so it is not the uninterrupted run."""
    common = dict(max_steps=5, save_steps=4, prompts=8)  # 8 prompts = one rollout = one epoch of 4 steps
    full = train(name, tmp_path / "full", **common)
    resumed = train(name, tmp_path / "resumed", resume=tmp_path / "full" / "checkpoint-4", **common)
    (_, epoch0), (_, epoch1) = full.generations
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert resumed.generations == [(4, epoch0)]
