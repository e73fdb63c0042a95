"""The layouts job's work on the processes (``dfpo_bench.launch.layouts`` has the design and the command): the random
init, the fixed rollout, the three trainers, and their optimizer steps taken in turns on threads that hand a baton
over at step boundaries.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import random
import threading
import time
import traceback
from typing import Any

import torch
from dfpo_trl import DFPOTrainer
from transformers import TrainerCallback
from trl import GRPOTrainer

from dfpo_bench.lib import common, trainers
from dfpo_bench.lib.timing import synchronize

METHODS = ("gspo", "pre_pass", "redistributed")
ROLLOUT_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")
STARTED = time.time()


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def say(message: str) -> None:
    """Print on the main process only, with the time since the process started."""
    if rank() == 0:
        print(f"[{time.time() - STARTED:6.1f} s] {message}", flush=True)


def init_dir(args: argparse.Namespace) -> pathlib.Path:
    return pathlib.Path(args.work_dir) / f"init-{args.random_config}-seed{args.seed}"


def save_init(args: argparse.Namespace) -> None:
    """The random init, saved once (bf16 on a GPU) so that every trainer of every process loads the same values."""
    path = init_dir(args)
    if (path / "config.json").exists():
        return
    tokenizer = trainers.load_tokenizer(args.tokenizer or trainers.default_tokenizer_path())
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    trainers.build_model(None, args.random_config, tokenizer, dtype, device, args.seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"saved a random {args.random_config} init to {path}", flush=True)


def fixed_generation_batch(args: argparse.Namespace, vocab_size: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One global generation batch in groups of G consecutive rows, as TRL's sampler lays them out: random prompts and
    completions, 0/1 rewards with both in every group, TRL's advantages, and draws for the old-log-prob shift."""
    g = torch.Generator().manual_seed(args.seed)
    rows = args.per_device * args.processes * args.steps_per_generation
    group_size, length = args.num_generations, args.completion_length
    if rows % group_size:
        raise SystemExit(f"{rows} rows per generation batch is not a multiple of num_generations={group_size}")
    lengths = torch.randint(args.min_completion_length, length + 1, (rows,), generator=g)
    completion_mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    low, high = min(100, vocab_size // 4), max(vocab_size - 100, vocab_size // 2)
    completion_ids = torch.randint(low, high, (rows, length), generator=g).masked_fill(completion_mask == 0, pad_id)
    groups = rows // group_size
    prompt_ids = torch.randint(low, high, (groups, args.prompt_length), generator=g).repeat_interleave(group_size, 0)
    rewards = torch.randint(0, 2, (groups, group_size), generator=g).float()
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    return {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages.reshape(-1),
            "row_shift": torch.randn(rows, 1, generator=g), "token_shift": torch.randn(rows, length, generator=g)}


class FixedRollout(GRPOTrainer):
    """TRL's rollout replaced by this process's slice of the fixed batch, old log-probs the model's at the rollout
    (TRL's no-grad forward) minus a per-row offset of std ``shift`` plus token noise of a fifth of it. It sits below
    DFPOTrainer in :class:`DFPOFixed`'s MRO, so DFPO's rollout code (ids, the redistribution) runs as on TRL's."""

    fixed_batch: dict[str, torch.Tensor]
    shift: float = 0.0

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        from trl.models.utils import disable_gradient_checkpointing

        local = self.args.per_device_train_batch_size * self.args.steps_per_generation
        rows = slice(self.accelerator.process_index * local, (self.accelerator.process_index + 1) * local)
        device, fixed = self.accelerator.device, self.fixed_batch
        width = int(fixed["completion_mask"][rows].sum(1).max())  # TRL pads a process's completions to its longest
        batch = {key: fixed[key][rows].to(device) for key in ROLLOUT_KEYS}
        for key in ("completion_ids", "completion_mask"):
            batch[key] = batch[key][:, :width]
        batch["num_items_in_batch"] = fixed["completion_mask"].sum().to(device)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask, width, batch_size=local)
        shift = self.shift * (fixed["row_shift"][rows] + 0.2 * fixed["token_shift"][rows])[:, :width]
        batch["old_per_token_logps"] = (logps.float() - shift.to(device)).detach()
        return batch


class DFPOFixed(DFPOTrainer, FixedRollout):
    """DFPOTrainer on the fixed rollout."""


