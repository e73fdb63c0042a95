"""Group layouts under ZeRO-3: DFPO Min-Replace in the ``pre_pass`` and ``redistributed`` layouts
against TRL's own GSPO, at the paper's shape scaled down, and the in-group coefficients of both layouts against
a single-process reference.

Commands (4 GPUs, after the kit's setup ``bash .dev/setup.sh && export PYTHONPATH=/tmp/site:$PWD``). Each stops
itself within ``--deadline-s`` (default 510 s). Timing and check in two commands, each with the whole budget, then
merged here (the safer plan: a 1.7B model loads five times in all):

    python benchmarks/launch/layouts.py --no-check --out-dir $OUT   # reference init + timing  -> $OUT/layouts.json
    python benchmarks/launch/layouts.py --no-time --out-dir $OUT    # reference + coefficient check -> $OUT/layouts.json
    # here, with the two files copied to timing/ and check/:
    python benchmarks/launch/layouts.py --merge timing/layouts.json check/layouts.json \
        --out-dir benchmarks/results/layouts

    # or everything in one command (the check's share of the budget is bounded, the timing gets the rest)
    python benchmarks/launch/layouts.py --out-dir $OUT

    # the same, phase by phase (the work dir carries the random init and the reference between them)
    python benchmarks/launch/layouts.py --phase reference --work-dir /tmp/dfpo-layouts
    accelerate launch --config_file recipes/accelerate/zero3_4gpu.yaml benchmarks/launch/layouts.py --phase check \
        --work-dir /tmp/dfpo-layouts
    accelerate launch --config_file recipes/accelerate/zero3_4gpu.yaml benchmarks/launch/layouts.py --phase time \
        --work-dir /tmp/dfpo-layouts --deadline-s 400
    python benchmarks/launch/layouts.py --phase report --work-dir /tmp/dfpo-layouts --out-dir $OUT

    # CPU check of the pipeline (tiny random model, 4 gloo processes through torchrun, no DeepSpeed), ~2.5 min
    python benchmarks/launch/layouts.py --device cpu --random-config tiny --completion-length 24 \
        --min-completion-length 12 --rounds 2 --out-dir /tmp/layouts-cpu

Shape (defaults): per-device batch 1, G = 4 = processes, ``steps_per_generation`` 16 and accumulation 4, so a
rollout is 4 optimizer steps (1 on-policy, 3 off-policy) as in recipes/qwen3_32b.yaml (128 / 32) and the
pre-pass forwards about as many rows per trained row as at the paper's shape; completions of 256-384 tokens
(random lengths), prompts of 32 tokens; Qwen3-1.7B's shape with SmolLM2's vocabulary, random init.

Phases:

* ``reference`` (one process, no DeepSpeed, float32): saves a random init of ``--random-config`` (Qwen3-1.7B's
  shape, no pad id in the config: trainers.random_config) and computes s̄ (eq. 47) and s̃ (Min-Replace per group,
  ``dfpo_trl.objectives.transforms``) of every row of one fixed generation batch at those weights, as zero3.py does.
* ``check`` (``accelerate launch``, ZeRO-3, float32): the ``pre_pass`` and ``redistributed`` trainers, one after the
  other, train one rollout (``steps_per_generation / gradient_accumulation_steps`` optimizer steps) on that batch
  at learning rate 1e-30 (DFPOConfig refuses 0; every float32 update of that size rounds off, so θ stays the
  initial θ bit for bit), and record the s̄ / s̃ their losses used (each micro-step's ``StepObjective.weights``,
  by ``row_ids``) in the first off-policy optimizer step (the second of the rollout: in the first, θ = θ_old and the
  pre-pass skips its forward, every s = 1). That step's θ is the initial θ, so it must match the reference. The
  check uses ε = 0.2 / 0.28 and old log-probs shifted by N(0, 0.15) per row (as zero3.py), so s̄ spans the whole
  clip range and a wrong or stale member would show as an O(0.1) difference; float32 against float32, tolerance
  ``--tolerance`` (1e-4).
* ``time`` (``accelerate launch``, ZeRO-3, bf16): three trainers in ONE process, each with its own DeepSpeed
  engine, on the same random init and the same fixed rollout: TRL's ``GRPOTrainer`` with GSPO's settings
  (``trainers.trainer_and_config("gspo", baseline_trainer="trl")``), and DFPO Min-Replace (GSPO's ε) forced to
  ``group_layout="pre_pass"`` and to ``"redistributed"``. No generation: every trainer's rollout
  (``_generate_and_score_completions`` below TRL's buffering, so DFPO's own rollout code, the redistribution
  included, runs as in training) returns this process's slice of one hand-built generation batch, with old
  log-probs computed by the model at the rollout (TRL's forward) minus a small per-row shift. Interleaving: each
  trainer's ``train()`` runs in its own thread, and only one thread runs at a time: the threads hand a baton
  over at optimizer-step boundaries (``on_step_end``), in an order drawn per round from a seeded generator,
  identical on every rank, so every rank issues the same collectives in the same order. A round gives every
  method one turn of ``--steps-per-turn`` optimizer steps (default 1: the methods' steps alternate, so a round's
  ratio compares steps a few seconds apart and drift between rounds cancels); one untimed warm-up turn of
  ``--warmup-rollouts`` rollouts per method comes first, so every method is at the same step of its rollout in
  every round.
* ``report``: ``layouts.json`` and the table.

Why threads: a ``Trainer.train()`` call creates its DeepSpeed engine on entry, so calling ``train()`` again per
phase would build a new engine (and leak the old one) every time, and three trainers' loops cannot otherwise be
interleaved step by step in one process. The accelerate state is a process-wide singleton that only the first
``Accelerator`` may configure with a DeepSpeed plugin, so the later trainers share the first one's plugin
(``share_deepspeed_plugin``); every trainer has the same batch sizes, precision and accumulation, so the shared
DeepSpeed config is the same for all.

Timed: an optimizer step from ``on_step_begin`` to ``on_step_end`` (every micro-step's forward and backward, the
pre-pass where there is one, the optimizer step), every rank aligned at both ends (a one-float all-reduce, then a
CUDA synchronise: the time from all ranks starting to the slowest finishing), for the *off-policy* steps only:
every optimizer step but the first of each rollout. The first step holds the rollout (here: slicing the fixed batch,
TRL's old-log-prob forward, and the redistributed layout's one all-to-all per rollout) and the pre-pass skips its
forward there, so it is reported apart (``first_step_median_s``). Per round and method the median of its timed
steps; ``median_step_s`` is the median over rounds with a 95% percentile-bootstrap interval over rounds;
``ratio_to_gspo`` the median over rounds of the within-round ratio to GSPO, bootstrapped the same way. Garbage
collection (``--gc between-turns``, the default): after the warm-up the long-lived heap is frozen, and between turns
the collector runs untimed, as ``timeit`` keeps it out of what it times; collections a step triggers itself stay in
its time and are recorded (``gc_s`` per step). Every timed step is kept in the report (``steps``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import random
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from benchmarks.lib import common, stats, trainers  # noqa: E402
from benchmarks.lib.common import stop_process_group  # noqa: E402
from dfpo_trl import DFPOConfig, DFPOTrainer  # noqa: E402
from dfpo_trl.objectives.step import StepObjective  # noqa: E402

HERE = pathlib.Path(__file__).resolve()
METHODS = ("gspo", "pre_pass", "redistributed")
DFPO_METHODS = ("pre_pass", "redistributed")
TRANSFORM = "min_replace"
ROLLOUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
DEFAULT_ACCELERATE_CONFIG = ROOT / "recipes" / "accelerate" / "zero3_4gpu.yaml"
STARTED = time.time()


class LayoutUnavailable(RuntimeError):
    """This dfpo_trl cannot run a method (e.g. ``group_layout`` has not landed)."""


# ------------------------------------------------------------------------------------------ fixed rollout
def fixed_generation_batch(args: argparse.Namespace, vocab_size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One global generation batch (``per_device × processes × steps_per_generation`` rows, groups of G consecutive
    rows, as TRL's sampler lays them out): a random prompt per group, random completions of lengths between
    ``--min-completion-length`` and ``--completion-length`` (padded with the pad id), rewards 0/1 with both in every
    group, TRL's group-scaled advantages, and unit-variance draws for the old-log-prob shift (per row and per token;
    each phase scales them)."""
    g = torch.Generator().manual_seed(args.seed)
    rows = args.per_device * args.processes * args.steps_per_generation
    group_size = args.num_generations
    if rows % group_size:
        raise SystemExit(f"{rows} rows per generation batch is not a multiple of num_generations={group_size}")
    groups, length = rows // group_size, args.completion_length
    lengths = torch.randint(args.min_completion_length, length + 1, (rows,), generator=g)
    completion_mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    low, high = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size // 2)
    completion_ids = torch.randint(low, high, (rows, length), generator=g)
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, pad_id))
    prompt_ids = torch.randint(low, high, (groups, args.prompt_length), generator=g).repeat_interleave(group_size, 0)
    rewards = torch.randint(0, 2, (groups, group_size), generator=g).float()
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.reshape(-1),
        "row_shift": torch.randn(rows, 1, generator=g),
        "token_shift": torch.randn(rows, length, generator=g),
    }


