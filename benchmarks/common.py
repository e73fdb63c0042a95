"""Shared pieces of the DFPO benchmarks: the method table, model/tokenizer loading, config building, and the launcher
that runs one ``dfpo-train`` process per run (long_run.py, study_v3.py).

Every benchmark names methods by the keys of :data:`METHODS`. A method is a trainer class, a config class and
the config overrides that make it that method (docs/reference-runs.md settings: GSPO ε = 3e-4/4e-4, GRPO = TRL's DAPO
loss with ε = 0.2/0.28). Each method also names the reference it must be compared with in the same gradient
form (docs/design.md): a ratio-form transform with GSPO, a score-form transform with ``none_score``, the
token-level fixes with TRL's GRPO.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import trl  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dfpo_trl import DFPOConfig, DFPOTrainer  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from provenance import checkout_state  # noqa: E402

GPU_MODEL_PATH = "/root/models/smollm2-135m-instruct"

# docs/reference-runs.md: GSPO with ε = 3e-4 / 4e-4 (sequence level); GRPO = TRL's DAPO loss with ε = 0.2 / 0.28.
GSPO = dict(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4)
DAPO = dict(importance_sampling_level="token", loss_type="dapo", epsilon=0.2, epsilon_high=0.28)


@dataclass(frozen=True)
class Method:
    """One benchmarked objective: which trainer, which overrides, and what to compare it with."""

    name: str
    dfpo: bool  # needs DFPOTrainer / DFPOConfig (False: TRL's own GRPOTrainer, or DFPOTrainer if asked)
    overrides: dict[str, Any] = field(default_factory=dict)
    reference: str | None = None  # the method it is compared with, in the same gradient form
    label: str = ""
    level: str = "sequence"


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("gspo", False, GSPO, None, "GSPO"),
        Method("grpo", False, DAPO, None, "GRPO (DAPO loss)", "token"),
        Method("min_replace", True, {**GSPO, "group_transform": "min_replace"}, "gspo", "Min-Replace"),
        Method("orth_proj", True, {**GSPO, "group_transform": "orth_proj"}, "gspo", "Orth-Proj"),
        Method(
            "positive_orth_proj", True, {**GSPO, "group_transform": "positive_orth_proj"}, "gspo",
            "Positive Orth-Proj",
        ),
        Method(
            "truncate_rebalance", True, {**GSPO, "group_transform": "truncate_rebalance"}, "gspo",
            "Truncate-Rebalance",
        ),
        Method("none_score", True, {**GSPO, "transform_gradient": "score"}, "gspo", "none (score form)"),
        Method(
            "min_replace_score", True, {**GSPO, "group_transform": "min_replace", "transform_gradient": "score"},
            "none_score", "Min-Replace (score form)",
        ),
        Method("grpo_fix", True, {**DAPO, "symmetric_clip": True}, "grpo", "GRPO-fix", "token"),
        Method("delta", True, {**DAPO, "token_weighting": "delta"}, "grpo", "DelTA", "token"),
        # Diagnostic: GSPO through DFPOTrainer (group-granular batches, mechanism metrics), no transform.
        Method("dfpo_none", True, dict(GSPO), "gspo", "GSPO via DFPOTrainer"),
        # Gradient-exact cancellation (docs/cancellation.md): the transform balances the surviving gradients'
        # shared-token coefficients, not the weights.
        Method(
            "min_replace_grad", True, {**GSPO, "group_transform": "min_replace", "cancellation_target": "gradient"},
            "gspo", "Min-Replace (gradient)",
        ),
        Method(
            "positive_orth_proj_grad", True,
            {**GSPO, "group_transform": "positive_orth_proj", "cancellation_target": "gradient"},
            "gspo", "Positive Orth-Proj (gradient)",
        ),
        Method(
            "min_replace_grad_zero", True,
            {**GSPO, "group_transform": "min_replace", "cancellation_target": "gradient",
             "cancellation_one_sided": "zero"},
            "gspo", "Min-Replace (gradient, one-sided zero)",
        ),
    ]
}

# The cancellation study (docs/cancellation.md): the gradient-target variants against GSPO, Min-Replace on the
# weights and the score form.
CANCELLATION_METHODS = [
    "gspo", "min_replace", "min_replace_grad", "positive_orth_proj_grad", "min_replace_grad_zero", "none_score",
]


def delta_available() -> bool:
    """DelTA is benchmarked only when this dfpo_trl has the ``token_weighting`` config field."""
    return "token_weighting" in DFPOConfig.__dataclass_fields__


def gradient_target_available() -> bool:
    """The gradient-target methods run only when this dfpo_trl has ``DFPOConfig.cancellation_target``."""
    return "cancellation_target" in DFPOConfig.__dataclass_fields__


def missing_config_fields(name: str) -> list[str]:
    """Config fields a method sets that this dfpo_trl's DFPOConfig (or GRPOConfig) lacks."""
    fields = set(DFPOConfig.__dataclass_fields__)
    return sorted(k for k in METHODS[name].overrides if k not in fields)


