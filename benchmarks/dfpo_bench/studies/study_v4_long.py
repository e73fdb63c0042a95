"""Study v4, part 3: a long run with room to drift (a balanced warm start, a half-solved task, a loss without the
per-length residual, an anchor with the same completions per step), guarded by a registration.

    python -m dfpo_bench.studies.study_v4_long --preregister   # writes results/study_v4/preregistered_long.json; put
                                                               # the printed SHA-256 in REGISTRATION_SHA256, commit both
    M=/root/models/smollm2-135m-instruct; O=/tmp/v4long
    python -m dfpo_bench.studies.study_v4_long --stage warmstart --model $M --out-dir $O   # SFT + the step-0 gate
    python -m dfpo_bench.studies.study_v4_long --stage pilot --out-dir $O --parallel 8     # refused unless the gate
                                             # passed; repeat until nothing is left; then writes OUT/plan.json
    python -m dfpo_bench.studies.study_v4_long --stage main --out-dir $O --parallel 8      # the seeds plan.json names
    python -m dfpo_bench.studies.study_v4_long --analyse $O     # -> results/study_v4_long.json

Every stage refuses to start unless results/study_v4/preregistered_long.json hashes (whole content) to
REGISTRATION_SHA256 and is tracked, committed and clean (dfpo_bench.lib.registration). The warm start writes
OUT/warmstart/e<epochs>/warmstart.jsonl: a header (registration state, checkout with its source hash, versions,
device, base model), the SFT losses, the gate's measurement and a ``complete`` line (a file without it is a crash).
Each arm run is one ``dfpo-train`` process from the warm-start checkpoint (dfpo_bench.lib.common's launcher); its
record (OUT/<stage>/runs/v4l__<arm>__s<seed>.json) carries its checkout and ``complete``; a record without
``complete: true`` is a crash, counted as one and never rerun. Design and reasons: :data:`PREREGISTRATION` and
benchmarks/README.md, "Study v4, part 3".
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import pathlib
import random
import re
import statistics
import time
from collections.abc import Iterator
from typing import Any

from dfpo_bench import study_v4_tasks
from dfpo_bench.lib import common
from dfpo_bench.lib.registration import (
    check_registration,
    file_sha256,
    registration_text,
    run_provenance,
    write_registration,
)
from dfpo_bench.lib.stats import mde_t, t_ppf

ROOT = common.ROOT
RESULTS = ROOT / "benchmarks" / "results" / "study_v4"
REGISTRATION_FILE = RESULTS / "preregistered_long_r2.json"  # revision 2; revision 1 (preregistered_long.json)
# stays committed: the 2026-11-29 records admitted it, and the analysis reads the design their hash names
REGISTRATION_SHA256 = "fc415a31ea3bd5f77fc2b0f61699d2df232fde746abd4030ec10dc5830afaf0a"  # the file's whole content
TASK = "dfpo_bench.study_v4_tasks:two_digit"
ARMS = {"anchor": ("none", True), "gspo": ("none", False), "mr_w": ("min_replace", False)}  # transform, on-policy
PREREGISTRATION: dict[str, Any] = {
    "study": "v4 part 3: a long run with room to drift",
    "task": TASK + " (two-digit addition, a and b in 10..99; 'The sum is n.' / 'The answer is n.', equal token "
            "length for every n; reward 1 for either form with the right sum, 0 for anything else, a wrong sum in "
            "either form included; 256 held-out pairs never trained on)",
    "warmstart": {
        "what": "supervised fine-tuning of the base model on the task's SFT stream: 192 problems, each written in "
                "both forms with the correct sum (384 examples, the per-problem optimum an even split); loss on the "
                "completion and its end token only; "
                "a plain loop (AdamW, constant lr, fixed shuffling seed), one checkpoint shared by every arm and seed",
        "examples": 384, "batch_size": 16, "learning_rate": 1e-5, "seed": 0, "epochs_schedule": [1, 2, 4, 8],
        "schedule_rule": "each epoch count is trained from the base model in this order; the first whose checkpoint "
                         "passes the gate is the warm start; if none passes the study stops (recorded)",
        "gate": {"prompts": 64, "set_entropy_normalised_min": 0.95, "format_mass_min": 0.5,
                 "samples_per_prompt": 8, "sampling": "temperature 1, top_k 0, top_p 1, max 16 new tokens, seed 0",
                 "entropy": "drift meter (dfpo_trl.testing.measures: completion_log_probs, equivalent_set_stats) on "
                            "the first 64 held-out prompts (the runs' drift meter prompts): mean over prompts of the "
                            "two forms' entropy (correct sum), / ln 2",
                 "format_mass": "share of the sampled completions written in either form, whatever the number",
                 "read_on": "the checkpoint as the arms load it: reloaded from disk into a fresh model, in float32, "
                            "the arms' precision (revision 2; revision 1 read the in-memory model after the SFT, "
                            "also float32, while the arms ran under bf16 autocast)"},
    },
    "trajectory": "sequence-level ratio (GSPO), loss_type dr_grpo, scale_rewards none, whole groups per micro-batch, "
                  "G = 8, 4 groups (32 completions) per micro-batch and per optimizer step, epsilon 0.1 / 0.12, "
                  "learning rate 2e-5 constant, max_completion_length 16, temperature 1, transformers generation "
                  "(no vLLM), 300 optimizer steps, drift meter every 10 steps on 64 held-out prompts, held-out greedy "
                  "accuracy every 50 on 100, float32 forwards and weights (bf16 false; revision 2)",
    "revision": 2,
    "revision_reason": "revision 1's runs (2026-11-29, one H200) read normalised set entropy 0.876 at their own step 0 "
                       "where the gate had read 0.973: the kit's base weights lie on the bf16 grid, the SFT moves "
                       "them by less than half a bf16 step, and the arms' bf16 autocast rounded most of the change "
                       "away (reproduced on the CPU: 0.880 under bf16 autocast, 0.973 in float32, same weights). "
                       "Revision 2 runs the arms in float32, reads the gate on the checkpoint as the arms load it, "
                       "and adds the runs' own step-0 reading to the pilot gate",
    "loss_type_reason": "under loss_type grpo each row's loss is divided by its own length, so a token shared by a "
                        "group's rows gets coefficients A_i s_i / L_i that Min-Replace's sum A_i s~_i = 0 does not "
                        "cancel when lengths differ (here sums of 2 and 3 digits; under grpo the on-policy anchor kept"
                        " a shared-token residual of about 0.09); dr_grpo divides by the constant B x "
                        "max_completion_length, so the coefficient on a shared token's log-probability is A_i s_i / (B"
                        " Lmax) for every row and Min-Replace cancels it exactly when no row of the group is clipped; "
                        "chosen over dapo, whose normaliser is the whole generation batch's token count, which differs"
                        " between the anchor (one micro-batch per rollout) and the stale arms (S per rollout). The "
                        "price, which TRL warns about: dr_grpo sums a row's tokens, so a row's whole-sequence weight "
                        "is L_i / Lmax (with the end token a 3-digit answer is 9 tokens, a 2-digit one 8: it weighs "
                        "9/8); the two rewarded forms of one sum have equal length, so the weighting never favours a "
                        "form",
    "arms": {"anchor": "on-policy: steps_per_generation 1, gradient_accumulation 1: a fresh rollout of 32 "
                       "completions for every optimizer step (the same completions per step, and in total, as the "
                       "stale arms), group_transform none",
             "gspo": "stale: steps_per_generation 4 (one rollout of 128 completions, 4 optimizer steps of 32), "
                     "group_transform none",
             "mr_w": "stale as gspo, group_transform min_replace (cancellation_target weights)"},
    "primary": "mr_w - gspo, paired by seed (the same seed gives every arm the same prompts): the area under the "
               "normalised set entropy (drift/set_entropy_normalised, unweighted), trapezoid over the drift "
               "measurements from step 0 to the last / the step span (a mean, in [0, 1]); 95% paired t interval",
    "secondary": ["anchor - gspo and mr_w - anchor on the primary metric", "the same three on the final normalised "
                  "set entropy", "the same on the mass-weighted set entropy area (v3's primary)",
                  "the final set mass, held-out accuracy, the shared-prefix residual per arm (mean over logged "
                  "steps)"],
    "pilot_seeds": [0, 1, 2, 3, 4, 5], "main_seed_start": 100,
    "pilot_gate": {"reward_first_window": 20, "reward_min": 0.2, "reward_max": 0.8, "min_complete_per_arm": 4,
                   "start_entropy_min": 0.95,
                   "what": "mean step_reward over the first 20 steps of the pilot's anchor and gspo runs in "
                           "[0.2, 0.8] (about half of a group succeeds), at least 4 complete runs per arm, and every "
                           "complete pilot run's own step-0 drift reading of the normalised set entropy >= 0.95 (the "
                           "start the gate certified is the one the runs train from); otherwise plan.json says stop "
                           "and the main stage refuses"},
    "mde": 0.05, "power": 0.8, "alpha": 0.05, "sd_inflation": 3.3,
    "seeds_rule": "sd = 3.3 x the pilot's paired SD of the primary (mr_w - gspo over complete pilot pairs); main seeds "
                  "n = the smallest n >= 10 with (t_.975,n-1 + t_.8,n-1) sd / sqrt n <= 0.05, at most 48; at the cap "
                  "the MDE reached at 48 is written in plan.json and reported",
    "sd_inflation_reason": "study v3's 4-seed pilot SD was 3.3 times the main stage's; a 6-seed pilot's SD has a 95% "
                           "upper bound of 2.09 times its estimate (chi-square, 5 df), so x2 would not have covered "
                           "v3; the inflation is the ratio actually seen, above that bound",
    "crashes": "a run whose record lacks complete: true is a crash, counted per arm, never rerun and never read as "
               "a value; the paired analysis uses complete pairs",
    "wording": "a primary interval that holds 0 is reported as 'not detected above the MDE reached', never 'no effect'",
}


def preregistration_text() -> str:
    return registration_text(PREREGISTRATION)


def admitted() -> dict[str, Any]:
    """The registration state, or SystemExit when the file is altered, uncommitted or untracked."""
    return check_registration(REGISTRATION_FILE, REGISTRATION_SHA256, ROOT)


def arm_flags(arm: str) -> list[str]:
    """The dfpo-train flags of one arm on top of the recipe (recipes/smollm2_gpu_vllm.yaml)."""
    transform, on_policy = ARMS[arm]
    s = 1 if on_policy else 4
    return ["--importance_sampling_level", "sequence", "--loss_type", "dr_grpo", "--epsilon", "0.1",
            "--epsilon_high", "0.12", "--scale_rewards", "none", "--group_granular_batches", "true",
            "--num_generations", "8", "--per_device_train_batch_size", "32", "--steps_per_generation", str(s),
            "--gradient_accumulation_steps", "1", "--learning_rate", "2e-5", "--lr_scheduler_type", "constant",
            "--max_completion_length", "16", "--temperature", "1.0", "--drift_every", "10", "--drift_size", "64",
            "--eval_every", "50", "--eval_size", "100", "--train_size", "2048", "--logging_steps", "1",
            "--use_vllm", "false", "--bf16", "false", "--group_transform", transform]


STEPS = 300


# ------------------------------------------------------------------------------------------------ warm start
def gate_result(entropy_normalised: float, format_mass: float) -> dict[str, Any]:
    g = PREREGISTRATION["warmstart"]["gate"]
    return {"set_entropy_normalised": entropy_normalised, "format_mass": format_mass,
            "passed": entropy_normalised >= g["set_entropy_normalised_min"] and format_mass >= g["format_mass_min"]}


def sft_batches(tokenizer: Any, examples: list[dict[str, Any]]) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per example: the chat-rendered prompt with its generation prompt, then the completion's
    tokens and the end token (what the drift meter scores as a completion's end)."""
    out = []
    for e in examples:
        text = tokenizer.apply_chat_template(e["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        completion = tokenizer(e["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append((prompt + completion, len(prompt)))
    return out


def sft(model: Any, tokenizer: Any, examples: list[dict[str, Any]], epochs: int, batch_size: int, lr: float,
        seed: int, device: str) -> list[float]:
    """A plain supervised loop (cross-entropy on completion tokens only); returns the loss per batch. Plain rather
    than TRL's SFTTrainer: the masking is explicit (SmolLM2's chat template has no generation tags for TRL's
    assistant-only loss), nothing else (packing, template handling, collators) varies with the TRL version, and a
    few hundred examples need no more."""
    import torch

    torch.manual_seed(seed)
    with deterministic_kernels():
        return _sft_loop(model, tokenizer, examples, epochs, batch_size, lr, seed, device)


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Deterministic kernels for the SFT, restored after: the GPU machine keeps nothing between sessions, so a later
    session lays the warm start again and may continue the main stage only if the weights hash the same
    (:func:`weights_sha256`). Float32 attention on CUDA would otherwise take the memory-efficient kernel, whose
    backward accumulates with atomics; the math kernel and cuBLAS's fixed workspace do not."""
    import os

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # an op without a deterministic kernel warns, not
    try:                                                       # fails: the replay's hashes are the measurement
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _sft_loop(model: Any, tokenizer: Any, examples: list[dict[str, Any]], epochs: int, batch_size: int, lr: float,
              seed: int, device: str) -> list[float]:
    import torch

    data = sft_batches(tokenizer, examples)
    rng = random.Random(seed)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    losses = []
    for _ in range(epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            chunk = [data[i] for i in order[start:start + batch_size]]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            labels = torch.full((len(chunk), width), -100, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (row, cut) in enumerate(chunk):
                ids[i, :len(row)] = torch.tensor(row)
                labels[i, cut:len(row)] = torch.tensor(row[cut:])
                mask[i, :len(row)] = 1
            loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    model.eval()
    return losses


def measure_gate(model: Any, tokenizer: Any, device: str, prompts: int | None = None,
                 samples: int | None = None) -> dict[str, Any]:
    """The registered step-0 gate on the held-out prompts the runs' drift meter reads (``prompts`` and ``samples``
    per prompt: the registered ones unless a test shrinks them)."""
    import torch
    from dfpo_trl.testing.measures import completion_log_probs, equivalent_set_stats

    g = PREREGISTRATION["warmstart"]["gate"]
    prompts, samples = prompts or g["prompts"], samples or g["samples_per_prompt"]
    task = study_v4_tasks.two_digit()
    rows = list(task.build_dataset("test", prompts))
    k = len(study_v4_tasks.FORMS)
    logps = completion_log_probs(model, tokenizer, [r["prompt"] for r in rows for _ in range(k)],
                                 [f for r in rows for f in study_v4_tasks.forms_of(r)]).view(len(rows), k)
    stats = equivalent_set_stats(logps)
    entropy = float(stats["entropy"].mean()) / math.log(k)
    torch.manual_seed(0)
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows
             for _ in range(samples)]
    answers = [r["answer"] for r in rows for _ in range(samples)]
    written, correct = 0, 0
    for start in range(0, len(texts), 128):
        ids = tokenizer(texts[start:start + 128], return_tensors="pt", padding=True, add_special_tokens=False)
        ids = ids.to(device)
        out = model.generate(**ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        for seq, answer in zip(out[:, ids["input_ids"].shape[1]:], answers[start:start + 128], strict=True):
            found = study_v4_tasks.written_form(tokenizer.decode(seq, skip_special_tokens=True))
            written += found is not None
            correct += found is not None and found[1] == answer
    return {**gate_result(entropy, written / len(texts)), "set_logp_mean": float(stats["set_logp"].mean()),
            "log_odds_mean": float(stats["log_odds"].mean()), "sampled_reward_mean": correct / len(texts),
            "samples": len(texts), "prompts": len(rows)}


def warmstart(args: argparse.Namespace) -> dict[str, Any]:
    """The registered epoch schedule until one checkpoint passes the gate -> OUT/warmstart/chosen.json."""
    state = admitted()
    w = PREREGISTRATION["warmstart"]
    out = pathlib.Path(args.out_dir) / "warmstart"
    tried = []
    for epochs in w["epochs_schedule"]:
        record = read_jsonl(out / f"e{epochs}" / "warmstart.jsonl")
        if record is None:
            record = warmstart_one(args, epochs, state)
        tried.append({"epochs": epochs, "complete": record["complete"], "gate": record.get("gate"),
                      "weights_sha256": record.get("weights_sha256")})
        if record["complete"] and record["gate"]["passed"]:
            break
    chosen = next((t for t in tried if t["complete"] and t["gate"]["passed"]), None)
    result = {"registration_sha256": REGISTRATION_SHA256, "tried": tried, "passed": chosen is not None,
              "model": str(out / f"e{chosen['epochs']}" / "model") if chosen else None,
              "weights_sha256": chosen["weights_sha256"] if chosen else None, "written_at": common.utc_now()}
    common.write_json(out / "chosen.json", result)
    print(f"warm start: {'passed at ' + str(chosen['epochs']) + ' epochs' if chosen else 'no schedule entry passed'}")
    return result


def warmstart_one(args: argparse.Namespace, epochs: int, state: dict[str, Any]) -> dict[str, Any]:
    import torch

    w = PREREGISTRATION["warmstart"]
    folder = pathlib.Path(args.out_dir) / "warmstart" / f"e{epochs}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "warmstart.jsonl"
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    began = time.time()
    with path.open("w") as f:
        f.write(json.dumps({"header": {"stage": "warmstart", "epochs": epochs, "model": args.model, "device": device,
                                       "versions": common.versions(), "card": common.card(),
                                       "started_at": common.utc_now(), **run_provenance(ROOT, state)}}) + "\n")
        f.flush()
        try:
            from dfpo_bench.studies.study_v4 import load_model

            model, tokenizer = load_model(args.model)
            losses = sft(model, tokenizer, study_v4_tasks.sft_examples(w["examples"], w["seed"]), epochs,
                         w["batch_size"], w["learning_rate"], w["seed"], device)
            f.write(json.dumps({"sft": {"losses": losses, "examples": w["examples"]}}) + "\n")
            model.save_pretrained(folder / "model")
            tokenizer.save_pretrained(folder / "model")
            del model  # the gate reads the checkpoint as the arms load it: from disk, in float32
            model, tokenizer = load_model(str(folder / "model"))
            model.to(device)
            f.write(json.dumps({"weights_sha256": weights_sha256(model)}) + "\n")
            gate = measure_gate(model, tokenizer, device)
            f.write(json.dumps({"gate": gate}) + "\n")
            f.write(json.dumps({"complete": True, "wall_s": time.time() - began}) + "\n")
        except Exception as error:  # a crash: recorded, no complete line
            f.write(json.dumps({"crash": f"{type(error).__name__}: {error}"[:400]}) + "\n")
    return read_jsonl(path) or {"complete": False}


def read_jsonl(path: pathlib.Path) -> dict[str, Any] | None:
    """A warm-start file as {header, gate, complete, crash}; None when absent."""
    if not path.exists():
        return None
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {"header": next((x["header"] for x in lines if "header" in x), None),
            "gate": next((x["gate"] for x in lines if "gate" in x), None),
            "complete": any(x.get("complete") for x in lines),
            "weights_sha256": next((x["weights_sha256"] for x in lines if "weights_sha256" in x), None),
            "crash": next((x["crash"] for x in lines if "crash" in x), None)}


def weights_sha256(model: Any) -> str:
    """SHA-256 over the model's state dict (each name, dtype, shape and bytes, in order): the warm start's identity.
    Every arm of every stage must start from the same weights; a warm start laid again in a later session (the GPU
    machine keeps nothing) is the same start only if this hash is the same."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def require_gate(out_dir: pathlib.Path, force: bool) -> dict[str, Any]:
    """OUT/warmstart/chosen.json when its gate passed under this registration; else SystemExit, unless ``force``
    (then the refusal is returned to be recorded in the stage file)."""
    path = out_dir / "warmstart" / "chosen.json"
    chosen = json.loads(path.read_text()) if path.exists() else None
    problem = None
    if chosen is None:
        problem = f"no {path}: run --stage warmstart first"
    elif chosen.get("registration_sha256") != REGISTRATION_SHA256:
        problem = "the warm start ran under another registration"
    elif not chosen.get("passed"):
        problem = "the warm start's step-0 gate did not pass (chosen.json says what was measured)"
    if problem and not force:
        raise SystemExit(f"refused: {problem}; --force runs anyway and records it")
    return {**(chosen or {}), "forced": bool(problem), "refusal": problem}


# ------------------------------------------------------------------------------------------------ runs
class NamedRun(common.Run):
    @property
    def name(self) -> str:
        return f"v4l__{self.method}__s{self.seed}"


def launch(args: argparse.Namespace, stage: str, seeds: list[int], gate: dict[str, Any], extra: dict[str, Any]
           ) -> list[str]:
    """Every (arm, seed) of the stage not yet recorded (a crash stays a crash), seed by seed, the anchor first;
    returns the runs left."""
    folder = pathlib.Path(args.out_dir) / stage
    same_start(pathlib.Path(args.out_dir), gate)
    folder.mkdir(parents=True, exist_ok=True)
    stage_file = folder / "stage.json"
    before = json.loads(stage_file.read_text()) if stage_file.exists() else {}
    common.write_json(stage_file, {"stage": stage, "arms": list(ARMS), "seeds": seeds, "warmstart": gate,
                                   "registration_sha256": REGISTRATION_SHA256, **extra,
                                   "started_at": before.get("started_at", common.utc_now()),
                                   "launches": [*before.get("launches", []), {"at": common.utc_now(), **run_provenance(
                                       ROOT, admitted())}]})
    args.model = gate.get("model") or args.model
    if not args.model:
        raise SystemExit("no warm-start checkpoint and no --model: nothing to train from")
    queue = []
    for s in seeds:
        for a in ARMS:
            run = NamedRun(TASK, a, s, arm_flags(a))
            run.out_dir = str(folder)
            queue.append(run)
    common.launch(args, queue, skip_failed=True)
    done = {(r["arm"], r["seed"]) for r in rows_of(folder)}
    return [f"{a} s{s}" for s in seeds for a in ARMS if (a, s) not in done]


def same_start(out_dir: pathlib.Path, gate: dict[str, Any]) -> None:
    """SystemExit unless every stage already launched in ``out_dir`` (pilot, main) started from the warm start
    ``gate`` names, by its weights' hash: runs from two different starts are never pooled or paired."""
    for stage_file in sorted(out_dir.glob("*/stage.json")):
        earlier = (json.loads(stage_file.read_text()).get("warmstart") or {}).get("weights_sha256")
        if earlier is not None and earlier != gate.get("weights_sha256"):
            raise SystemExit(f"refused: {stage_file.parent.name}'s runs started from warm-start weights "
                             f"{earlier[:12]}…, this warm start is {str(gate.get('weights_sha256'))[:12]}…; lay the "
                             "same warm start again (same card, software and seed) or start a new output folder")


def pilot(args: argparse.Namespace) -> dict[str, Any] | None:
    admitted()
    gate = require_gate(pathlib.Path(args.out_dir), args.force)
    left = launch(args, "pilot", PREREGISTRATION["pilot_seeds"], gate, {})
    if left:
        print(f"pilot: {len(left)} runs not recorded yet (run the same command again); plan.json not written")
        return None
    return plan(pathlib.Path(args.out_dir))


def main_stage(args: argparse.Namespace) -> list[str]:
    admitted()
    out = pathlib.Path(args.out_dir)
    gate = require_gate(out, args.force)
    path = out / "plan.json"
    if not path.exists():
        raise SystemExit(f"no {path}: run --stage pilot until it writes the plan")
    planned = json.loads(path.read_text())
    if planned.get("registration_sha256") != REGISTRATION_SHA256 or not planned.get("go"):
        raise SystemExit(f"the plan says stop ({planned.get('reason')}); the study ends there")
    left = launch(args, "main", planned["seeds"], gate, {"plan_sha256": file_sha256(path)})
    print(f"main: {len(planned['seeds'])} seeds per arm, {len(left)} runs left")
    return left


# ------------------------------------------------------------------------------------------------ analysis
def registration_by_sha256(sha256: str | None) -> dict[str, Any] | None:
    """The committed registration (``results/study_v4/preregistered_long*.json``) whose whole-content hash is
    ``sha256``, parsed: the design the records admitted, whichever revision is current now."""
    for path in sorted(RESULTS.glob("preregistered_long*.json")):
        if sha256 is not None and file_sha256(path) == sha256:
            return json.loads(path.read_text(encoding="utf-8"))
    return None


def area(points: list[tuple[int, float]]) -> float | None:
    """Trapezoid area over the steps divided by their span (the run's mean); None below two steps."""
    points = sorted(dict(points).items())
    if len(points) < 2:
        return None
    total = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(points, points[1:], strict=False))
    return total / (points[-1][0] - points[0][0])


def run_row(record: dict[str, Any], arm: str) -> dict[str, Any]:
    """A record reduced to what the study reads; a crash keeps its exit code and log tail only."""
    row = {"arm": arm, "seed": int(record["seed"]), "complete": bool(record.get("complete")),
           "checkout": record.get("checkout"), "card": record.get("card"), "wall_s": record.get("wall_s"),
           "exit_code": record.get("exit_code")}
    if not row["complete"]:
        return {**row, "crash": (record.get("log_tail") or "")[-400:]}
    drift = (record.get("drift") or {}).get("curve") or []
    ent = [(int(d["step"]), float(d["set_entropy_normalised"])) for d in drift]
    mass = [(int(d["step"]), float(d["set_entropy_normalised"]) * math.exp(float(d["set_logp_mean"])))
            for d in drift]
    series = record.get("series") or {}
    reward = [v for s, v in series.get("step_reward", []) if s <= PREREGISTRATION["pilot_gate"]["reward_first_window"]]
    residual_series = series.get("cancellation/shared_prefix_residual", [])
    residual = [v for _, v in residual_series]
    clipped = {int(step) for step, v in series.get("clip_ratio/region_mean", []) if v > 0}
    split = {"clipped": [v for step, v in residual_series if step in clipped],
             "unclipped": [v for step, v in residual_series if step not in clipped]}
    last = max(drift, key=lambda d: d["step"]) if drift else {}
    first = min(drift, key=lambda d: d["step"]) if drift else {}
    return {**row, "primary": area(ent), "final_entropy": ent[-1][1] if ent else None,
            "step0_entropy": dict(ent).get(0), "step0_set_logp": first.get("set_logp_mean") if first.get("step") == 0
            else None, "curve": [{"step": int(d["step"]), "set_entropy_normalised": float(d["set_entropy_normalised"]),
                                  "set_logp_mean": float(d["set_logp_mean"])} for d in drift],
            "mass_weighted_area": area(mass),
            "set_mass_final": math.exp(last["set_logp_mean"]) if last else None,
            "heldout_after": (record.get("heldout") or {}).get("after"),
            "reward_first": statistics.fmean(reward) if reward else None,
            "residual_mean": statistics.fmean(residual) if residual else None, "residual_by_clipping": split}


def rows_of(folder: pathlib.Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted([*(folder / "runs").glob("*.json"), *(folder / "runs").glob("*.json.gz")]):
        out.append(run_row(common.read_record(str(path)), path.name.split("__")[1]))
    return out


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any] | None:
    """mean over common seeds of a − b, 95% paired t interval, paired SD, the MDE at 80% power (t); None below 2."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b))]
    if len(d) < 2:
        return None
    sd = statistics.stdev(d)
    se, df, mean = sd / math.sqrt(len(d)), len(d) - 1, statistics.fmean(d)
    half = t_ppf(0.975, df) * se
    return {"difference": mean, "low": mean - half, "high": mean + half, "n": len(d), "sd": sd, "mde": mde_t(se, df)}


def seeds_for(pilot_sd: float) -> dict[str, Any]:
    """The registered rule: sd = inflation × pilot SD; the smallest n ≥ 10 with MDE_t(sd / √n, n − 1) ≤ mde, ≤ 48."""
    sd = PREREGISTRATION["sd_inflation"] * pilot_sd
    n = 10
    while n < 48 and mde_t(sd / math.sqrt(n), n - 1) > PREREGISTRATION["mde"]:
        n += 1
    return {"pilot_sd": pilot_sd, "planning_sd": sd, "n": n, "mde_at_n": mde_t(sd / math.sqrt(n), n - 1),
            "capped": mde_t(sd / math.sqrt(n), n - 1) > PREREGISTRATION["mde"]}


def by_arm(rows: list[dict[str, Any]], key: str) -> dict[str, dict[int, float]]:
    return {a: {r["seed"]: r[key] for r in rows if r["arm"] == a and r["complete"] and r.get(key) is not None}
            for a in ARMS}


def plan(out_dir: pathlib.Path) -> dict[str, Any]:
    """The pilot gate and the registered seed rule on the pilot's records -> OUT/plan.json."""
    g = PREREGISTRATION["pilot_gate"]
    rows = rows_of(out_dir / "pilot")
    complete = {a: sum(r["arm"] == a and r["complete"] for r in rows) for a in ARMS}
    rewards = [r["reward_first"] for r in rows if r["complete"] and r["arm"] in ("anchor", "gspo")
               and r["reward_first"] is not None]
    reward = statistics.fmean(rewards) if rewards else None
    prim = by_arm(rows, "primary")
    pilot_pair = paired(prim["mr_w"], prim["gspo"])
    reasons = []
    if any(c < g["min_complete_per_arm"] for c in complete.values()):
        reasons.append(f"complete runs per arm {complete} below {g['min_complete_per_arm']}")
    if reward is None or not g["reward_min"] <= reward <= g["reward_max"]:
        reasons.append(f"pilot mean reward over the first {g['reward_first_window']} steps {reward} outside "
                       f"[{g['reward_min']}, {g['reward_max']}]")
    if pilot_pair is None:
        reasons.append("fewer than 2 complete pilot pairs")
    starts = [r["step0_entropy"] for r in rows if r["complete"]]
    if any(v is None or v < g["start_entropy_min"] for v in starts):
        low = min((v for v in starts if v is not None), default=None)
        reasons.append(f"a pilot run's own step-0 normalised set entropy ({low}, or none logged) is below the start "
                       f"gate's {g['start_entropy_min']}: the runs did not start from the certified warm start")
    result: dict[str, Any] = {"registration_sha256": REGISTRATION_SHA256, "written_at": common.utc_now(),
                              "complete": complete,
                              "reward_first_mean": reward, "pilot_primary_pair": pilot_pair, "go": not reasons,
                              "reason": "; ".join(reasons) or None}
    if pilot_pair is not None:
        rule = seeds_for(pilot_pair["sd"])
        start = PREREGISTRATION["main_seed_start"]
        result.update(rule=rule, seeds=list(range(start, start + rule["n"])))
    common.write_json(out_dir / "plan.json", result)
    return result


def checkouts_in_order(pilot_rows: list[dict[str, Any]], main_rows: list[dict[str, Any]]) -> list[str]:
    """Each distinct (checkout, card) the runs name, in the order the sessions ran them: by the stage (pilot first)
    and the lowest seed each ran, since every session takes the next seeds of the plan."""
    first: dict[str, tuple[int, int]] = {}
    for stage_index, stage_rows in enumerate((pilot_rows, main_rows)):
        for r in stage_rows:
            key = json.dumps({"checkout": r.get("checkout"), "card": r.get("card")}, sort_keys=True)
            first[key] = min(first.get(key, (stage_index, r["seed"])), (stage_index, r["seed"]))
    return sorted(first, key=first.__getitem__)


def analyse(out_dir: pathlib.Path) -> dict[str, Any]:
    """The registered analysis of the main stage: per-arm counts (crashes as crashes), the primary and secondary
    paired comparisons, under the registration the records admitted. Beside it, added after the 2026-11-29 run:
    the plan's coverage, the start check, the residual split by clipping, the per-arm curves, the wall times and the
    checkouts that ran."""
    rows = rows_of(out_dir / "main")
    stage = out_dir / "main" / "stage.json"
    stage_record = json.loads(stage.read_text()) if stage.exists() else None
    admitted_sha = (stage_record or {}).get("registration_sha256")
    out: dict[str, Any] = {"registration_sha256": admitted_sha,
                           "registration_is_current": admitted_sha == REGISTRATION_SHA256,
                           "preregistered": registration_by_sha256(admitted_sha),
                           "arms": arm_counts(rows),
                           "comparisons": {}, "runs": rows}
    for key in ("primary", "final_entropy", "mass_weighted_area", "set_mass_final", "heldout_after"):
        values = by_arm(rows, key)
        out["comparisons"][key] = {f"{a} - {b}": paired(values[a], values[b])
                                   for a, b in (("mr_w", "gspo"), ("anchor", "gspo"), ("mr_w", "anchor"))}
    out["stage"] = stage_record  # the warm start (forced or not), the plan's hash, the launches
    prim = out["comparisons"]["primary"]["mr_w - gspo"]
    out["primary"] = prim
    out["primary_wording"] = None if prim is None else (
        "not detected above the MDE reached" if prim["low"] <= 0 <= prim["high"] else "detected")
    out["residual_mean"] = {a: statistics.fmean(v) if (v := [r["residual_mean"] for r in rows if r["arm"] == a
                                                             and r.get("residual_mean") is not None]) else None
                            for a in ARMS}
    out["residual_by_clipping"] = {  # a meter check: Min-Replace cancels exactly where no row was clipped
        a: {kind: {"steps": len(v), "mean": statistics.fmean(v) if v else None, "max": max(v) if v else None}
            for kind in ("unclipped", "clipped")
            for v in [[x for r in rows if r["arm"] == a and r["complete"]
                       for x in (r.get("residual_by_clipping") or {}).get(kind, [])]]}
        for a in ARMS}
    plan_file = out_dir / "plan.json"
    out["plan"] = json.loads(plan_file.read_text()) if plan_file.exists() else None
    pilot_rows = rows_of(out_dir / "pilot")
    out["pilot_arms"] = arm_counts(pilot_rows)
    out["coverage"] = coverage(out["plan"], rows)
    design = out["preregistered"] or PREREGISTRATION
    out["start_check"] = start_check(out["stage"], {"pilot": pilot_rows, "main": rows},
                                     design["warmstart"]["gate"]["set_entropy_normalised_min"])
    out["curves"] = curves(rows)
    out["wall_s"] = {stage: {a: sorted(float(r["wall_s"]) for r in stage_rows if r["arm"] == a and r["complete"]
                                       and r.get("wall_s") is not None) for a in ARMS}
                     for stage, stage_rows in (("pilot", pilot_rows), ("main", rows))}
    out["provenance"] = checkouts_in_order(pilot_rows, rows)
    out["warmstart_replay"] = warmstart_replay(out_dir)
    out["warmstart_layings"] = warmstart_layings(out_dir)
    out["pilot_curves"] = curves(pilot_rows)
    out["at_a_time"] = {stage: runs_at_a_time(out_dir / f"{stage}.log") for stage in ("pilot", "main")}
    out["exploratory_early_entropy"] = early_entropy(pilot_rows + rows)
    return out


def early_entropy(rows: list[dict[str, Any]], steps: tuple[int, ...] = (10, 20, 30, 40, 50)) -> dict[str, Any]:
    """Exploratory, not registered (added after revision 2's first runs, whose curves part in the first tens of
    steps and meet after): Min-Replace − GSPO in the normalised set entropy at each early drift step, paired by seed
    over every complete run of the pilot and the main stage (their seeds differ, so no pair repeats)."""
    return {str(step): paired(*({r["seed"]: p["set_entropy_normalised"] for r in rows
                                 if r["arm"] == arm and r["complete"] for p in r.get("curve") or []
                                 if p["step"] == step} for arm in ("mr_w", "gspo")))
            for step in steps}


def runs_at_a_time(log: pathlib.Path) -> list[str]:
    """How many runs each launch of a stage kept going at once, as its log's first line states ("... N at a time on
    each of GPUs [0, 1] ..."), one entry per launch (the GPU job appends a later session's launch to the same log):
    "N" on one GPU, their product then "(N on each of K GPUs)" on K > 1 ("18 (9 on each of 2 GPUs)"); the wall
    times depend on the runs per GPU."""
    if not log.exists():
        return []
    out = []
    for m in re.finditer(r"(\d+) at a time on each of GPUs \[([\d, ]*)\]", log.read_text()):
        per_gpu, gpus = int(m.group(1)), len(re.findall(r"\d+", m.group(2))) or 1
        out.append(str(per_gpu) if gpus == 1 else f"{per_gpu * gpus} ({per_gpu} on each of {gpus} GPUs)")
    return out


def warmstart_replay(out_dir: pathlib.Path) -> dict[str, Any] | None:
    """The warm start laid a second time beside the first (OUT/replay/warmstart, the GPU job's REPLAY=1): per epoch
    count, whether the two checkpoints' weights hash the same. A later session can continue the main stage only if
    they do; None when no replay ran."""
    replay = out_dir / "replay" / "warmstart"
    if not replay.is_dir():
        return None
    first = {k: e["weights_sha256"] for k, e in read_laying(out_dir / "warmstart").items()}
    entries = {k: {"first": first.get(k), "replay": e["weights_sha256"],
                   "identical": e["weights_sha256"] is not None and e["weights_sha256"] == first.get(k)}
               for k, e in read_laying(replay).items()}
    return {"entries": entries, "all_identical": bool(entries) and all(e["identical"] for e in entries.values())}


def read_laying(folder: pathlib.Path) -> dict[str, dict[str, Any]]:
    """One laying of the warm start (a ``warmstart/`` folder): each schedule entry's file, by entry name ("e1")."""
    return {path.parent.name: read_jsonl(path) for path in sorted(folder.glob("e*/warmstart.jsonl"))}


LAID_BEFORE = "laid_before"  # OUT/laid_before/<when>/warmstart: an earlier session's laying, moved aside by the GPU job


def warmstart_layings(out_dir: pathlib.Path) -> dict[str, Any] | None:
    """Every laying of the warm start the folder holds: this session's (OUT/warmstart), its replay (OUT/replay/
    warmstart) and each earlier session's (OUT/laid_before/*/warmstart, whose model did not travel): when, on which
    card and source, and each epoch count's weights hash. ``all_identical``: every laying hashes the same per epoch
    count, which is what lets the main stage run across sessions (None below two layings: nothing to compare).
    None without a laying."""
    folders = [out_dir / "warmstart", out_dir / "replay" / "warmstart",
               *sorted((out_dir / LAID_BEFORE).glob("*/warmstart"))]
    layings = []
    for folder in folders:
        entries = read_laying(folder)
        if not entries:
            continue
        header = next(iter(entries.values()))["header"] or {}
        layings.append({"folder": folder.relative_to(out_dir).as_posix(), "started_at": header.get("started_at"),
                        "card": header.get("card"), "source_sha256": (header.get("checkout") or {}).get(
                            "source_sha256"),
                        "weights_sha256": {k: e["weights_sha256"] for k, e in entries.items()}})
    if not layings:
        return None
    per_entry = {k: {lay["weights_sha256"].get(k) for lay in layings} for lay in layings for k in lay["weights_sha256"]}
    same = all(len(v) == 1 and None not in v for v in per_entry.values()) if len(layings) > 1 else None
    return {"layings": layings, "all_identical": same}


def arm_counts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm: runs recorded, complete, and the seeds that crashed."""
    return {a: {"runs": sum(r["arm"] == a for r in rows),
                "complete": sum(r["arm"] == a and r["complete"] for r in rows),
                "crashed": sorted(r["seed"] for r in rows if r["arm"] == a and not r["complete"])} for a in ARMS}


def coverage(planned: dict[str, Any] | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The main stage's planned runs (plan.json's seeds x the arms) against those recorded: complete, crashed, and
    never started (a planned run with no record: not a crash, not a value)."""
    seeds = (planned or {}).get("seeds") or []
    recorded = {(r["arm"], r["seed"]): r["complete"] for r in rows}
    return {"planned": len(seeds) * len(ARMS), "complete": sum(recorded.values()),
            "crashed": sum(not c for c in recorded.values()),
            "not_started": sum((a, s) not in recorded for s in seeds for a in ARMS),
            "complete_pairs_primary": len({r["seed"] for r in rows if r["arm"] == "mr_w" and r["complete"]}
                                          & {r["seed"] for r in rows if r["arm"] == "gspo" and r["complete"]})}


def start_check(stage: dict[str, Any] | None, rows_by_stage: dict[str, list[dict[str, Any]]], threshold: float
                ) -> dict[str, Any]:
    """Did the arms start where the gate measured? The warm start's gate reads its checkpoint in the warm-start
    process; every run reloads that checkpoint and its own drift meter reads the same prompts at step 0. This sets
    the two side by side and re-reads the registered entropy threshold on the runs' step-0 numbers (format mass has
    no step-0 counterpart in a run's record). Added after the 2026-11-29 run found them apart (benchmarks/README.md,
    "Study v4, part 3"); it changes no registered quantity."""
    chosen = next((t for t in ((stage or {}).get("warmstart") or {}).get("tried", [])
                   if t.get("complete") and (t.get("gate") or {}).get("passed")), None)
    gate = (chosen or {}).get("gate") or {}
    out: dict[str, Any] = {"gate": {k: gate.get(k) for k in ("set_entropy_normalised", "set_logp_mean",
                                                               "log_odds_mean", "sampled_reward_mean")},
                           "threshold": threshold, "stages": {}}
    for name, rows in rows_by_stage.items():
        ent = [r["step0_entropy"] for r in rows if r["complete"] and r.get("step0_entropy") is not None]
        logp = [r["step0_set_logp"] for r in rows if r["complete"] and r.get("step0_set_logp") is not None]
        if not ent:
            continue
        out["stages"][name] = {
            "runs": len(ent), "distinct_step0_entropy": len({round(v, 12) for v in ent}),
            "step0_entropy_min": min(ent), "step0_entropy_max": max(ent),
            "step0_set_logp_min": min(logp) if logp else None, "step0_set_logp_max": max(logp) if logp else None,
            "entropy_gap_to_gate": (statistics.fmean(ent) - gate["set_entropy_normalised"])
            if gate.get("set_entropy_normalised") is not None else None,
            "threshold_reread_passed": min(ent) >= threshold}
    return out


def curves(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per arm and drift step, the mean over complete runs of the normalised set entropy and of the set mass
    exp(set_logp), with the number of runs (the long-run curves)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for a in ARMS:
        steps: dict[int, list[dict[str, float]]] = {}
        for r in rows:
            if r["arm"] == a and r["complete"]:
                for point in r.get("curve") or []:
                    steps.setdefault(point["step"], []).append(point)
        out[a] = [{"step": s, "n": len(points),
                   "set_entropy_normalised": statistics.fmean(p["set_entropy_normalised"] for p in points),
                   "set_mass": statistics.fmean(math.exp(p["set_logp_mean"]) for p in points)}
                  for s, points in sorted(steps.items())]
    return out


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> Any:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--preregister", action="store_true")
    mode.add_argument("--stage", choices=["warmstart", "pilot", "main"])
    mode.add_argument("--plan", metavar="OUT_DIR", help="the pilot gate and seed rule again (pilot processes ended)")
    mode.add_argument("--analyse", metavar="OUT_DIR")
    p.add_argument("--model", default=None, help="warmstart: the base model; pilot/main: default the warm start's")
    p.add_argument("--out-dir", default="/tmp/v4long")
    p.add_argument("--force", action="store_true", help="run the arms though the warm-start gate failed (recorded)")
    p.add_argument("--cpu", action="store_true", help="warmstart on the CPU")
    p.add_argument("--recipe", default=str(common.RECIPE))
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--gpus", nargs="*", type=int, default=[])
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--expected-run-s", type=float, default=900.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "study_v4_long.json"))
    p.add_argument("extra", nargs="*", help="further dfpo-train flags after -- (recorded in each run's settings)")
    args = p.parse_args(argv)
    args.steps, args.via_accelerate, args.vllm_memory, args.start_timeout, args.skip_done = STEPS, False, None, 0.0, []
    if args.preregister:
        print(write_registration(REGISTRATION_FILE, PREREGISTRATION))
        return None
    if args.stage == "warmstart":
        if not args.model:
            raise SystemExit("--model (the base model) is required for the warm start")
        return warmstart(args)
    if args.stage == "pilot":
        return pilot(args)
    if args.stage == "main":
        return main_stage(args)
    if args.plan:
        admitted()
        return plan(pathlib.Path(args.plan))
    result = analyse(pathlib.Path(args.analyse))
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