def shift_of(batch: dict[str, torch.Tensor], row_scale: float) -> torch.Tensor:
    """log π_θ - log π_old per token: a per-row offset of std ``row_scale`` plus token noise of a fifth of it."""
    return row_scale * batch["row_shift"] + 0.2 * row_scale * batch["token_shift"]


class FixedRollout(GRPOTrainer):
    """TRL's rollout replaced by this process's slice of a fixed generation batch (no generation, no rewards).

    Sits *below* DFPOTrainer in the MRO of :class:`DFPOFixed`, so DFPO's rollout code (group and row ids, the
    redistribution) runs on it as it would on TRL's. Old log-probs: ``fixed_old_logps`` (global, e.g. the
    reference's) when set, else the model's at the rollout (TRL's no-grad forward) minus ``shift``."""

    fixed_batch: dict[str, torch.Tensor]
    fixed_old_logps: torch.Tensor | None = None
    shift: float = 0.0

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        from dfpo_trl.trl_hooks.compat import disable_gradient_checkpointing

        local = self.args.per_device_train_batch_size * self.args.steps_per_generation
        start = self.accelerator.process_index * local
        rows = slice(start, start + local)
        device = self.accelerator.device
        # TRL pads a process's completions to its own longest one: trim this slice's all-padding columns.
        width = int(self.fixed_batch["completion_mask"][rows].sum(1).max())
        batch = {key: self.fixed_batch[key][rows].to(device) for key in ROLLOUT_KEYS}
        for key in ("completion_ids", "completion_mask"):
            batch[key] = batch[key][:, :width]
        batch["num_items_in_batch"] = self.fixed_batch["completion_mask"].sum().to(device)
        if self.fixed_old_logps is not None:
            batch["old_per_token_logps"] = self.fixed_old_logps[rows, :width].to(device)
            return batch
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(  # one forward (an untimed step)
                self.model, ids, mask, batch["completion_ids"].size(1), batch_size=local,
            )
        shift = shift_of({k: self.fixed_batch[k][rows] for k in ("row_shift", "token_shift")}, self.shift)[:, :width]
        batch["old_per_token_logps"] = (logps.float() - shift.to(device)).detach()
        return batch


class DFPOFixed(DFPOTrainer, FixedRollout):
    """DFPOTrainer on the fixed rollout (MRO: DFPOTrainer's rollout wraps FixedRollout's, which replaces TRL's)."""