def build_trainer(args: argparse.Namespace, name: str, tokenizer: Any, max_steps: int) -> Any:
    """TRL's GRPOTrainer with GSPO's settings (``gspo``), or DFPO Min-Replace forced to the layout ``name``. Every
    trainer after the first shares the first one's DeepSpeed plugin: accelerate refuses a second Accelerator given
    its own, and transformers' ZeRO-3 init must point at the shared one while the model loads."""
    from accelerate.state import AcceleratorState
    from datasets import Dataset

    gspo = name == "gspo"
    trainer_cls, config_cls, overrides = trainers.trainer_and_config("gspo" if gspo else "min_replace")
    config = config_cls(
        output_dir=str(pathlib.Path(args.work_dir) / f"trainer-{name}"), seed=args.seed, max_steps=max_steps,
        per_device_train_batch_size=args.per_device, gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=args.num_generations, steps_per_generation=args.steps_per_generation,
        max_completion_length=args.completion_length, learning_rate=args.learning_rate, lr_scheduler_type="constant",
        beta=0.0, temperature=1.0, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=args.steps_per_generation // args.gradient_accumulation_steps,
        gradient_checkpointing=not args.no_gradient_checkpointing, use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16" and args.device != "cpu", model_init_kwargs={"dtype": args.dtype},
        **({"tf32": False} if args.dtype == "float32" else {}), **overrides, **({} if gspo else {"group_layout": name}),
    )
    if getattr(config, "deepspeed_plugin", None) is not None and AcceleratorState._shared_state \
            and AcceleratorState().deepspeed_plugins is not None:
        config.deepspeed_plugin = None
        AcceleratorState().deepspeed_plugin.set_deepspeed_weakref()
    cls = FixedRollout if trainer_cls is GRPOTrainer else DFPOFixed
    prompts = Dataset.from_dict({"prompt": ["x"] * (4 * max_steps * args.steps_per_generation)})
    trainer = cls(model=str(init_dir(args)), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                  args=config, train_dataset=prompts, processing_class=tokenizer)
    if not gspo and trainer.group_layout != name:
        raise RuntimeError(f"asked for the {name!r} layout, the trainer chose {trainer.group_layout!r}")
    return trainer


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any process (a MAX all-reduce), so that every rank takes the same branch."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    from accelerate import PartialState

    tensor = torch.tensor([float(flag)], device=PartialState().device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item() > 0.5


def align() -> None:
    """Every rank at the same point with its GPU idle (a one-float all-reduce, then a CUDA synchronise): a step then
    runs from all ranks starting to the slowest finishing, what the job as a whole sees."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        dist.all_reduce(torch.zeros(1, device=device))
    synchronize()


class Turns:
    """The baton: which trainer thread may run, and for how many optimizer steps; the main thread hands out turns."""

    def __init__(self, names: list[str]) -> None:
        self.go = {name: threading.Event() for name in names}
        self.back = threading.Event()
        self.stop, self.steps, self.label = False, 1, {}
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
        self.total, self._start = 0.0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


class TurnCallback(TrainerCallback):
    """Times every optimizer step (all ranks aligned at both ends) and hands the baton back after the turn's steps."""

    def __init__(self, name: str, turns: Turns, per_rollout: int, gc_clock: GCClock) -> None:
        self.name, self.turns, self.per_rollout, self.gc_clock = name, turns, per_rollout, gc_clock
        self.records: list[dict[str, Any]] = []
        self._start, self._gc_start, self._in_turn = 0.0, 0.0, 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        align()
        self._gc_start, self._start = self.gc_clock.total, time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        align()
        seconds, step = time.perf_counter() - self._start, state.global_step - 1
        self.records.append({**self.turns.label, "step": step, "step_in_rollout": step % self.per_rollout,
                             "seconds": seconds, "gc_s": round(self.gc_clock.total - self._gc_start, 6)})
        self._in_turn += 1
        if self._in_turn >= self.turns.steps:
            self._in_turn = 0
            self.turns.hand_back_and_wait(self.name)
            control.should_training_stop = self.turns.stop
        return control


def phase_time(args: argparse.Namespace) -> None:
    """The three trainers in this process, one thread each, taking turns; every round saved to ``timing.json``."""
    common.quiet()
    stop_at = args.stop_at or (time.time() + args.deadline_s)
    tokenizer = trainers.load_tokenizer(args.tokenizer or trainers.default_tokenizer_path())
    batch = fixed_generation_batch(args, len(tokenizer), tokenizer.pad_token_id)
    per_rollout = args.steps_per_generation // args.gradient_accumulation_steps
    warmup_steps = per_rollout * args.warmup_rollouts
    max_steps = warmup_steps + args.steps_per_turn * args.rounds + per_rollout
    turns, gc_clock = Turns(list(args.methods)), GCClock()
    built: dict[str, Any] = {}
    callbacks: dict[str, TurnCallback] = {}
    errors: dict[str, str] = {}
    build_s: dict[str, float] = {}
    for name in args.methods:
        started, error = time.time(), None
        try:
            trainer = build_trainer(args, name, tokenizer, max_steps)
            trainer.fixed_batch, trainer.shift = batch, args.shift
            callbacks[name] = TurnCallback(name, turns, per_rollout, gc_clock)
            trainer.add_callback(callbacks[name])
            built[name] = trainer
        except Exception as exc:  # noqa: BLE001 - that method is dropped, the others run
            error = f"{type(exc).__name__}: {exc}"
            if rank() == 0:
                traceback.print_exc()
        if any_rank(bool(error)):
            errors[name] = error or "failed on another rank"
            built.pop(name, None)
        build_s[name] = round(time.time() - started, 1)
        say(f"time: built {name}: {errors.get(name, 'ok')} ({build_s[name]} s)")
    alive = [name for name in args.methods if name in built]
    device_index = torch.cuda.current_device() if torch.cuda.is_available() and args.device != "cpu" else None

    def run(name: str) -> None:
        if device_index is not None:
            torch.cuda.set_device(device_index)  # the current device is per thread
        turns.go[name].wait()
        try:
            if not turns.stop:
                built[name].train()
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
    plugin = built[alive[0]].accelerator.state.deepspeed_plugin if alive else None
    result: dict[str, Any] = {
        "device": common.device_name(args.device if args.device == "cpu" else "cuda"), "versions": common.versions(),
        "processes": int(os.environ.get("WORLD_SIZE", "1")), "zero_stage": plugin.zero_stage if plugin else 0,
        "dtype": args.dtype, "random_config": args.random_config, "steps_per_turn": args.steps_per_turn,
        "per_rollout": per_rollout, "warmup_steps": warmup_steps, "gc": args.gc,
        "layouts": {name: getattr(built[name], "group_layout", "trl") for name in alive},
        "build_s": build_s, "errors": errors, "rounds_done": 0, "complete": False,
    }

    def save(hung: str = "") -> None:
        data = {**result, "steps": {name: cb.records for name, cb in callbacks.items()}}
        common.write_json(pathlib.Path(args.work_dir) / "timing.json", {**data, "hung": hung} if hung else data)

    def turn(name: str, label: dict[str, Any], steps: int) -> None:
        turns.label = label
        if name in turns.finished:
            return
        if args.gc == "between-turns":
            gc.collect()  # untimed: this turn's garbage is not collected in the next method's step
        if not turns.give(name, steps, args.turn_timeout_s):
            save(f"{name} did not hand back within {args.turn_timeout_s} s")
            print(f"time: {name} hung in its turn; results so far saved, exiting", flush=True)
            os._exit(3)

    def drop_failed() -> None:
        for name in list(alive):
            if any_rank(name in turns.errors or (name in turns.finished and not turns.stop)):
                errors[name] = turns.errors.get(name, "failed on another rank")
                alive.remove(name)

    started = time.time()
    for name in list(alive):  # warm-up: engine creation, first rollouts, allocator
        turn(name, {"round": -1, "method": name}, warmup_steps)
    drop_failed()
    if args.gc == "between-turns":  # the long-lived heap (models, engines, trainers) out of every later collection
        gc.collect()
        gc.freeze()
    result["engines"] = {name: type(built[name].model_wrapped).__name__ for name in alive}
    say(f"time: warm-up done ({time.time() - started:.0f} s); layouts {result['layouts']}")
    round_seconds: list[float] = []
    for r in range(args.rounds):
        if any_rank(time.time() + 1.2 * max(round_seconds, default=0.0) > stop_at) or not alive:
            break
        round_start, order = time.time(), list(alive)
        random.Random(args.seed * 100_003 + r).shuffle(order)  # the same order on every rank
        for name in order:
            turn(name, {"round": r, "method": name}, args.steps_per_turn)
        drop_failed()
        round_seconds.append(time.time() - round_start)
        result.update(rounds_done=r + 1, errors=errors)
        if rank() == 0:
            save()
        say(f"time: round {r} ({', '.join(order)}) {round_seconds[-1]:.1f} s")
    result["complete"] = result["rounds_done"] == args.rounds
    turns.stop = True
    for name in threads:  # every unfinished thread ends its train() (collective teardown), one at a time
        turn(name, {"round": None, "method": name}, 1)
    for name, trainer in built.items():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result.setdefault("loss_finite", {})[name] = bool(losses) and all(abs(v) < float("inf") for v in losses)
    if torch.cuda.is_available() and args.device != "cpu":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["errors"] = {**errors, **{k: v for k, v in turns.errors.items() if k not in errors}}
    if rank() == 0:
        save()
    say(f"time: {result['rounds_done']} rounds in {time.time() - started:.0f} s")
