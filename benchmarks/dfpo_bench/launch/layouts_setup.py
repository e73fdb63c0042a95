"""The layouts study's fixed rollout and trainers (TRL's GSPO, DFPO in the ``pre_pass`` and ``redistributed``
layouts) and its ``reference`` and ``check`` phases; run through ``layouts.py``, whose docstring has the design.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import time
import traceback
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]

import torch  # noqa: E402
from dfpo_trl import DFPOConfig, DFPOTrainer  # noqa: E402
from dfpo_trl.testing import record_row_weights  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from dfpo_bench.lib import common, trainers  # noqa: E402

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
        from trl.models.utils import disable_gradient_checkpointing

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
        self.used: list[Any] = record_row_weights(self)  # every micro-step's RowWeights, in order (tests/tiny.py)

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

    from dfpo_bench.lib.exactness import reference_weights

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
    s_bar, s_tilde = reference_weights(logps, old, batch["completion_mask"], batch["advantages"],
                                       args.num_generations, tuple(args.check_epsilon), TRANSFORM)
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