class DFPORecorder(DFPOFixed):
    """Also keeps the s̄, s̃ each micro-step's loss used (what its group layout's public ``row_weights`` returns),
    with the optimizer step they belong to."""

    records: list[dict[str, Any]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.used: list[Any] = []  # every micro-step's RowWeights, in order (the StepObjective's weights)
        self.objective_observers.append(
            lambda value: self.used.append(value.weights)
            if isinstance(value, StepObjective) and value.weights is not None else None
        )

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        before = len(self.used)
        loss = super()._compute_loss(model, inputs)
        if len(self.used) > before and self.model.training:
            weights = self.used[-1]
            step = self._step // self.args.gradient_accumulation_steps  # micro-step counter, before its increment
            self.records.append({
                "optimizer_step": step, "step_in_rollout": step % steps_per_rollout(self.args),
                "row_ids": inputs["row_ids"].detach().cpu(), "s_bar": weights.s_bar.detach().float().cpu(),
                "s_tilde": weights.s_tilde.detach().float().cpu(), "loss": float(loss.detach()),
            })
        return loss


def steps_per_rollout(config: Any) -> int:
    return config.steps_per_generation * getattr(config, "num_iterations", 1) // config.gradient_accumulation_steps


# ------------------------------------------------------------------------------------------ trainers
def layout_field_available() -> bool:
    return "group_layout" in DFPOConfig.__dataclass_fields__


def method_spec(name: str) -> tuple[type, type, dict[str, Any]]:
    """(trainer class, config class, overrides): TRL's GSPO, or DFPO Min-Replace with its layout forced."""
    if name == "gspo":
        trainer_cls, config_cls, overrides = trainers.trainer_and_config("gspo", baseline_trainer="trl")
        return (FixedRollout if trainer_cls is GRPOTrainer else trainer_cls), config_cls, overrides
    _, config_cls, overrides = trainers.trainer_and_config(TRANSFORM)
    if layout_field_available():
        overrides = {**overrides, "group_layout": name}
    elif name != "pre_pass":  # today's automatic choice for these sizes is pre_pass; nothing else can be forced
        raise LayoutUnavailable(
            f"DFPOConfig has no group_layout field, so the {name!r} layout cannot be requested (not landed yet)"
        )
    return DFPOFixed, config_cls, overrides


def trainer_config(
    args: argparse.Namespace, name: str, *, precision: str, learning_rate: float, max_steps: int,
    epsilon: tuple[float, float] | None = None,
) -> tuple[type, Any]:
    trainer_cls, config_cls, overrides = method_spec(name)
    on_cpu = args.device == "cpu"
    kwargs: dict[str, Any] = dict(
        output_dir=str(pathlib.Path(args.work_dir) / f"trainer-{name}"), seed=args.seed, max_steps=max_steps,
        per_device_train_batch_size=args.per_device, gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
        max_completion_length=args.completion_length, learning_rate=learning_rate, lr_scheduler_type="constant",
        beta=0.0, temperature=1.0, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=args.steps_per_generation // args.gradient_accumulation_steps,
        gradient_checkpointing=not args.no_gradient_checkpointing, use_cpu=on_cpu,
        bf16=precision == "bfloat16" and not on_cpu, model_init_kwargs={"dtype": precision},
    )
    if precision == "float32":
        kwargs["tf32"] = False  # full float32 matmuls, as the reference's
    kwargs.update(overrides)
    if epsilon is not None:
        kwargs.update(epsilon=epsilon[0], epsilon_high=epsilon[1])
    if name in DFPO_METHODS and args.prepass_batch_size is not None:
        if "prepass_batch_size" not in DFPOConfig.__dataclass_fields__:
            raise LayoutUnavailable("DFPOConfig has no prepass_batch_size field (not landed yet)")
        kwargs["prepass_batch_size"] = args.prepass_batch_size
    return trainer_cls, config_cls(**kwargs)


def share_deepspeed_plugin(config: Any) -> None:
    """Trainers after the first in one process: accelerate refuses a second Accelerator given its own DeepSpeed
    plugin, so reuse the first one's, and point transformers' ZeRO-3 init (``is_deepspeed_zero3_enabled``, read
    while the model loads) back at it: the config's own plugin had taken that global weak reference."""
    from accelerate.state import AcceleratorState

    if getattr(config, "deepspeed_plugin", None) is None or not AcceleratorState._shared_state:
        return
    if AcceleratorState().deepspeed_plugins is None:
        return
    config.deepspeed_plugin = None
    AcceleratorState().deepspeed_plugin.set_deepspeed_weakref()


def build_trainer(
    args: argparse.Namespace, name: str, tokenizer: Any, model_path: str, dataset_rows: int, **config_args: Any
) -> Any:
    from datasets import Dataset

    recorder = config_args.pop("recorder", False)
    trainer_cls, config = trainer_config(args, name, **config_args)
    if recorder:
        trainer_cls = DFPORecorder
    share_deepspeed_plugin(config)
    trainer = trainer_cls(
        model=model_path, reward_funcs=zero_reward, args=config,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * dataset_rows}), processing_class=tokenizer,
    )
    layout = getattr(trainer, "group_layout", "trl")
    if name in DFPO_METHODS and layout != name:
        raise LayoutUnavailable(f"asked for the {name!r} layout, the trainer chose {layout!r}")
    return trainer


def zero_reward(completions: list[Any], **_: Any) -> list[float]:
    return [0.0] * len(completions)


