"""Resuming from a checkpoint: with DFPOTrainer the resumed run is the uninterrupted one at any step.

What TRL 1.16 / transformers 5 checkpoint: weights, optimizer, scheduler, ``TrainerState`` (global step, log
history, ``num_input_tokens_seen``) and the python/numpy/torch RNG states, restored right before the first
resumed step. What they do not: the rollout buffer (``_buffered_inputs``), the micro-step counter ``_step`` and
the state of ``RepeatSampler``'s private shuffle generator. DFPOTrainer writes the first two with each checkpoint
and advances the sampler past the epochs already trained (dfpo_trl/trl_hooks/resume.py). DFPO keeps nothing else
across steps: its group shuffle draws from its own generator seeded per rollout from (seed, process, optimizer
step), the pre-pass and DelTA's λ̄ are recomputed from each rollout, its metrics are flushed at every log and its
settings come from the config; DelTA's ``delta_random`` control seeds its generator the same way. Hence (each case
tested below):

* checkpoint at a generation boundary of the first epoch: the resumed run *is* the uninterrupted one (every
  logged value and every weight bit-identical), for ``trl.GRPOTrainer`` and ``DFPOTrainer`` alike;
* checkpoint inside a generation buffer: ``DFPOTrainer`` continues the saved rollout, bit-identical again;
  ``trl.GRPOTrainer`` regenerates at the resume step with the resumed policy and restarts its generation schedule
  there, so its run continues differently;
* checkpoint in a later epoch: ``DFPOTrainer`` draws that epoch's prompt order, bit-identical again;
  ``trl.GRPOTrainer``'s new sampler replays the first epoch's order.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny import addition_dataset, base_args, last_digit_reward, tiny_model, tiny_tokenizer
from trl import GRPOConfig, GRPOTrainer

from dfpo_trl import DFPOConfig, DFPOTrainer
from dfpo_trl.trl_hooks.resume import load_rollout_state

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


def train(name: str, output_dir: Path, resume: Path | None = None, prompts: int = 16, tied: bool = False,
          **overrides: Any):
    trainer_cls, config_cls, extra = TRAINERS[name]
    settings = {**OFF_POLICY, **extra, **overrides}
    args = config_cls(**base_args(output_dir=str(output_dir), save_strategy="steps", **settings))
    trainer = recording(trainer_cls)(
        model=tiny_model(0, tied=tied), reward_funcs=last_digit_reward, args=args,
        train_dataset=addition_dataset(prompts), processing_class=tiny_tokenizer(),
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


def test_mid_rollout_resume_is_exact_with_dfpo_and_regenerates_with_trl(uninterrupted, tmp_path):
    """Checkpoints 2 and 6 lie inside a 4-step rollout (steps_per_generation 4, one micro-step per optimizer step).
    DFPOTrainer's checkpoint holds the rollout buffer and micro-step counter: resumed from either, it draws no new
    rollout until the uninterrupted run did, and every logged value and every weight equals the uninterrupted run's
    bit for bit. TRL saves neither: GRPOTrainer regenerates at step 2 (same prompts, resumed policy), its next
    rollout comes at step 6, not 4, and the run differs."""
    full, out = uninterrupted["dfpo"]
    for save in (2, 6):
        resumed = train("dfpo", tmp_path / f"dfpo-{save}", resume=out / f"checkpoint-{save}", max_steps=8,
                        save_steps=2)
        assert resumed.generations == [g for g in full.generations if g[0] > save]
        logs = step_logs(resumed, save)
        assert sorted(logs) == list(range(save + 1, 9))
        assert logs == step_logs(full, save)
        assert same_weights(full, resumed)
        # whole groups in every micro-batch, as in the uninterrupted run's last 8 - save micro-steps
        assert all(torch.equal(a, b) for a, b in zip(resumed.micro_batch_groups, full.micro_batch_groups[save:],
                                                      strict=True))

    grpo_full, grpo_out = uninterrupted["grpo"]
    grpo = train("grpo", tmp_path / "grpo", resume=grpo_out / "checkpoint-2", max_steps=8, save_steps=2)
    (_, first), (_, second) = grpo_full.generations
    assert [step for step, _ in grpo_full.generations] == [0, 4]
    assert grpo.generations == [(2, first), (6, second)]
    assert step_logs(grpo, 2) != step_logs(grpo_full, 2)
    assert not same_weights(grpo_full, grpo)


def test_resume_without_rollout_state_regenerates_as_trl_does(uninterrupted, tmp_path, caplog):
    """A checkpoint without DFPO's rollout file (written by TRL's trainer, or by an earlier dfpo_trl): DFPOTrainer
    resumes as TRL does, regenerating at the resume step, and says so in one warning."""
    full, out = uninterrupted["dfpo"]
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(out / "checkpoint-2", checkpoint)
    (checkpoint / "dfpo_rollout_state_0.pt").unlink()
    with caplog.at_level("WARNING", logger="dfpo_trl.trl_hooks.resume"):
        resumed = train("dfpo", tmp_path / "out", resume=checkpoint, max_steps=8, save_steps=2)
    assert [step for step, _ in resumed.generations] == [2, 6]
    assert not same_weights(full, resumed)
    assert "regenerates it, as TRL does" in caplog.text


def test_rollout_state_of_another_step_is_refused(uninterrupted, tmp_path):
    """A rollout file that does not belong to the checkpoint's step (folders mixed by hand) is refused, naming
    the file and both steps, before any step runs."""
    _, out = uninterrupted["dfpo"]
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(out / "checkpoint-2", checkpoint)
    shutil.copy(out / "checkpoint-6" / "dfpo_rollout_state_0.pt", checkpoint / "dfpo_rollout_state_0.pt")
    with pytest.raises(ValueError, match=r"dfpo_rollout_state_0.pt was written at optimizer step 6.*says step 2"):
        train("dfpo", tmp_path / "out", resume=checkpoint, max_steps=8, save_steps=2)


def test_rollout_state_loads_on_every_process_of_a_multi_process_cpu_run(tmp_path):
    """accelerate gives every process of a multi-process CPU launch (gloo) the device cpu:0, which torch.load cannot
    map to ("don't know how to restore data location"): the resume of a 2-process CPU run failed on every process
    before its first step (tests/cli/test_killed_rank.py). The file loads to the CPU there."""
    advantages = torch.arange(4.0)
    for process in (0, 1):
        torch.save({"global_step": 3, "step": 5, "buffer": [{"advantages": advantages}], "processes": 2},
                   tmp_path / f"dfpo_rollout_state_{process}.pt")
    trainer = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu", 0), process_index=1),
                              state=SimpleNamespace(global_step=3), _step=0, _buffered_inputs=None)
    assert load_rollout_state(trainer, str(tmp_path))
    assert trainer._step == 5 and torch.equal(trainer._buffered_inputs[0]["advantages"], advantages)


def test_checkpoint_missing_a_process_rollout_file_is_refused_on_every_process(tmp_path):
    """A checkpoint holding some processes' rollout files and not all of them (a process killed while it was
    saved) is refused by every process, the one without its file and the others, before a collective: resumed,
    the process without it regenerated the rollout while the others continued it, and they waited on each other
    until ddp_timeout. The files record their process count, so a missing last process is seen too; the app's
    check reads the same names before torch (PROCESS_FILES)."""
    from dfpo_trl.cli.paths import PROCESS_FILES
    from dfpo_trl.trl_hooks.resume import ROLLOUT_STATE_FILE

    assert PROCESS_FILES[1].match(ROLLOUT_STATE_FILE.format(process=7))
    for process in (0, 1):
        torch.save({"global_step": 3, "step": 5, "buffer": None, "processes": 3},
                   tmp_path / f"dfpo_rollout_state_{process}.pt")
    for process in (0, 2):
        trainer = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=process),
                                  state=SimpleNamespace(global_step=3), _step=0, _buffered_inputs=None)
        with pytest.raises(ValueError, match=r"is half-written: it lacks dfpo_rollout_state_2.pt of its 3 processes"):
            load_rollout_state(trainer, str(tmp_path))
    torch.save({"global_step": 3, "step": 5, "buffer": None, "processes": 3}, tmp_path / "dfpo_rollout_state_2.pt")
    assert load_rollout_state(trainer, str(tmp_path)) and trainer._step == 5


def test_resume_in_a_later_epoch_is_exact_with_dfpo_and_replays_epoch_0_with_trl(tmp_path):
    """8 prompts = one rollout = one epoch of 4 steps. TRL's RepeatSampler draws each epoch's order from a private
    generator that no checkpoint holds: GRPOTrainer resumed in epoch 1 draws epoch 0's order again. DFPOTrainer
    advances the new sampler past the epochs trained, so resumed at the epoch boundary (4) or inside epoch 1's
    rollout (6) it trains on epoch 1's order and ends with the uninterrupted run's weights."""
    common = dict(max_steps=8, save_steps=2, prompts=8)
    runs = {name: train(name, tmp_path / f"full-{name}", **common) for name in TRAINERS}
    (_, epoch0), (_, epoch1) = runs["grpo"].generations
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1
    assert runs["dfpo"].generations == runs["grpo"].generations
    grpo = train("grpo", tmp_path / "grpo", resume=tmp_path / "full-grpo" / "checkpoint-4", **common)
    assert grpo.generations == [(4, epoch0)]
    for save in (4, 6):
        dfpo = train("dfpo", tmp_path / f"dfpo-{save}", resume=tmp_path / "full-dfpo" / f"checkpoint-{save}",
                     **common)
        assert dfpo.generations == ([(4, epoch1)] if save == 4 else [])
        assert step_logs(dfpo, save) == step_logs(runs["dfpo"], save)
        assert same_weights(runs["dfpo"], dfpo)


def test_tied_weights_resume_without_a_missing_key_warning(tmp_path):
    """A model whose LM head is its input embedding (as SmolLM2's): the checkpoint holds the tensor once, as
    model.embed_tokens.weight. Resuming loads it into the shared tensor, so transformers' warning "There were missing
    keys in the checkpoint model loaded: ['lm_head.weight']" said nothing true: DFPOTrainer leaves the tied key out
    (the weights are the uninterrupted run's), and still warns about a key that is really missing."""
    trainer_log = logging.getLogger("transformers.trainer")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    trainer_log.addHandler(handler)
    try:
        full = train("dfpo", tmp_path / "full", tied=True, max_steps=3, save_steps=2)
        resumed = train("dfpo", tmp_path / "resumed", resume=tmp_path / "full" / "checkpoint-2", tied=True,
                        max_steps=3, save_steps=2)
        assert not [r for r in records if "missing keys" in r]
        assert same_weights(full, resumed)
        model = resumed.model
        assert model.lm_head.weight is model.model.embed_tokens.weight
        held = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "model.norm.weight")}
        resumed._issue_warnings_after_load(model.load_state_dict(held, strict=False))
        assert [r for r in records if "missing keys" in r] == [
            "There were missing keys in the checkpoint model loaded: ['model.norm.weight']."
        ]
    finally:
        trainer_log.removeHandler(handler)