def _with_delta(names: list[str]) -> list[str]:
    return [n for n in names if n != "delta" or delta_available()]


OVERHEAD_METHODS = _with_delta(
    ["gspo", "grpo", "min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance", "grpo_fix", "delta"]
)
LEARNING_METHODS = _with_delta(
    [
        "grpo", "gspo", "min_replace", "orth_proj", "positive_orth_proj", "truncate_rebalance", "grpo_fix",
        "delta", "min_replace_score", "none_score",
    ]
)


def check_methods(names: list[str], allow_missing: bool = False) -> list[str]:
    """Refuse unknown names, and methods whose config fields this dfpo_trl lacks (DelTA, the gradient-exact
    cancellation's ``cancellation_*``), with the fix. ``allow_missing``: run the latter without those fields (smoke
    tests)."""
    for name in names:
        if name not in METHODS:
            raise SystemExit(f"unknown method {name!r}; known: {', '.join(METHODS)}")
        if name == "delta" and not delta_available():
            raise SystemExit("method 'delta' needs DFPOConfig.token_weighting, which this dfpo_trl lacks")
        missing = missing_config_fields(name)
        if missing and not allow_missing:
            raise SystemExit(
                f"method {name!r} needs DFPOConfig field(s) {', '.join(missing)}, which this dfpo_trl lacks "
                "(docs/cancellation.md); --allow-missing-fields runs it without them (CPU smoke only)"
            )
    return names


def trainer_and_config(
    name: str, baseline_trainer: str = "trl", allow_missing: bool = False
) -> tuple[type, type, dict[str, Any]]:
    """(trainer class, config class, overrides) of a method. ``baseline_trainer="dfpo"`` runs gspo/grpo through
    DFPOTrainer with no DFPO option (the same loss and gradients as TRL, tested), so that every method has
    group-granular batches and mechanism metrics."""
    method = METHODS[name]
    if method.dfpo or baseline_trainer == "dfpo":
        overrides = dict(method.overrides)
        if allow_missing:
            for key in missing_config_fields(name):
                overrides.pop(key)
        baseline = not method.dfpo or name == "dfpo_none"
        if baseline and "group_granular_batches" in DFPOConfig.__dataclass_fields__:
            # DFPO off keeps TRL's per-sample order unless asked: ask, for the mechanism metrics.
            overrides["group_granular_batches"] = True
        return DFPOTrainer, DFPOConfig, overrides
    return GRPOTrainer, GRPOConfig, dict(method.overrides)


# ------------------------------------------------------------------------------------------ models, data
def default_tokenizer_path() -> str:
    """The GPU kit's checkpoint if present, else the embedded SmolLM2 (converted once, offline)."""
    if os.path.isdir(GPU_MODEL_PATH):
        return GPU_MODEL_PATH
    from dfpo_trl.app.embedded import embedded_model_path

    return str(embedded_model_path())


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise SystemExit(f"tokenizer at {path} has no chat template; the arithmetic task is conversational")
    return tokenizer


