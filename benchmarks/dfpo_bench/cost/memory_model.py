"""GPU memory per process on paper: the Qwen3-32B recipe under ZeRO-3, anchored by the measured Qwen3-8B LoRA run.

    python -m dfpo_bench.cost.memory_model --anchor benchmarks/results/users_size_8b_lora.json \\
        --out benchmarks/results/memory_model.json

Every figure here is ESTIMATED from the architecture and the batch, except the anchor's measured peak. The model:

* parameters P from the architecture (embedding, untied LM head, per layer q/k/v/o, the SwiGLU MLP, norms);
* ZeRO-3 over N processes with bf16 mixed precision (DeepSpeed): bf16 parameters (2 B), bf16 gradients (2 B) and
  fp32 master weights + Adam's two moments (12 B) per parameter, each sharded over N; with the optimizer offloaded
  to the CPU, its 12 B leave the GPU. Working set: the gathered parameters DeepSpeed keeps live
  (``stage3_max_live_parameters``, 1e9 by default, 2 GB in bf16) plus the gathered LM head or embedding (V·h·2 B);
* activations of one micro-batch of b sequences of T tokens with gradient checkpointing: the checkpointed input of
  every layer (L·b·T·h·2 B), plus one layer recomputed during its backward (its bf16 intermediates and their
  gradients: 2 · b·T·(5h + 3·n_heads·d + 3·n_kv·d + 3·i) · 2 B, flash attention: nothing quadratic in T), plus the
  completion tokens' logits in bf16 (b·T_c·V·2 B) and one float32 copy of them for the log-softmax (b·T_c·V·4 B)
  — TRL 1.16's ``selective_log_softmax`` loops over rows, so the float32 copy is one row's at a time: b = 1 here;
* the 8B LoRA anchor: the same terms for one process without ZeRO (bf16 weights, LoRA adapters in float32 with
  gradient and Adam state, 16 B per adapter parameter), compared with the run's measured peak less the colocated
  engine's allocation.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    def parameters(self) -> int:
        h, d = self.hidden, self.head_dim
        attention = h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 2 * d  # q, o; k, v; q/k norms
        mlp = 3 * h * self.intermediate
        per_layer = attention + mlp + 2 * h
        embedding = self.vocab * h * (1 if self.tied else 2)
        return self.layers * per_layer + embedding + h

    def lora_parameters(self, rank: int) -> int:
        """LoRA of rank r on q, k, v, o, gate, up, down: r·(in + out) per module."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = rank * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))
        return self.layers * per_layer


QWEN3_32B = Shape(5120, 25600, 64, 64, 8, 128, 151936, False)
QWEN3_8B = Shape(4096, 12288, 36, 32, 8, 128, 151936, False)


def activations(shape: Shape, batch: int, tokens: int, completion: int) -> dict[str, float]:
    """Bytes of one micro-batch's activations with gradient checkpointing (see the module docstring)."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    checkpoints = shape.layers * batch * tokens * h * 2
    one_layer = 2 * batch * tokens * (5 * h + 3 * q + 3 * kv + 3 * i) * 2
    logits = batch * completion * shape.vocab * 2 + completion * shape.vocab * 4
    return {"checkpoints": checkpoints, "one_layer_recomputed": one_layer, "logits": logits}


def zero3_per_gpu(shape: Shape, processes: int, batch: int, tokens: int, completion: int,
                  offload_optimizer: bool) -> dict[str, float]:
    params = shape.parameters()
    out = {
        "parameters_bf16": 2 * params / processes,
        "gradients_bf16": 2 * params / processes,
        "optimizer_fp32": 0.0 if offload_optimizer else 12 * params / processes,
        "gathered_working_set": 2 * 1e9 + 2 * shape.vocab * shape.hidden,
        **activations(shape, batch, tokens, completion),
    }
    out["total"] = sum(out.values())
    return {k: v / GB for k, v in out.items()}


def lora_single_gpu(shape: Shape, rank: int, batch: int, tokens: int, completion: int) -> dict[str, float]:
    out = {"weights_bf16": 2 * shape.parameters(), "lora_fp32_with_grad_and_adam": 16 * shape.lora_parameters(rank),
           **activations(shape, batch, tokens, completion)}
    out["total"] = sum(out.values())
    return {k: v / GB for k, v in out.items()}


def anchor(path: pathlib.Path) -> dict[str, Any]:
    """The 8B LoRA run's measured peak (trainer = peak allocated less the engine's own allocation) against the model."""
    run = json.loads(path.read_text())
    config = run["config"]
    batch, completion = config["per_device_train_batch_size"], config["max_completion_length"]
    prompt = 48  # the arithmetic task's chat-templated prompts are about 40 tokens: padded batch width, ESTIMATED
    predicted = lora_single_gpu(QWEN3_8B, 32, batch, prompt + completion, completion)
    peaks = [r["peak_allocated_gib"] * 2**30 / GB for rnd in run["rounds"] for r in rnd["runs"].values()
             if r.get("peak_allocated_gib") and not r["crash"]]
    engine = run["engine"]["allocated_gib"] * 2**30 / GB
    measured = max(peaks) - engine if peaks else None
    return {"run": str(path), "card": run["card"], "engine_allocated_gb": engine,
            "measured_trainer_peak_gb": measured, "predicted_gb": predicted,
            "measured_over_predicted": None if measured is None else measured / predicted["total"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", type=pathlib.Path, help="users_size.py's JSON of the 8B LoRA run")
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args()
    result: dict[str, Any] = {"estimated": True, "qwen3_32b": asdict(QWEN3_32B),
                              "parameters": QWEN3_32B.parameters(), "launches": []}
    prompt = 2048
    for completion in (30720, 6144):  # the recipe's 32k context, and 8k
        for processes, name in ((32, "4x8 (32 processes)"), (8, "one node (8 processes)")):
            for offload in (False, True):
                per_gpu = zero3_per_gpu(QWEN3_32B, processes, 1, prompt + completion, completion, offload)
                result["launches"].append({
                    "launch": name, "context": prompt + completion, "offload_optimizer": offload,
                    "per_gpu_gb": per_gpu, "fits_80gb": per_gpu["total"] < 80 * 0.92,
                    "fits_141gb": per_gpu["total"] < 141 * 0.92,
                })
    if args.anchor:
        result["anchor_8b_lora"] = anchor(args.anchor)
        ratio = result["anchor_8b_lora"]["measured_over_predicted"]
        result["anchor_note"] = ("measured/predicted of the 8B LoRA trainer; the 32B figures are the model's, "
                                 "not scaled by it" if ratio else "no measured peak in the anchor")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for launch in result["launches"]:
        g = launch["per_gpu_gb"]
        print(f"{launch['launch']:24s} ctx {launch['context']:6d} offload {launch['offload_optimizer']!s:5s} "
              f"total {g['total']:6.1f} GB (params {g['parameters_bf16']:.1f}, grads {g['gradients_bf16']:.1f}, "
              f"optim {g['optimizer_fp32']:.1f}, act {g['checkpoints'] + g['one_layer_recomputed']:.1f}, "
              f"logits {g['logits']:.1f})")
    if "anchor_8b_lora" in result:
        a = result["anchor_8b_lora"]
        print(f"8B LoRA anchor: measured {a['measured_trainer_peak_gb']} GB vs predicted "
              f"{a['predicted_gb']['total']:.1f} GB")


if __name__ == "__main__":
    main()