def all_ranks_max(value: float) -> float:
    """``max`` of a number over every process (1.0 where any rank says yes); the identity without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    from accelerate import PartialState

    tensor = torch.tensor([float(value)], device=PartialState().device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(message: str) -> None:
    """Print on the main process only, with the time since the process started."""
    if rank() == 0:
        print(f"[{time.time() - STARTED:6.1f} s] {message}", flush=True)


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def init_dir(args: argparse.Namespace) -> pathlib.Path:
    return pathlib.Path(args.work_dir) / f"init-{args.random_config}-seed{args.seed}"


def tokenizer_and_batch(args: argparse.Namespace) -> tuple[Any, dict[str, torch.Tensor]]:
    tokenizer = trainers.load_tokenizer(args.tokenizer or trainers.default_tokenizer_path())
    return tokenizer, fixed_generation_batch(args, len(tokenizer), tokenizer.pad_token_id)


# ------------------------------------------------------------------------------------------ phase: reference
def phase_reference(args: argparse.Namespace) -> None:
    """Random init (saved once, bf16 on disk so that every phase loads the very same values) and the
    single-process float32 s̄ / s̃ of every row of the fixed batch at those weights."""
    from transformers import AutoModelForCausalLM

    from dfpo_trl.objectives.transforms import get_transform
    from dfpo_trl.objectives.weights import sequence_log_ratio, sign_aware_post_clip

    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32, as the check's trainers (tf32=False)
    tokenizer, batch = tokenizer_and_batch(args)
    path = init_dir(args)
    started = time.time()
    if not (path / "config.json").exists():
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = trainers.build_model(None, args.random_config, tokenizer, dtype, device, args.seed)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        del model
        print(f"reference: saved a random {args.random_config} init to {path} ({time.time() - started:.0f} s)",
              flush=True)
    if args.init_only:
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    logps = []
    with torch.no_grad():
        for start in range(0, batch["prompt_ids"].size(0), args.reference_chunk):
            part = slice(start, start + args.reference_chunk)
            ids = torch.cat([batch["prompt_ids"][part], batch["completion_ids"][part]], 1).to(device)
            mask = torch.cat([batch["prompt_mask"][part], batch["completion_mask"][part]], 1).to(device)
            length = batch["completion_ids"].size(1)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -length - 1 : -1].float()
            completion = batch["completion_ids"][part].to(device)
            logps.append(torch.log_softmax(logits, -1).gather(-1, completion[..., None])[..., 0].cpu())
    logps = torch.cat(logps)
    old = logps - shift_of(batch, args.check_shift)
    rho = sequence_log_ratio(logps, old, batch["completion_mask"])
    s_bar = sign_aware_post_clip(rho.exp(), batch["advantages"], *args.check_epsilon)
    g = args.num_generations
    s_tilde = get_transform(TRANSFORM).apply(s_bar.view(-1, g), batch["advantages"].view(-1, g), 0.5, 1e-6).reshape(-1)
    torch.save({"old_per_token_logps": old, "s_bar": s_bar, "s_tilde": s_tilde, "epsilon": list(args.check_epsilon),
                "shift": args.check_shift, "rows": int(s_bar.numel())}, work / "reference.pt")
    print(f"reference: {s_bar.numel()} rows on {device}, s_bar in [{s_bar.min():.3f}, {s_bar.max():.3f}], the "
          f"transform changed {(s_tilde != s_bar).sum().item()} weights ({time.time() - started:.0f} s)", flush=True)


# ------------------------------------------------------------------------------------------ phase: check
def phase_check(args: argparse.Namespace) -> None:
    """Each DFPO layout trains one rollout at learning rate 0 on the reference's batch; every rank saves the s̄ / s̃
    of its micro-steps."""
    common.quiet()
    work = pathlib.Path(args.work_dir)
    reference = torch.load(work / "reference.pt")
    tokenizer, batch = tokenizer_and_batch(args)
    per_rollout = args.steps_per_generation // args.gradient_accumulation_steps
    for name in [m for m in args.methods if m in DFPO_METHODS]:
        started = time.time()
        result: dict[str, Any] = {"method": name}
        trainer = None
        try:
            trainer = build_trainer(
                args, name, tokenizer, str(init_dir(args)), 64 * per_rollout * args.steps_per_generation,
                precision="float32", learning_rate=args.check_learning_rate, max_steps=per_rollout,
                epsilon=tuple(args.check_epsilon),
                recorder=True,
            )
            trainer.fixed_batch = batch
            trainer.fixed_old_logps = reference["old_per_token_logps"]
            trainer.records = []
            trainer.train()
            plugin = trainer.accelerator.state.deepspeed_plugin
            result.update(layout=trainer.group_layout, records=trainer.records,
                          processes=trainer.accelerator.num_processes,
                          zero_stage=plugin.zero_stage if plugin is not None else 0,
                          device=common.device_name(args.device if args.device == "cpu" else "cuda"))
        except Exception as exc:  # noqa: BLE001 - recorded, the other layout still runs
            result["error"] = f"{type(exc).__name__}: {exc}"
            if rank() == 0:
                traceback.print_exc()
        result["seconds"] = round(time.time() - started, 1)
        torch.save(result, work / f"check_{name}_rank{rank()}.pt")
        say(f"check {name}: {result.get('error') or 'ok'} ({result['seconds']} s)")
        del trainer
        gc.collect()


def compare_check(args: argparse.Namespace) -> dict[str, Any]:
    """Every rank's records of the first off-policy optimizer step against the reference, by row id."""
    work = pathlib.Path(args.work_dir)
    if not (work / "reference.pt").exists():
        return {"coefficients_match_reference": False, "error": "no reference.pt (the reference phase did not run)"}
    reference = torch.load(work / "reference.pt")
    s_bar, s_tilde = reference["s_bar"], reference["s_tilde"]
    out: dict[str, Any] = {"tolerance": args.tolerance, "epsilon": reference["epsilon"],
                           "old_logp_row_shift_std": reference["shift"], "optimizer_step_in_rollout": 1,
                           "reference_s_bar_range": [float(s_bar.min()), float(s_bar.max())],
                           "reference_rows_changed_by_transform": int((s_tilde != s_bar).sum()), "layouts": {}}
    diffs = []
    for name in [m for m in args.methods if m in DFPO_METHODS]:
        paths = sorted(work.glob(f"check_{name}_rank*.pt"))
        entry: dict[str, Any] = {}
        if not paths:
            entry["error"] = "no check output"
        for path in paths:
            part = torch.load(path)
            if "error" in part:
                entry.setdefault("error", part["error"])
                continue
            entry["layout"] = part["layout"]
            for key in ("device", "processes", "zero_stage"):
                out.setdefault(key, part.get(key))
            for record in part["records"]:
                if record["step_in_rollout"] != 1:
                    continue
                ids = record["row_ids"]
                entry.setdefault("row_ids", []).extend(ids.tolist())
                entry["max_abs_diff_s_bar"] = max(entry.get("max_abs_diff_s_bar", 0.0),
                                                  float((record["s_bar"] - reference["s_bar"][ids]).abs().max()))
                entry["max_abs_diff_s_tilde"] = max(entry.get("max_abs_diff_s_tilde", 0.0),
                                                    float((record["s_tilde"] - reference["s_tilde"][ids]).abs().max()))
        rows = sorted(entry.pop("row_ids", []))
        expected = args.per_device * args.processes * args.gradient_accumulation_steps
        entry["rows_checked"] = len(rows)
        entry["rows_expected"] = expected
        entry["distinct_rows"] = len(set(rows))
        worst = max(entry.get("max_abs_diff_s_bar", float("inf")), entry.get("max_abs_diff_s_tilde", float("inf")))
        entry["match"] = "error" not in entry and len(set(rows)) == expected == len(rows) and worst < args.tolerance
        if "error" not in entry and rows:
            diffs.append(worst)
        out["layouts"][name] = entry
    out["max_abs_diff"] = max(diffs) if diffs else None
    out["coefficients_match_reference"] = bool(out["layouts"]) and all(e["match"] for e in out["layouts"].values())
    return out


# ------------------------------------------------------------------------------------------ phase: time
class Turns:
    """The baton: which trainer thread may run, and for how many optimizer steps. Only one runs at a time; the
    main thread hands out turns."""

    def __init__(self, names: list[str]) -> None:
        self.go = {name: threading.Event() for name in names}
        self.back = threading.Event()
        self.stop = False
        self.steps = 1
        self.label: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.finished: set[str] = set()

    def give(self, name: str, steps: int, timeout: float) -> bool:
        """Let ``name`` run ``steps`` optimizer steps; False if it did not hand back in ``timeout`` seconds."""
        self.steps = steps
        self.back.clear()
        self.go[name].set()
        return self.back.wait(timeout)

    def hand_back_and_wait(self, name: str) -> None:
        self.go[name].clear()
        self.back.set()
        self.go[name].wait()


class GCClock:
    """Seconds the garbage collector ran in this process (all generations), via ``gc.callbacks``."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


def align() -> None:
    """Every rank at the same point with its GPU idle: a one-float all-reduce, then a CUDA synchronise. A step's
    time then runs from all ranks starting to the slowest rank finishing it, what the job as a whole sees."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        dist.all_reduce(torch.zeros(1, device=device))
    synchronize()