def random_config(name: str, tokenizer: Any) -> Any:
    """A randomly initialised model's config. ``tiny``: a 2-layer Llama for CPU smoke tests. ``qwen3-1.7b``:
    sized like Qwen3-1.7B (hidden 2048, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, tied
    embeddings) with the tokenizer's vocabulary (SmolLM2's 49,152 instead of Qwen3's 151,936), so about 1.5B
    parameters. ``smollm2-1.7b``: SmolLM2-1.7B's architecture (Llama, hidden 2048, 24 layers, 32 heads, tied
    embeddings), 1.7B parameters."""
    from transformers import LlamaConfig, Qwen3Config

    # No pad_token_id in the config (padding uses the tokenizer's): with one, the embedding row of the pad id is
    # initialised to zero, left-padded positions carry exact-zero hidden states through every layer, and on the
    # H100/H200 every Qwen3-1.7B- or SmolLM2-1.7B-sized random init got non-finite gradients in its first
    # backward pass, the first NaN appearing in an RMSNorm's backward (results/NOTES.md). A pretrained model is
    # unaffected: its pad row is trained, not zero.
    ids = dict(
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
    )
    if name == "tiny":
        return LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
            **ids,
        )
    if name == "qwen3-1.7b":
        return Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            rms_norm_eps=1e-6, tie_word_embeddings=True, **ids,
        )
    if name == "smollm2-135m":  # SmolLM2-135M's architecture (Llama, hidden 576, 30 layers, 9 heads, 3 KV heads)
        return LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True, **ids,
        )
    if name == "smollm2-1.7b":
        return LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
            num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=8192, rope_theta=130000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True, **ids,
        )
    raise SystemExit(f"unknown --random-config {name!r}; use one of {', '.join(RANDOM_CONFIGS)}")


RANDOM_CONFIGS = ("tiny", "qwen3-1.7b", "smollm2-1.7b", "smollm2-135m")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(
    model_path: str | None, random_name: str | None, tokenizer: Any, dtype: torch.dtype, device: str, seed: int
) -> torch.nn.Module:
    """A pretrained checkpoint (``model_path``) or a random init (``random_name``), on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    if model_path:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        return model.to(device)
    config = random_config(random_name or "tiny", tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


class IdParityReward:
    """Reward for random models, whose completions never solve the task: 1 when the sum of the completion's
    token ids is odd. About half the group scores 1, so advantages are non-zero and every transform works on
    realistic inputs (arithmetic would give all-zero rewards, hence all-zero advantages)."""

    __name__ = "id_parity"

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **_: Any):
        return [float(sum(ids) % 2) for ids in completion_ids]


def keep_per_sample_order(trainer: Any) -> None:
    """In the pre-pass layout, keep TRL's per-sample order of each rollout (the layout before DFPO laid groups in
    consecutive rows): the regrouping is replaced by the whole-group marking alone. For measuring what the order
    saves; the pre-pass stays exact either way."""
    layout = trainer.layout

    def per_sample(buffered: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        layout._mark_whole_groups(buffered)
        return buffered

    layout.regroup = per_sample


BENCHMARK_TASKS = ("arithmetic", "sum_sentence")  # tasks of dfpo_trl.tasks the learning benchmark runs on


def task_and_rewards(reward: str, task_name: str = "arithmetic") -> tuple[Any, list[Any]]:
    """A task of ``dfpo_trl.tasks`` (``arithmetic`` or ``sum_sentence``) and the reward functions to train with:
    the task's own (``reward="task"``, or ``"arithmetic"`` for backward compatibility) or ``id_parity``."""
    from dfpo_trl.tasks import get_task

    if task_name not in BENCHMARK_TASKS:
        raise SystemExit(f"unknown task {task_name!r}; use one of {', '.join(BENCHMARK_TASKS)}")
    task = get_task(task_name)
    if reward in ("task", "arithmetic"):
        return task, list(task.reward_funcs)
    if reward == "id_parity":
        return task, [IdParityReward()]
    raise SystemExit(f"unknown reward {reward!r}; use 'task' or 'id_parity'")


