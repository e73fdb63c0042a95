"""What a DFPO checkpoint holds besides TRL's, so that a resumed run is the uninterrupted one at any step.

transformers checkpoints the weights, the optimizer, the scheduler, ``TrainerState`` and the global RNG states (the
latter restored right before the first resumed step, i.e. as they were when the checkpoint was written). TRL 1.16
adds nothing about its rollout: the buffer ``_buffered_inputs`` (the completions, advantages and old log-probs of the
current rollout, one slice per micro-step), the micro-step counter ``_step`` (which slice comes next, and when the
next rollout is drawn) and the prompt sampler's shuffle generator are lost. So TRL regenerates at a checkpoint inside
a rollout (with the resumed policy, restarting its generation schedule there) and, resumed in a later epoch, draws
the first epoch's prompt order again. DFPO writes the first two with each checkpoint (one file per process:
:data:`ROLLOUT_STATE_FILE`) and, on resume, restores them and advances the sampler past the epochs already trained
(docs/source/concepts/decisions.md, "Resume").
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .compat import generate_every

__all__ = ["ROLLOUT_STATE_FILE", "RolloutResume", "load_rollout_state", "replay_sampler_epochs", "rollout_state_path",
           "save_rollout_state", "tied_missing_keys", "without_tied_keys"]

logger = logging.getLogger(__name__)

# One file per process in each checkpoint folder, beside transformers' rng_state_<process>.pth.
ROLLOUT_STATE_FILE = "dfpo_rollout_state_{process}.pt"


def rollout_state_path(checkpoint: str, process_index: int) -> str:
    """The file of process ``process_index``'s rollout state in the checkpoint folder ``checkpoint``."""
    return os.path.join(checkpoint, ROLLOUT_STATE_FILE.format(process=process_index))


def mid_rollout(trainer: Any) -> bool:
    """True when the next micro-step reads TRL's buffer instead of drawing a new rollout (TRL 1.16's condition in
    ``_prepare_inputs``, negated)."""
    return trainer._buffered_inputs is not None and trainer._step % generate_every(trainer) != 0


def save_rollout_state(trainer: Any, checkpoint: str) -> None:
    """Write this process's micro-step counter and, inside a rollout, its buffer, to ``checkpoint``. At a rollout
    boundary the buffer is spent (TRL draws the next rollout at the next micro-step) and is not written."""
    state = {
        "global_step": trainer.state.global_step,
        "step": trainer._step,
        "buffer": trainer._buffered_inputs if mid_rollout(trainer) else None,
        "processes": trainer.accelerator.num_processes,  # how many such files a whole checkpoint holds
    }
    os.makedirs(checkpoint, exist_ok=True)  # as transformers does for its RNG file: each process may write its own
    torch.save(state, rollout_state_path(checkpoint, trainer.accelerator.process_index))


def check_every_process_saved(checkpoint: str, path: str) -> None:
    """Refuse a checkpoint that holds some processes' rollout files and not all of them: each process writes its
    own without waiting for the others, so a process killed while the checkpoint was saved leaves its file out
    while the others complete theirs. Resumed, that process would regenerate the rollout while the others continue
    it, and they would wait on each other in their next collectives until ``ddp_timeout`` (seen on two gloo
    processes: tests/cli/test_killed_rank.py). Every process reaches the same verdict, from the same folder."""
    found = {int(name[len("dfpo_rollout_state_"):-len(".pt")]) for name in os.listdir(checkpoint)
             if name.startswith("dfpo_rollout_state_") and name.endswith(".pt")}
    if not found:
        return  # written by TRL's trainer, or with save_only_model: resumed as TRL does
    # the process count a file records (files written before it was recorded: the largest index found, plus one)
    recorded = torch.load(rollout_state_path(checkpoint, min(found)), map_location="cpu", weights_only=True)
    processes = max(max(found) + 1, int(recorded.get("processes", 0)))
    missing = [ROLLOUT_STATE_FILE.format(process=p) for p in range(processes) if p not in found]
    if missing:
        raise ValueError(
            f"{checkpoint} is half-written: it lacks {', '.join(missing)} of its {processes} processes (a process "
            f"stopped while the checkpoint was saved). Resume from the checkpoint before it; resuming this one would "
            f"leave the processes waiting on each other ({os.path.basename(path)} is this process's)."
        )


