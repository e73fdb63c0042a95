"""The layouts study's ``time`` phase: the three trainers in one process, interleaved turn by turn on threads that
hand a baton over at optimizer-step boundaries; run through ``layouts.py``, whose docstring has the design.
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

ROOT = pathlib.Path(__file__).resolve().parents[3]

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from dfpo_bench.launch.layouts_setup import (  # noqa: E402
    all_ranks_max,
    build_trainer,
    init_dir,
    rank,
    say,
    synchronize,
    tokenizer_and_batch,
)
from dfpo_bench.lib import common  # noqa: E402


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