def config_kwargs(
    *,
    device: str,
    seed: int,
    max_steps: int,
    per_device_train_batch_size: int,
    num_generations: int,
    steps_per_generation: int,
    max_completion_length: int,
    learning_rate: float,
    temperature: float = 1.0,
    beta: float = 0.0,
    fixed_length: bool = False,
    gradient_checkpointing: bool = True,
    output_dir: str | None = None,
) -> dict[str, Any]:
    """The GRPOConfig keyword arguments shared by every method (off-policy: steps_per_generation >
    gradient_accumulation_steps = 1). ``fixed_length`` forces every completion to ``max_completion_length``
    tokens (min_new_tokens), so every method trains on tensors of the same shape (timing runs)."""
    on_cpu = not device.startswith("cuda")
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir or tempfile.mkdtemp(prefix="dfpo-bench-"),
        seed=seed, max_steps=max_steps, per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=1, num_generations=num_generations, steps_per_generation=steps_per_generation,
        max_completion_length=max_completion_length, learning_rate=learning_rate, temperature=temperature,
        beta=beta, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing, use_cpu=on_cpu, bf16=not on_cpu,
    )
    if fixed_length:
        kwargs["generation_kwargs"] = {"min_new_tokens": max_completion_length}
    return kwargs


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, torch threads={torch.get_num_threads()})"


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__}


def bootstrap_median(values: list[float], draws: int = 4000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the median of ``values`` (resampling rounds)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return [medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]]


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """Atomic JSON write (a reader never sees a half file; a killed job leaves the previous version)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def quiet() -> None:
    """Keep logs short: transformers/TRL warnings once, no progress bars."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


# ------------------------------------------------------------------------------------------------ launcher
# One `dfpo-train` process per (task, method or arm, seed), N at a time, each reduced to a record as it ends (the
# long-run study, study v2 and study v3 launch their runs through it). Several vLLM engines on one GPU: an engine
# measures free memory while it starts, and another engine starting or freeing memory then fails it, so the next run
# starts only once the last one's engine is up (its trainer logged the group layout), and a run that failed that way
# is retried.
RECIPE = ROOT / "recipes" / "smollm2_gpu_vllm.yaml"
SEQUENCE_GSPO = ["--importance_sampling_level", "sequence", "--loss_type", "grpo", "--epsilon", "3e-4",
                 "--epsilon_high", "4e-4"]
ENGINE_READY = ("DFPO group layout", "group layout:")  # logged once the trainer (and its vLLM engine) is built
ENGINE_START_FAILURES = ("Error in memory profiling", "release GPU memory while vLLM is profiling")
MAX_ATTEMPTS = 3
# Per-step log keys a record keeps (besides every drift/, energy/, cancellation/, asym/, sampling/, clip_ratio/).
STEP_KEYS = ("step_reward", "reward", "entropy", "loss", "grad_norm", "completions/mean_length",
             "heldout/accuracy", "frac_reward_zero_std")
STEP_PREFIXES = ("drift/", "energy/", "cancellation/", "asym/", "sampling/", "clip_ratio/", "transform/",
                 "grpo_fix/", "diagnostics/")


def run_flags(
    args: argparse.Namespace, task: str, method: str, seed: int, output_dir: pathlib.Path, port: int,
    flags: list[str],
) -> list[str]:
    """The `dfpo-train` command line of one run: the recipe, task, seed and step count of ``args``, then ``flags``
    (the method's or arm's), then ``args.extra``."""
    launcher = [sys.executable, "-m", "dfpo_trl"]
    if args.via_accelerate:
        launcher = ["accelerate", "launch", "--num_processes", "1", "--main_process_port", str(port), "-m", "dfpo_trl"]
    command = [*launcher, str(args.recipe), "--task", task, "--seed", str(seed),
               "--output_dir", str(output_dir), "--max_steps", str(args.steps), "--save_model", "false",
               "--plot", "false", "--disable_tqdm", "true", *flags]
    if args.model:
        command += ["--model_name_or_path", args.model]
    if args.vllm_memory is not None:
        command += ["--vllm_gpu_memory_utilization", str(args.vllm_memory)]
    return command + list(args.extra)