def load_rollout_state(trainer: Any, checkpoint: str) -> bool:
    """Restore this process's micro-step counter and buffer from ``checkpoint``; False (with a warning when the
    checkpoint lies inside a rollout) when the checkpoint has no rollout state (written by TRL's own trainer, or by
    an earlier dfpo_trl): the run then resumes as TRL's does."""
    path = rollout_state_path(checkpoint, trainer.accelerator.process_index)
    check_every_process_saved(checkpoint, path)
    if not os.path.isfile(path):
        steps = trainer.state.global_step * trainer.args.gradient_accumulation_steps
        if steps % generate_every(trainer) != 0:
            logger.warning(
                "%s has no %s: resuming inside a rollout regenerates it, as TRL does, so the run will not continue "
                "the interrupted one (checkpoints written by DFPOTrainer hold it).", checkpoint, os.path.basename(path)
            )
        return False
    device = trainer.accelerator.device
    # torch.load maps to "cpu", not to "cpu:0": the device accelerate gives every process of a multi-process CPU run
    state = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=True)
    if state.get("global_step") != trainer.state.global_step:
        raise ValueError(
            f"{path} was written at optimizer step {state.get('global_step')}, but the checkpoint's trainer_state.json "
            f"says step {trainer.state.global_step}: the folder mixes two checkpoints. Delete {os.path.basename(path)} "
            "to resume as TRL does (regenerating the rollout), or resume from an intact checkpoint."
        )
    trainer._step = state["step"]
    trainer._buffered_inputs = state["buffer"]
    return True


def replay_sampler_epochs(sampler: Any, epochs: int) -> None:
    """Advance a freshly seeded prompt sampler past ``epochs`` epochs, drawing each epoch's order as the
    uninterrupted run did (TRL's ``RepeatSampler`` draws one permutation from its own generator each time it is
    iterated, once per epoch): the resumed epoch then gets its own order, not the first epoch's."""
    if not getattr(sampler, "shuffle", False):
        return  # an unshuffled order is the same every epoch
    for _ in range(epochs):
        next(iter(sampler), None)


def tied_missing_keys(model: torch.nn.Module, missing: list[str]) -> list[str]:
    """The keys of ``missing`` that name the same tensor as a key the checkpoint did hold: tied weights (e.g.
    ``lm_head.weight``, shared with the input embedding), which ``save_pretrained`` writes once. Loading the key held
    fills both names, so their absence from the checkpoint loses nothing."""
    tensors = model.state_dict(keep_vars=True)  # a tied tensor appears under each of its names
    absent = set(missing)
    loaded = {id(tensor) for name, tensor in tensors.items() if name not in absent}
    return [name for name in missing if name in tensors and id(tensors[name]) in loaded]


def without_tied_keys(model: torch.nn.Module, load_result: Any) -> Any:
    """A ``load_state_dict`` result without the missing keys that are tied weights (:func:`tied_missing_keys`), for
    transformers' warnings on a checkpoint's missing keys: the checkpoint holds them once, under the other name."""
    tied = set(tied_missing_keys(model, list(load_result.missing_keys)))
    if not tied:
        return load_result
    return load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])


class RolloutResume:
    """The resume half of ``DFPOTrainer`` (a mixin before ``trl.GRPOTrainer`` in its bases): TRL's checkpoint plus
    the rollout state above, and the prompt sampler advanced on resume. Each method calls TRL's own first."""

    _train_sampler: Any = None  # the prompt sampler of the current train() call: see _get_train_sampler

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """TRL's checkpoint, plus this process's rollout buffer and micro-step counter (trl_hooks/resume.py), which
        TRL does not save: a run resumed inside a rollout then continues it instead of regenerating."""
        super()._save_checkpoint(model, trial)
        if not self.args.save_only_model:  # a model-only checkpoint holds no optimizer or RNG state either
            folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"  # the folder TRL's save just wrote
            save_rollout_state(self, os.path.join(self._get_output_dir(trial=trial), folder))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """TRL's load, plus the rollout state (when the checkpoint has it) and the prompt sampler advanced past the
        epochs already trained; runs after the training state is restored and before the first epoch begins."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        load_rollout_state(self, checkpoint)
        if self._train_sampler is not None:
            replay_sampler_epochs(self._train_sampler, int(self.state.epoch or 0))

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        """TRL's prompt sampler, kept to be advanced on resume."""
        self._train_sampler = super()._get_train_sampler(dataset)
        return self._train_sampler

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """transformers' warnings on a checkpoint's missing keys, without the tied weights (``lm_head.weight`` of a
        model that ties it to the input embedding): the checkpoint holds them once, under the other name."""
        super()._issue_warnings_after_load(without_tied_keys(self.model, load_result))
