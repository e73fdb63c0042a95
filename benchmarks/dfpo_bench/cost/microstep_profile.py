"""What DFPO adds to one non-generating training micro-step, in milliseconds: wall time, a profile by part, host syncs.

Four methods on one device, each a persistent trainer on its own copy of the model, driven micro-step by micro-step
as transformers' loop drives them (``training_step``, then the optimizer step and, at a logging step, ``log``):
TRL's ``GRPOTrainer`` with GSPO's settings (``trl``), ``DFPOTrainer`` with every DFPO option off (``dfpo_off``),
Min-Replace (``min_replace``) and Min-Replace without the mechanism metrics (``min_replace_nometrics``). The shape
is ``recipes/smollm2_gpu_vllm.yaml``'s (32 rows a micro-step, G = 8, one optimizer step a micro-step, a rollout
every 4 micro-steps, 32 completion tokens, bf16 autocast over float32 weights, ``logging_steps`` 1) with
transformers' generation instead of vLLM (so TRL's vLLM importance-sampling ratio is not applied) and
``min_new_tokens`` = ``max_completion_length`` (every method trains on tensors of one shape). Only micro-steps that
do not generate are measured.

1. Wall time: rounds of (every method, shuffled order, ``--cycles`` rollouts each); per round the median time of
   each method's non-generating micro-steps, its ratio to ``trl`` in the same round, and a percentile-bootstrap
   interval of the median ratio over rounds. Three parts are timed apart: ``training_step`` (CUDA synchronised
   before and after), ``log`` at logging steps (with the loop's read of the loss), and the optimizer step.
2. Profile: DFPO's parts carry the library's own ``torch.profiler.record_function`` labels
   (``dfpo_trl.testing.measures.PROFILE_LABELS``, ``dfpo/...``), and TRL's matching methods are wrapped here, while
   profiling, in labels of their own (``trl.<method>``); ``torch.profiler`` (CPU and CUDA activities) runs over
   ``--profile-cycles`` rollouts' non-generating micro-steps per method. Per label and micro-step: calls, inclusive
   CPU ms, self CPU ms (the time no deeper label covers), and the CUDA kernels (count, ms) launched under it and
   under no deeper label. DFPO's added time is the sum of the DFPO labels' self times; "TRL's own _compute_loss
   minus DFPO's parts" is ``trl._compute_loss``'s inclusive time minus the DFPO self time nested in it. ``torch_ops``:
   the torch operators called while a label is the innermost one (each a kernel launch or more on the GPU).
3. Host syncs per micro-step, at logging steps and at steps that do not log: every host read of a tensor
   (``item``, ``tolist``, ``float``/``int``/``bool``) and every tensor made from host data on a named device
   (``torch.tensor(x, device=...)``, a blocking copy on CUDA) by dfpo_trl code, and on CUDA every synchronising
   CUDA call (``torch.cuda.set_sync_debug_mode``), by the source line that made it (dfpo_trl's counted apart).

    # on the GPU machine (under 4 minutes on an H100)
    python -m dfpo_bench.cost.microstep_profile --model /root/models/smollm2-135m-instruct --out-dir $OUT
    # CPU check of the pipeline (under a minute)
    python -m dfpo_bench.cost.microstep_profile --random-config tiny --rounds 2 --out-dir /tmp/mp

Writes ``microstep_profile_<tag>.json`` (``write_json``) and prints a short table last.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[3]

import torch  # noqa: E402

from dfpo_bench.cost.microstep_parts import count_syncs, profile_methods  # noqa: E402
from dfpo_bench.lib import common, provenance, stats, trainers  # noqa: E402

BASELINE = "trl"
METHOD_NAMES = (BASELINE, "dfpo_off", "min_replace", "min_replace_nometrics")
# recipes/smollm2_gpu_vllm.yaml's shape (gradient_accumulation_steps 1), and the CPU check's
RECIPE_SHAPE = {"batch": 32, "group_size": 8, "steps_per_generation": 4, "completion_length": 32}
CPU_SHAPE = {"batch": 4, "group_size": 2, "steps_per_generation": 2, "completion_length": 4}


# ------------------------------------------------------------------------------------------------ trainers
def method_config(name: str, energy_buckets: int) -> tuple[type, type, dict[str, Any]]:
    """(trainer class, config class, overrides) of one profiled method."""
    if name == BASELINE:
        return trainers.trainer_and_config("gspo", baseline_trainer="trl")
    if name == "dfpo_off":
        return trainers.DFPOTrainer, trainers.DFPOConfig, dict(trainers.GSPO)
    _, _, overrides = trainers.trainer_and_config("min_replace")
    overrides["log_energy_buckets"] = energy_buckets
    if name == "min_replace_nometrics":
        overrides["log_mechanism_metrics"] = False
    return trainers.DFPOTrainer, trainers.DFPOConfig, overrides


@dataclass
class Runner:
    """One method's trainer driven micro-step by micro-step as transformers' training loop drives it."""

    name: str
    trainer: Any
    batches: Iterator[Any]
    sync: Callable[[], None]
    times: dict[str, list[float]] = field(default_factory=lambda: {"training_step": [], "log": [], "optimizer": []})

    def generates_next(self) -> bool:
        """Whether the next micro-step generates a rollout (TRL's ``_prepare_inputs`` condition)."""
        t = self.trainer
        return t._buffered_inputs is None or t._step % (t.args.steps_per_generation * t.num_iterations) == 0

    def ends_optimizer_step(self) -> bool:
        """Whether the next micro-step is the last of its optimizer step (the loop then steps the optimizer)."""
        return (self.trainer._step + 1) % self.trainer.args.gradient_accumulation_steps == 0

    def is_logging_step(self) -> bool:
        """transformers' rule: log after the optimizer step whose number is a multiple of ``logging_steps``."""
        t = self.trainer
        return self.ends_optimizer_step() and (t.state.global_step + 1) % t.args.logging_steps == 0

    def micro_step(self) -> dict[str, float]:
        """One micro-step: ``training_step`` (timed); at the end of an optimizer step the optimizer step and, at a
        logging step, the loop's read of the loss and ``log`` (each timed apart)."""
        t, sync = self.trainer, self.sync
        ends, logging = self.ends_optimizer_step(), self.is_logging_step()
        batch = next(self.batches)
        sync()
        start = time.perf_counter()
        loss = t.training_step(t.model, batch, None)
        sync()
        stepped = optimized = logged = time.perf_counter()
        if ends:
            t.optimizer.step()
            t.model.zero_grad(set_to_none=True)
            t.state.global_step += 1
            sync()
            optimized = logged = time.perf_counter()
        if logging:
            t.log({"loss": float(loss.detach())})
            sync()
            logged = time.perf_counter()
        return {"training_step": stepped - start, "optimizer": optimized - stepped, "log": logged - optimized}

    def cycle(self) -> list[dict[str, float]]:
        """One rollout: the generating micro-step (untimed), then every micro-step until the next rollout."""
        self.micro_step()
        assert not self.generates_next(), "steps_per_generation must exceed 1"
        parts = []
        while not self.generates_next():
            parts.append(self.micro_step())
        return parts


def build_runner(name: str, model: torch.nn.Module, ctx: dict[str, Any], args: argparse.Namespace) -> Runner:
    from transformers import PrinterCallback

    trainer_cls, config_cls, overrides = method_config(name, args.energy_buckets)
    kwargs = trainers.config_kwargs(
        device=args.device, seed=args.seed, max_steps=10**6, per_device_train_batch_size=args.batch,
        num_generations=args.group_size, steps_per_generation=args.steps_per_generation,
        max_completion_length=args.completion_length, learning_rate=args.learning_rate, fixed_length=True,
        gradient_checkpointing=False, output_dir=tempfile.mkdtemp(prefix=f"dfpo-microstep-{name}-"),
    )
    kwargs.update(logging_steps=args.logging_steps, gradient_accumulation_steps=args.gradient_accumulation_steps)
    config = config_cls(**kwargs, **overrides)
    trainer = trainer_cls(model=model, reward_funcs=[trainers.IdParityReward()], args=config,
                          train_dataset=ctx["dataset"], processing_class=ctx["tokenizer"])
    trainer.remove_callback(PrinterCallback)  # disable_tqdm would print every log line
    trainer.create_optimizer()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    return Runner(name, trainer, iter(trainer.get_train_dataloader()), sync)


# ------------------------------------------------------------------------------------------------- timing
def time_rounds(runners: dict[str, Runner], args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds; per round and method the median of each part over its non-generating micro-steps."""
    order_rng = random.Random(args.seed)
    rounds: dict[str, dict[str, list[float]]] = {n: {"training_step": [], "step_total": [], "log": [],
                                                     "optimizer": []} for n in runners}
    started = time.perf_counter()
    complete = True
    for round_index in range(args.warmup + args.rounds):
        if round_index > args.warmup and time.perf_counter() - started > args.deadline_s:
            complete = False
            break
        order = list(runners)
        order_rng.shuffle(order)
        for name in order:
            parts = [p for _ in range(args.cycles) for p in runners[name].cycle()]
            if round_index < args.warmup:
                continue
            for key in ("training_step", "log", "optimizer"):
                rounds[name][key].append(statistics.median(p[key] for p in parts))
            rounds[name]["step_total"].append(statistics.median(sum(p.values()) for p in parts))
    result: dict[str, Any] = {"rounds_done": len(rounds[BASELINE]["training_step"]), "complete": complete,
                              "wall_s": round(time.perf_counter() - started, 1), "methods": {}}
    base = rounds[BASELINE]
    for name, series in rounds.items():
        entry: dict[str, Any] = {}
        for key, values in series.items():
            part: dict[str, Any] = {"median_ms": 1e3 * statistics.median(values),
                                    "round_medians_ms": [1e3 * v for v in values]}
            if name != BASELINE and key in ("training_step", "step_total"):
                ratios = [v / b for v, b in zip(values, base[key], strict=True)]
                part["ratio_to_trl"] = statistics.median(ratios)
                part["ratio_interval_95"] = stats.bootstrap_median(ratios) if len(ratios) > 1 else None
            entry[key] = part
        result["methods"][name] = entry
    return result


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="pretrained checkpoint (default: --random-config)")
    p.add_argument("--random-config", default="tiny", choices=trainers.RANDOM_CONFIGS)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="float32", choices=tuple(trainers.DTYPES),
                   help="weights' dtype (the recipe: float32 under bf16 autocast on the GPU)")
    p.add_argument("--methods", nargs="+", default=list(METHOD_NAMES), choices=METHOD_NAMES)
    p.add_argument("--batch", type=int, default=None, help="per_device_train_batch_size (default: 32; CPU 4)")
    p.add_argument("--group-size", type=int, default=None, help="num_generations (default: 8; CPU 2)")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--steps-per-generation", type=int, default=None, help="default: 4; CPU 2")
    p.add_argument("--completion-length", type=int, default=None, help="default: 32; CPU 4")
    p.add_argument("--learning-rate", type=float, default=3e-5)
    p.add_argument("--logging-steps", type=int, default=1)
    p.add_argument("--energy-buckets", type=int, default=0,
                   help="log_energy_buckets of the Min-Replace methods (the vLLM recipe: 4; server mode: 0)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--cycles", type=int, default=1, help="rollouts per method per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--deadline-s", type=float, default=120.0, help="stop the timing rounds after this")
    p.add_argument("--profile-cycles", type=int, default=1, help="profiled rollouts per method")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default on the CPU: 1; OpenMP spin-waiting on a shared CPU is far slower)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    # The recipe's shape on a GPU; on the CPU a pipeline check small enough for a minute (TRL's CPU log-prob path
    # alone takes seconds per micro-step at the recipe's shape with a 49k vocabulary).
    defaults = RECIPE_SHAPE if args.device.startswith("cuda") else CPU_SHAPE
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if BASELINE not in args.methods:
        args.methods.insert(0, BASELINE)
    if args.batch % args.group_size:
        p.error(f"--batch {args.batch} must be a multiple of --group-size {args.group_size}")
    if args.steps_per_generation <= args.gradient_accumulation_steps:
        p.error("--steps-per-generation must exceed --gradient-accumulation-steps: off-policy micro-steps are measured")
    return args


def say(message: str) -> None:
    print(f"microstep_profile: {message}", file=sys.stderr, flush=True)


def print_table(result: dict[str, Any]) -> None:
    timing, prof = result["timing"], result["profile"]
    print(f"{result['card']}; {result['model']}; {timing['rounds_done']} rounds, {timing['wall_s']} s")
    print(f"{'method':24s} {'step ms':>8s} {'ratio [95%]':>22s} {'+log+opt ms':>12s} {'ratio':>6s} "
          f"{'DFPO cpu ms':>11s} {'DFPO kern':>9s} {'syncs loss/log':>15s}")
    for name, entry in timing["methods"].items():
        ts, total = entry["training_step"], entry["step_total"]
        ratio = "" if name == BASELINE else f"{ts['ratio_to_trl']:.3f}"
        if ts.get("ratio_interval_95"):
            ratio += " [{:.3f}, {:.3f}]".format(*ts["ratio_interval_95"])
        total_ratio = "" if name == BASELINE else f"{total['ratio_to_trl']:.3f}"
        p = prof.get(name, {})
        syncs = result["host_syncs"].get(name, {}).get("logging_steps", {})
        print(f"{name:24s} {ts['median_ms']:8.2f} {ratio:>22s} {total['median_ms']:12.2f} {total_ratio:>6s} "
              f"{p.get('dfpo_self_cpu_ms', 0):11.2f} {p.get('dfpo_self_cuda_kernels', 0):9.1f} "
              f"{syncs.get('training_step_per_step', 0):7.1f}/{syncs.get('log_per_step', 0):<7.1f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.quiet()
    if args.threads or not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads or 1)
    started = time.perf_counter()
    from dfpo_trl.cli import get_task

    tokenizer = trainers.load_tokenizer(args.tokenizer or args.model or trainers.default_tokenizer_path())
    model = trainers.build_model(args.model, None if args.model else args.random_config, tokenizer,
                               trainers.DTYPES[args.dtype], args.device, args.seed)
    ctx = {"tokenizer": tokenizer, "dataset": get_task("two_forms").build_dataset("train", 512, args.seed)}
    runners = {name: build_runner(name, copy.deepcopy(model), ctx, args) for name in args.methods}
    del model
    say(f"{len(runners)} trainers built, {time.perf_counter() - started:.0f} s")
    timing = time_rounds(runners, args)
    say(f"timing: {timing['rounds_done']} rounds, {time.perf_counter() - started:.0f} s")
    prof = profile_methods(runners, args)
    say(f"profile done, {time.perf_counter() - started:.0f} s")
    syncs = count_syncs(runners, args)
    result = {
        "card": common.device_name(args.device), "device": args.device, "versions": common.versions(),
        **provenance.checkout_state(common.ROOT),
        "command": " ".join([pathlib.Path(sys.executable).name, *sys.argv]),
        "model": pathlib.Path(args.model).name if args.model else f"random-{args.random_config}",
        "shape": {"batch": args.batch, "group_size": args.group_size,
                  "gradient_accumulation_steps": args.gradient_accumulation_steps,
                  "steps_per_generation": args.steps_per_generation, "completion_length": args.completion_length,
                  "logging_steps": args.logging_steps, "energy_buckets": args.energy_buckets,
                  "dtype": args.dtype, "bf16_autocast": args.device.startswith("cuda")},
        "methods": list(runners), "baseline": BASELINE, "timing": timing, "profile": prof, "host_syncs": syncs,
        "total_s": round(time.perf_counter() - started, 1),
    }
    tag = args.tag or result["model"]
    common.write_json(pathlib.Path(args.out_dir) / f"microstep_profile_{tag}.json", result)
    print_table(result)


if __name__ == "__main__":
    main()