def series(log_history: list[dict[str, Any]], key: str) -> list[list[float]]:
    """[[step, value], ...] of one logged key (finite values only)."""
    out = []
    for row in log_history:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in row:
            out.append([int(row["step"]), float(value)])
    return out


def compact_record(summary: dict[str, Any], key: dict[str, Any]) -> dict[str, Any]:
    """One run's record: its identity, the summary's scalars, the held-out and drift curves, the kept step keys."""
    history = summary.get("log_history") or []
    keys = sorted({k for row in history for k in row
                   if k in STEP_KEYS or k.startswith(STEP_PREFIXES)})
    return {
        **key,
        "steps": summary.get("steps"),
        "heldout": summary.get("heldout"),
        "drift": summary.get("drift"),
        "steps_to_threshold": summary.get("steps_to_threshold"),
        "reward_threshold": summary.get("reward_threshold"),
        "reward_jitter2": summary.get("reward_jitter2"),
        "reward_ema_last": summary.get("reward_ema_last"),
        "time_split": summary.get("time_split"),
        "series": {k: series(history, k) for k in keys},
    }


def installed_versions() -> dict[str, str]:
    """The installed versions of the packages a run's numbers depend on ("absent" when not installed)."""
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "trl", "vllm", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def card() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - only a label
        return "unknown"


# ------------------------------------------------------------------------------------------------ launcher
class Run:
    """One (task, method, seed) process of the launcher, with the dfpo-train ``flags`` of its method or arm (the
    long-run study, study v2 and study v3 each give their own)."""

    def __init__(self, task: str, method: str, seed: int, flags: list[str]) -> None:
        self.task, self.method, self.seed = task, method, seed
        self.flags = list(flags)
        self.attempts = 0
        self.process: subprocess.Popen | None = None
        self.started = 0.0
        self.log: pathlib.Path | None = None
        self.checkout: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.task}__{self.method}__s{self.seed}"

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace") if self.log else ""
        except FileNotFoundError:
            return ""

    def engine_ready(self) -> bool:
        return any(marker in self.log_text() for marker in ENGINE_READY)


def start(run: Run, args: argparse.Namespace, index: int) -> None:
    work = pathlib.Path(args.out_dir)
    output_dir = work / "work" / run.name
    output_dir.mkdir(parents=True, exist_ok=True)
    run.log = work / "logs" / f"{run.name}.a{run.attempts}.log"
    run.log.parent.mkdir(parents=True, exist_ok=True)
    port = 29600 + index % 300
    env = dict(os.environ, MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    if args.gpus:
        env["CUDA_VISIBLE_DEVICES"] = str(args.gpus[index % len(args.gpus)])
    run.attempts += 1
    run.started = time.time()
    run.checkout = checkout_state(ROOT)  # the code this process runs (cwd=ROOT), read as it starts
    with open(run.log, "w") as log:
        command = run_flags(args, run.task, run.method, run.seed, output_dir, port, run.flags)
        run.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)


def finish(run: Run, args: argparse.Namespace, code: int) -> dict[str, Any]:
    """The record of a finished run (a failed one keeps its log's tail)."""
    work = pathlib.Path(args.out_dir)
    key = {"task": run.task, "method": run.method, "seed": run.seed, "card": args.card, "versions": args.versions,
           "attempts": run.attempts, "wall_s": round(time.time() - run.started, 1), "exit_code": code,
           "checkout": run.checkout,
           "settings": {"recipe": str(pathlib.Path(args.recipe).relative_to(ROOT)), "flags": run.flags,
                        "steps": args.steps, "extra": list(args.extra)}}
    summary_path = work / "work" / run.name / "dfpo_summary.json"
    if code == 0 and summary_path.exists():
        record = compact_record(json.loads(summary_path.read_text()), key)
        record["complete"] = record["steps"] is not None and record["steps"] >= args.steps
    else:
        record = {**key, "complete": False, "log_tail": run.log_text()[-3000:]}
    path = work / "runs" / f"{run.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) + "\n")
    return record