class TurnCallback(TrainerCallback):
    """Times every optimizer step (all ranks aligned at both ends) and hands the baton back when the turn's steps
    are done."""

    def __init__(self, name: str, turns: Turns, per_rollout: int, gc_clock: GCClock) -> None:
        self.name, self.turns, self.per_rollout, self.gc_clock = name, turns, per_rollout, gc_clock
        self.records: list[dict[str, Any]] = []
        self._start = self._gc_start = 0.0
        self._in_turn = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        align()
        self._gc_start = self.gc_clock.total
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        align()
        seconds = time.perf_counter() - self._start
        step = state.global_step - 1
        self.records.append({**self.turns.label, "step": step, "step_in_rollout": step % self.per_rollout,
                             "seconds": seconds, "gc_s": round(self.gc_clock.total - self._gc_start, 6)})
        self._in_turn += 1
        if self._in_turn >= self.turns.steps:
            self._in_turn = 0
            self.turns.hand_back_and_wait(self.name)
            if self.turns.stop:
                control.should_training_stop = True
        return control


def phase_time(args: argparse.Namespace) -> None:
    common.quiet()
    work = pathlib.Path(args.work_dir)
    stop_at = args.stop_at or (time.time() + args.deadline_s)
    tokenizer, batch = tokenizer_and_batch(args)
    per_rollout = args.steps_per_generation // args.gradient_accumulation_steps
    steps_per_turn = args.steps_per_turn
    warmup_steps = per_rollout * args.warmup_rollouts
    max_steps = warmup_steps + steps_per_turn * args.rounds + per_rollout
    methods = list(args.methods)
    turns = Turns(methods)
    gc_clock = GCClock()
    trainers: dict[str, Any] = {}
    callbacks: dict[str, TurnCallback] = {}
    errors: dict[str, str] = {}
    build_s: dict[str, float] = {}
    for name in methods:
        started = time.time()
        error = None
        try:
            trainer = build_trainer(
                args, name, tokenizer, str(init_dir(args)), 4 * max_steps * args.steps_per_generation,
                precision=args.dtype, learning_rate=args.learning_rate, max_steps=max_steps,
            )
            trainer.fixed_batch = batch
            trainer.shift = args.shift
            callbacks[name] = TurnCallback(name, turns, per_rollout, gc_clock)
            trainer.add_callback(callbacks[name])
            trainers[name] = trainer
        except Exception as exc:  # noqa: BLE001 - that method is dropped, the others run
            error = f"{type(exc).__name__}: {exc}"
            if rank() == 0:
                traceback.print_exc()
        if all_ranks_max(1.0 if error else 0.0) > 0.5:
            errors[name] = error or "failed on another rank"
            trainers.pop(name, None)
        build_s[name] = round(time.time() - started, 1)
        say(f"time: built {name}: {errors.get(name, 'ok')} ({build_s[name]} s)")
    alive = [name for name in methods if name in trainers]
    device_index = torch.cuda.current_device() if torch.cuda.is_available() and args.device != "cpu" else None

    def run(name: str) -> None:
        if device_index is not None:
            torch.cuda.set_device(device_index)  # the current device is per thread
        turns.go[name].wait()
        try:
            if not turns.stop:
                trainers[name].train()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            turns.errors[name] = f"{type(exc).__name__}: {exc}"
            if rank() == 0:
                traceback.print_exc()
        finally:
            turns.finished.add(name)
            turns.back.set()

    threads = {name: threading.Thread(target=run, args=(name,), name=f"train-{name}", daemon=True) for name in alive}
    for thread in threads.values():
        thread.start()
    plugin = trainers[alive[0]].accelerator.state.deepspeed_plugin if alive else None
    result: dict[str, Any] = {
        "device": common.device_name(args.device if args.device == "cpu" else "cuda"),
        "versions": common.versions(), "processes": int(os.environ.get("WORLD_SIZE", "1")),
        "zero_stage": plugin.zero_stage if plugin is not None else 0, "dtype": args.dtype,
        "random_config": args.random_config, "steps_per_turn": steps_per_turn, "per_rollout": per_rollout,
        "warmup_steps": warmup_steps, "gc": args.gc,
        "layouts": {name: getattr(trainers[name], "group_layout", "trl") for name in alive},
        "build_s": build_s, "errors": errors, "rounds_done": 0, "complete": False,
    }

    def turn(name: str, label: dict[str, Any], steps: int) -> None:
        turns.label = label
        if name in turns.finished:
            return
        if args.gc == "between-turns":
            gc.collect()  # untimed: the collection of this turn's garbage does not land in the next method's step
        if not turns.give(name, steps, args.turn_timeout_s):
            save_timing(work, result, callbacks, f"{name} did not hand back within {args.turn_timeout_s} s")
            print(f"time: {name} hung in its turn; results so far saved, exiting", flush=True)
            os._exit(3)

    def drop_failed() -> None:
        for name in list(alive):
            failed = name in turns.errors or (name in turns.finished and not turns.stop)
            if all_ranks_max(1.0 if failed else 0.0) > 0.5:
                errors[name] = turns.errors.get(name, "failed on another rank")
                alive.remove(name)

    started = time.time()
    for name in list(alive):  # warm-up: engine creation, first rollouts, allocator
        turn(name, {"round": -1, "method": name}, warmup_steps)
    drop_failed()
    if args.gc == "between-turns":  # the long-lived heap (models, engines, trainers) out of every later collection
        gc.collect()
        gc.freeze()
    result["engines"] = {name: type(trainers[name].model_wrapped).__name__ for name in alive}
    say(f"time: warm-up done ({time.time() - started:.0f} s); layouts {result['layouts']}, engines "
        f"{result['engines']}")
    round_seconds: list[float] = []
    for r in range(args.rounds):
        longest = max(round_seconds, default=0.0)
        if all_ranks_max(1.0 if time.time() + 1.2 * longest > stop_at else 0.0) > 0.5 or not alive:
            break
        round_start = time.time()
        order = list(alive)
        random.Random(args.seed * 100_003 + r).shuffle(order)
        for name in order:
            turn(name, {"round": r, "method": name}, steps_per_turn)
        drop_failed()
        round_seconds.append(time.time() - round_start)
        result["rounds_done"] = r + 1
        result["errors"] = errors
        if rank() == 0:
            save_timing(work, result, callbacks)
        say(f"time: round {r} ({', '.join(order)}) {round_seconds[-1]:.1f} s")
    result["complete"] = result["rounds_done"] == args.rounds
    turns.stop = True
    for name in methods:  # every thread ends its train() (collective teardown), one at a time
        if name in threads and name not in turns.finished:
            turn(name, {"round": None, "method": name}, 1)
    for name, trainer in trainers.items():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result.setdefault("loss_finite", {})[name] = bool(losses) and all(
            v == v and abs(v) != float("inf") for v in losses)
    if torch.cuda.is_available() and args.device != "cpu":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["errors"] = {**errors, **{k: v for k, v in turns.errors.items() if k not in errors}}
    if rank() == 0:
        save_timing(work, result, callbacks)
    say(f"time: {result['rounds_done']} rounds in {time.time() - started:.0f} s")


def save_timing(work: pathlib.Path, result: dict[str, Any], callbacks: dict[str, TurnCallback], hung: str = "") -> None:
    data = {**result, "steps": {name: cb.records for name, cb in callbacks.items()}}
    if hung:
        data["hung"] = hung
    common.write_json(work / "timing.json", data)


# ------------------------------------------------------------------------------------------ phase: report
def per_round(steps: list[dict[str, Any]], off_policy: bool) -> dict[int, float]:
    """Median step time per timed round (off-policy steps, or the first step of each rollout)."""
    by_round: dict[int, list[float]] = {}
    for s in steps:
        if s.get("round") is None or s["round"] < 0 or (s["step_in_rollout"] != 0) != off_policy:
            continue
        by_round.setdefault(s["round"], []).append(s["seconds"])
    return {r: statistics.median(v) for r, v in by_round.items()}


def phase_report(args: argparse.Namespace) -> dict[str, Any]:
    work = pathlib.Path(args.work_dir)
    timing_path = work / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    if args.no_check:
        check: dict[str, Any] = {"coefficients_match_reference": None, "skipped": "--no-check", "layouts": {}}
    else:
        check = compare_check(args)
    report: dict[str, Any] = {
        "device": timing.get("device"), "gpus": timing.get("processes"), "zero_stage": timing.get("zero_stage"),
        "per_device_train_batch_size": args.per_device, "num_generations": args.num_generations,
        "steps_per_generation": args.steps_per_generation,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "completion_length": args.completion_length,
        "completion_length_range": [args.min_completion_length, args.completion_length],
        "prompt_length": args.prompt_length, "model": f"random-{args.random_config}", "dtype": args.dtype,
        "timed": "off-policy optimizer steps only (every optimizer step but the first of each rollout), from "
                 "on_step_begin to on_step_end, every rank aligned (all-reduce, CUDA synchronise) at both ends; "
                 "per round the median of a method's timed steps",
        "steps_per_turn": timing.get("steps_per_turn"), "gc": timing.get("gc"),
        "rounds": timing.get("rounds_done", 0), "complete": timing.get("complete", False),
        "layouts": timing.get("layouts", {}), "engines": timing.get("engines"),
        "loss_finite": timing.get("loss_finite", {}),
        "peak_memory_gb": timing.get("peak_memory_gb"), "versions": timing.get("versions"),
        "coefficients_match_reference": check["coefficients_match_reference"], "coefficient_check": check,
    }
    steps = timing.get("steps", {})
    base = per_round(steps.get("gspo", []), True)
    for name in METHODS:
        rounds = per_round(steps.get(name, []), True)
        first = per_round(steps.get(name, []), False)
        entry: dict[str, Any] = {"median_step_s": None, "interval_95": None, "ratio_to_gspo": None,
                                 "ratio_interval_95": None, "rounds": len(rounds)}
        if name in timing.get("errors", {}):
            entry["error"] = timing["errors"][name]
        if rounds:
            values = [rounds[r] for r in sorted(rounds)]
            entry.update(median_step_s=statistics.median(values), interval_95=stats.bootstrap_median(values),
                         round_median_s=values)
            shared = sorted(set(rounds) & set(base))
            if shared:
                ratios = [rounds[r] / base[r] for r in shared]
                entry.update(ratio_to_gspo=statistics.median(ratios), ratio_interval_95=stats.bootstrap_median(ratios))
        if first:
            entry["first_step_median_s"] = statistics.median(first.values())
        timed = [s for s in steps.get(name, []) if s.get("round") is not None and s["round"] >= 0]
        entry["gc_s_in_timed_steps"] = round(sum(s.get("gc_s", 0.0) for s in timed), 3)
        entry["steps"] = [{k: s[k] for k in ("round", "step_in_rollout", "seconds", "gc_s") if k in s} for s in timed]
        report[name] = entry
    common.write_json(pathlib.Path(args.out_dir) / "layouts.json", report)
    print_table(report)
    return report


def merge_reports(args: argparse.Namespace) -> dict[str, Any]:
    """One ``layouts.json`` from the JSONs of separate runs (e.g. ``--no-check`` and ``--no-time``): the coefficient
    check from a run that made one; the timing from the one timing run, or, with several of one setting on one
    machine, their rounds pooled (ratios to GSPO taken within each round, then bootstrapped over all rounds)."""
    reports = [(path, json.loads(pathlib.Path(path).read_text())) for path in args.merge]
    timed_path, merged = max(reports, key=lambda item: item[1].get("rounds") or 0)
    merged = dict(merged)
    timed = [(path, r) for path, r in reports if r.get("rounds")]
    if len(timed) > 1:  # several timing runs of one shape on one machine: pool their rounds
        shape = ("device", "gpus", "model", "per_device_train_batch_size", "num_generations", "steps_per_generation",
                 "gradient_accumulation_steps", "completion_length_range", "steps_per_turn", "gc")
        if any(r.get(key) != timed[0][1].get(key) for _, r in timed for key in shape):
            raise SystemExit("--merge: the timing runs differ in device, shape or turn design; pool only runs of one "
                             "setting")
        timed_path = ", ".join(path for path, _ in timed)
        rounds = {name: [t for _, r in timed for t in r[name]["round_median_s"]] for name in METHODS}
        merged["rounds"] = len(rounds["gspo"])
        for name in METHODS:
            ratios = [t / b for t, b in zip(rounds[name], rounds["gspo"], strict=True)]
            firsts = [r[name]["first_step_median_s"] for _, r in timed if r[name].get("first_step_median_s")]
            merged[name] = {
                **{k: v for k, v in merged[name].items() if k not in ("steps", "first_step_median_s")},
                "rounds": len(rounds[name]), "round_median_s": rounds[name],
                "median_step_s": statistics.median(rounds[name]), "interval_95": stats.bootstrap_median(rounds[name]),
                "ratio_to_gspo": statistics.median(ratios), "ratio_interval_95": stats.bootstrap_median(ratios),
                "round_ratio_to_gspo": ratios,
                "gc_s_in_timed_steps": round(sum(r[name].get("gc_s_in_timed_steps", 0.0) for _, r in timed), 3),
                "first_step_median_s_per_run": firsts,
                "runs": [{key: r[name].get(key) for key in ("rounds", "median_step_s", "ratio_to_gspo",
                                                            "ratio_interval_95")} for _, r in timed],
            }
        merged["steps_in_run_files"] = "every timed step: the 'steps' of each run's file in merged_from.timing"
    checked = [(path, r) for path, r in reports if r.get("coefficient_check", {}).get("layouts")]
    if checked:
        check_path, check = checked[0]
        merged["coefficients_match_reference"] = check["coefficients_match_reference"]
        merged["coefficient_check"] = check["coefficient_check"]
    else:
        check_path = None
    merged["merged_from"] = {"timing": timed_path, "coefficient_check": check_path}
    for key in ("stages", "wall_s", "command"):
        merged[key] = {path: r.get(key) for path, r in reports}
    common.write_json(pathlib.Path(args.out_dir) / "layouts.json", merged)
    if args.plot:
        plot_ratios(merged, pathlib.Path(args.plot))
    print_table(merged)
    return merged