def launch(args: argparse.Namespace, queue: list[Run], skip_failed: bool = False) -> None:
    """Run ``queue``, ``args.parallel`` at a time, skipping runs with a complete record in ``args.out_dir``/runs or
    ``args.skip_done`` (with ``skip_failed``, any record: a crash stays recorded as a crash, not retried); starts no
    run expected to end after ``args.deadline_s``."""
    args.card, args.versions = card(), installed_versions()
    done_dir = pathlib.Path(args.out_dir) / "runs"
    skip = set()
    for directory in [done_dir, *map(pathlib.Path, args.skip_done)]:
        for path in [*directory.glob("*.json"), *directory.glob("*.json.gz")]:
            if skip_failed or read_record(str(path)).get("complete"):
                skip.add(path.name.split(".json")[0])
    queue = [r for r in queue if r.name not in skip]
    began, index, running, starting = time.time(), 0, [], None
    print(f"{len(queue)} runs to do ({len(skip)} already done), {args.parallel} at a time on {args.card}", flush=True)
    walls: list[float] = []
    while queue or running:
        for run in list(running):
            code = run.process.poll()
            if code is None:
                continue
            running.remove(run)
            if starting is run:
                starting = None
            text = run.log_text()
            if code != 0 and run.attempts < MAX_ATTEMPTS and any(m in text for m in ENGINE_START_FAILURES):
                print(f"{run.name}: vLLM start-up failed (memory profiling), retrying", flush=True)
                queue.insert(0, run)
                continue
            record = finish(run, args, code)
            if record.get("complete"):
                walls.append(record["wall_s"])
            print(f"[{time.time() - began:6.0f}s] {run.name}: exit {code}, {record.get('steps')} steps, "
                  f"{record['wall_s']:.0f}s, held-out {(record.get('heldout') or {}).get('after')}", flush=True)
        if starting is not None and (starting.engine_ready() or time.time() - starting.started > args.start_timeout):
            starting = None
        elapsed = time.time() - began
        expected = statistics.median(walls) if walls else args.expected_run_s
        fits = args.deadline_s is None or elapsed + expected < args.deadline_s
        if starting is None and queue and len(running) < args.parallel and fits:
            run = queue.pop(0)
            start(run, args, index)
            index += 1
            running.append(run)
            starting = run
            print(f"[{elapsed:6.0f}s] start {run.name} (attempt {run.attempts})", flush=True)
        elif queue and not running and not fits:
            print(f"deadline: {len(queue)} runs not started", flush=True)
            break
        time.sleep(1.0)


def status(out_dir: str) -> None:
    runs = sorted((pathlib.Path(out_dir) / "runs").glob("*.json"))
    records = [json.loads(p.read_text()) for p in runs]
    complete = [r for r in records if r.get("complete")]
    print(f"{len(complete)} complete, {len(records) - len(complete)} failed or short")
    for r in records:
        if not r.get("complete"):
            print("  not complete:", r["task"], r["method"], r["seed"], "exit", r.get("exit_code"))
    logs = sorted((pathlib.Path(out_dir) / "logs").glob("*.log"))
    print(f"{len(logs)} logs")


# ------------------------------------------------------------------------------------------------ statistics
def read_record(path: str) -> dict[str, Any]:
    """A run record, plain or gzip-compressed (``.json.gz``: how the repository keeps them)."""
    raw = pathlib.Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)



SMOKE_FLAGS = ["--use_vllm", "false", "--use_cpu", "true", "--bf16", "false", "--eval_every", "2", "--drift_every",
               "2", "--eval_size", "4", "--drift_size", "2", "--eval_max_new_tokens", "4", "--eval_batch_size", "4",
               "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
               "--log_energy_buckets", "2", "--train_size", "32", "--report_to", "none"]


def smoke_model(out: pathlib.Path) -> str:
    """A tiny random model and its tokenizer (tests/tiny.py) saved in ``out/tiny_model``, for the CPU smoke runs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import save_tiny_chat_model

    return str(save_tiny_chat_model(out / "tiny_model"))