def plot_ratios(report: dict[str, Any], path: pathlib.Path) -> None:
    """Each round's step time over GSPO's in the same round, per layout, with the median and its 95% interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    names = [name for name in METHODS if name != "gspo"]
    for x, name in enumerate(names):
        entry = report[name]
        rounds = [t / b for t, b in zip(entry["round_median_s"], report["gspo"]["round_median_s"], strict=True)]
        ax.scatter([x] * len(rounds), rounds, color="0.5", s=14, zorder=2, label="rounds" if x == 0 else None)
        low, high = entry["ratio_interval_95"]
        ax.errorbar([x + 0.12], [entry["ratio_to_gspo"]], yerr=[[entry["ratio_to_gspo"] - low],
                    [high - entry["ratio_to_gspo"]]], fmt="o", color="C0", capsize=4, zorder=3,
                    label="median, 95% interval" if x == 0 else None)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="C3", lw=0.8, ls="--", label="1.05 x GSPO")
    ax.set_xticks(range(len(names)), [f"Min-Replace\n{name}" for name in names])
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_ylabel("step time / TRL GSPO (same round)")
    ax.set_title(f"{report['gpus']} x {report['device']}, ZeRO-{report['zero_stage']}, {report['model']}, "
                 f"{report['rounds']} rounds", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def print_table(report: dict[str, Any]) -> None:
    def fmt(value: Any, spec: str) -> str:
        width = int(spec.split(".")[0] or 0)
        return format(value, spec) if isinstance(value, (int, float)) else "-".rjust(width)

    lo, hi = report["completion_length_range"]
    check = report["coefficient_check"]
    device = report["device"] or check.get("device")
    gpus = report["gpus"] or check.get("processes")
    zero = report["zero_stage"] if report["zero_stage"] is not None else check.get("zero_stage")
    print(f"\n{device}: {gpus} processes, ZeRO-{zero}, {report['model']} "
          f"{report['dtype']}, per-device {report['per_device_train_batch_size']}, G {report['num_generations']}, "
          f"spg {report['steps_per_generation']}, accumulation {report['gradient_accumulation_steps']}, completions "
          f"{lo}-{hi} tokens; {report['rounds']} rounds, off-policy optimizer steps")
    print(f"{'method':15s} {'layout':15s} {'median s':>9s}  {'95% interval':17s} {'ratio':>6s}  95% interval")
    for name in METHODS:
        e = report[name]
        interval = e["interval_95"] or [None, None]
        ratio_interval = e["ratio_interval_95"] or [None, None]
        print(f"{name:15s} {report['layouts'].get(name, '-'):15s} {fmt(e['median_step_s'], '9.3f')}  "
              f"[{fmt(interval[0], '.3f')}, {fmt(interval[1], '.3f')}]".ljust(61)
              + f"{fmt(e['ratio_to_gspo'], '6.3f')}  [{fmt(ratio_interval[0], '.3f')}, {fmt(ratio_interval[1], '.3f')}]"
              + (f"  error: {e['error'][:80]}" if e.get("error") else ""))
    per_layout = "; ".join(
        f"{k}: {v.get('rows_checked', 0)}/{v.get('rows_expected', '?')} rows"
        + (f", error {v['error'][:60]}" if v.get("error") else "") for k, v in check.get("layouts", {}).items())
    if check.get("skipped"):
        print(f"coefficients_match_reference: not checked ({check['skipped']})")
        return
    print(f"coefficients_match_reference: {report['coefficients_match_reference']} (max |diff| "
          f"{fmt(check.get('max_abs_diff'), '.2e')}, tolerance {check.get('tolerance')}; {per_layout})")


# ------------------------------------------------------------------------------------------ phase: all
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase_args(args: argparse.Namespace, phase: str, *extra: str) -> list[str]:
    """This script's command line for ``phase``, every shape argument passed on explicitly."""
    out = [str(HERE), "--phase", phase, "--work-dir", args.work_dir, "--device", args.device,
           "--random-config", args.random_config, "--dtype", args.dtype, "--seed", str(args.seed),
           "--processes", str(args.processes), "--per-device", str(args.per_device),
           "--num-generations", str(args.num_generations), "--steps-per-generation", str(args.steps_per_generation),
           "--gradient-accumulation-steps", str(args.gradient_accumulation_steps),
           "--prompt-length", str(args.prompt_length), "--completion-length", str(args.completion_length),
           "--min-completion-length", str(args.min_completion_length), "--rounds", str(args.rounds),
           "--steps-per-turn", str(args.steps_per_turn), "--warmup-rollouts", str(args.warmup_rollouts),
           "--gc", args.gc,
           "--learning-rate", str(args.learning_rate), "--shift", str(args.shift),
           "--check-shift", str(args.check_shift), "--check-epsilon", *map(str, args.check_epsilon),
           "--check-learning-rate", str(args.check_learning_rate),
           "--turn-timeout-s", str(args.turn_timeout_s), "--methods", *args.methods]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    if args.prepass_batch_size is not None:
        out += ["--prepass-batch-size", str(args.prepass_batch_size)]
    if args.no_gradient_checkpointing:
        out.append("--no-gradient-checkpointing")
    return out + list(extra)


def launcher(args: argparse.Namespace) -> list[str]:
    if args.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(args.accelerate_config),
            "--num_processes", str(args.processes), "--main_process_port", str(free_port())]


def run_logged(command: list[str], log: Any, timeout: float, env: dict[str, str]) -> int:
    """Run ``command`` in its own process group with output to ``log``; kill the group after ``timeout`` s."""
    log.write(f"\n$ {shlex.join(command)}\n")
    log.flush()
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        stop_process_group(proc)
        log.write(f"[killed after {timeout:.0f} s]\n")
        return -9


def phase_all(args: argparse.Namespace) -> None:
    start = time.time()
    deadline = start + args.deadline_s
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    for stale in [*work.glob("check_*_rank*.pt"), work / "timing.json"]:
        stale.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if args.device == "cpu":
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log_path = out / "layouts.log"
    stages = []
    with log_path.open("w") as log:
        # (phase, share of the time left it may take): the reference and the check are bounded so that the
        # timing always gets most of the budget; the timing stops starting rounds before its own end.
        phases = [("reference", 0.25), ("check", 0.45), ("time", 1.0)]
        phases = [(phase, share) for phase, share in phases
                  if not (phase == "check" and args.no_check) and not (phase == "time" and args.no_time)]
        for index, (phase, share) in enumerate(phases):
            share = 1.0 if index == len(phases) - 1 else share  # the last stage may use all that is left
            left = deadline - time.time() - args.report_margin_s
            if phase == "reference":
                command = [sys.executable, *phase_args(args, "reference", *(["--init-only"] if args.no_check else []))]
            elif phase == "check":
                command = [*launcher(args), *phase_args(args, "check")]
            else:
                stop_at = time.time() + left - args.teardown_margin_s
                command = [*launcher(args), *phase_args(args, "time", "--stop-at", f"{stop_at:.0f}")]
            stage_start = time.time()
            code = run_logged(command, log, share * left, env)
            stages.append({"phase": phase, "returncode": code, "seconds": round(time.time() - stage_start, 1)})
            print(f"{phase}: exit {code} after {stages[-1]['seconds']} s (log: {log_path})", flush=True)
    report = phase_report(args)
    report["stages"] = stages
    report["wall_s"] = round(time.time() - start, 1)
    report["command"] = shlex.join([sys.executable, *sys.argv])
    common.write_json(out / "layouts.json", report)
    if any(s["returncode"] != 0 for s in stages):
        tail = log_path.read_text().splitlines()[-40:]
        print("\nlast lines of the log:\n" + "\n".join(tail))
        print_table(report)  # the table stays the last thing printed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", default="all", choices=("all", "reference", "check", "time", "report"))
    p.add_argument("--merge", nargs="+", default=None, metavar="LAYOUTS_JSON",
                   help="instead of a phase: merge the layouts.json of separate runs into --out-dir/layouts.json")
    p.add_argument("--plot", default=None, help="--merge: also draw the per-round ratios to this PNG")
    p.add_argument("--work-dir", default="/tmp/dfpo-layouts")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--launcher", default=None, choices=("accelerate", "torchrun"),
                   help="phase all: how check/time are launched (default: accelerate on cuda, torchrun on cpu)")
    p.add_argument("--accelerate-config", default=str(DEFAULT_ACCELERATE_CONFIG))
    p.add_argument("--random-config", default="qwen3-1.7b", choices=trainers.RANDOM_CONFIGS)
    p.add_argument("--tokenizer", default=None, help="default: the kit's SmolLM2 (trainers.default_tokenizer_path)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="precision of the timed trainers (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--per-device", type=int, default=1)
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--steps-per-generation", type=int, default=16)
    p.add_argument("--gradient-accumulation-steps", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--completion-length", type=int, default=384)
    p.add_argument("--min-completion-length", type=int, default=256)
    p.add_argument("--rounds", type=int, default=400, help="at most; the deadline may stop earlier")
    p.add_argument("--steps-per-turn", type=int, default=1,
                   help="optimizer steps a method runs per turn (a round is one turn of each method)")
    p.add_argument("--warmup-rollouts", type=int, default=1, help="untimed rollouts per method before round 0")
    p.add_argument("--gc", default="between-turns", choices=("between-turns", "as-is"),
                   help="between-turns: freeze the heap after the warm-up and collect between turns (untimed), as "
                        "timeit keeps the collector out of what it times; as-is: Python's collector untouched")
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--shift", type=float, default=3e-4, help="timing: std of the per-row old-log-prob offset")
    p.add_argument("--prepass-batch-size", type=int, default=None, help="DFPOConfig.prepass_batch_size (default: None)")
    p.add_argument("--check-shift", type=float, default=0.15, help="check: std of the per-row old-log-prob offset")
    p.add_argument("--check-epsilon", type=float, nargs=2, default=[0.2, 0.28])
    p.add_argument("--check-learning-rate", type=float, default=1e-30,
                   help="check: so small that every float32 update rounds off (DFPOConfig refuses 0)")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--reference-chunk", type=int, default=8)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true", help="phase all: skip the coefficient check")
    p.add_argument("--no-time", action="store_true", help="phase all: skip the timing")
    p.add_argument("--init-only", action="store_true", help="phase reference: only save the random init")
    p.add_argument("--deadline-s", type=float, default=510.0, help="phase all: everything ends within this")
    p.add_argument("--stop-at", type=float, default=None, help="phase time: no round starts after this epoch time")
    p.add_argument("--report-margin-s", type=float, default=15.0)
    p.add_argument("--teardown-margin-s", type=float, default=45.0)
    p.add_argument("--turn-timeout-s", type=float, default=300.0, help="a turn longer than this counts as a hang")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.launcher = args.launcher or ("torchrun" if args.device == "cpu" else "accelerate")
    if args.steps_per_generation % args.gradient_accumulation_steps:
        p.error("--steps-per-generation must be a multiple of --gradient-accumulation-steps")
    if args.steps_per_generation // args.gradient_accumulation_steps < 2:
        p.error("one rollout needs at least two optimizer steps (an off-policy one to time and check)")
    if "gspo" not in args.methods and args.phase in ("all", "time"):
        p.error("--methods must include gspo (the ratios are taken to it)")
    return args


def main() -> None:
    args = parse_args()
    if args.merge:
        merge_reports(args)
        return
    if args.phase in ("check", "time"):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != args.processes:
            raise SystemExit(f"launched with {world} processes, --processes says {args.processes}")
    {"all": phase_all, "reference": phase_reference, "check": phase_check, "time": phase_time,
     "report": phase_report}[args.phase](args)


if __name__ == "__main__":
    main()
