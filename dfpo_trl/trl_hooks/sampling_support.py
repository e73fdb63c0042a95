"""TRL's vLLM importance-sampling ratio against the support vLLM sampled from
(``vllm_importance_sampling_support="truncated"``).

vLLM samples token t from the tempered distribution p_t truncated to a support S_t (min-p, then top-k, then top-p)
and returns its log-probability renormalised over S_t (TRL asks for ``processed_logprobs``): s_t = log p^v_t(y) −
log K^v_t, with K_t = Σ_{v∈S_t} p_t(v) the kept mass. The trainer scores the untruncated tempered distribution,
ℓ^old_t = log p_t(y), so TRL's ratio exp(ℓ^old − s) carries log K_t ≤ 0 per token beside the engines' mismatch, and
in its sequence modes it falls exponentially with the length (docs/source/concepts/decisions.md). The ratio taken
against the same support on both sides,

    r_t = [p_t(y) / K_t] / [p^v_t(y) / K^v_t] = exp(ℓ^old_t − log K_t − s_t),                                   (S1)

is 1 when the engines agree, whatever the truncation. Its cost is one log K_t per token, from the forward that already
computes ℓ^old (TRL's rollout forward): :class:`KeptMass` reads that forward's LM-head input h, forms the tempered
logits as TRL's fused head forms them for ℓ^old (its head and transform, h Wᵀ multiplied in the dtype its kernel
multiplies in: bf16 under bf16 mixed precision, :func:`~dfpo_trl.trl_hooks.lm_head.trl_head_dtype`), rebuilds S_t in
vLLM's order on those logits rounded to the head's dtype where they are wider, weighs it with the p of the same
logits (:func:`kept_log_mass`), and hands TRL ℓ^old − log K for its ratio,
so TRL's own four modes, bounds and metrics apply to (S1) unchanged. Afterwards :func:`finish_rollout` puts TRL's
untruncated ℓ^old back (the policy ratio's π_old stays untruncated) and writes the sampler's log-probs on the same
untruncated scale, s + log K (what TRL's off-policy mask compares with ℓ(θ)), and logs the untruncated ratio beside
TRL's.

The support is rebuilt from the trainer's logits (vLLM's PyTorch reference, ``apply_top_k_top_p_pytorch`` and its min-p
processor), rounded to the LM head's dtype first, as vLLM's head returns them (:func:`engine_logits`); vLLM ≥ 0.28 can
return its own mask (``--return-sampling-mask``), which TRL 1.16 does not pass on (docs/source/guides/vllm.md, "Which
correction")."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .compat import _incompatible, bind_call
from .lm_head import fused_lm_head, gathered_for_reading, head_logits, lm_head_input_module, trl_head_dtype

__all__ = [
    "FULL_RATIO_METRIC",
    "KEPT_MASS_METRIC",
    "KeptMass",
    "SamplingSupport",
    "engine_logits",
    "finish_rollout",
    "kept_log_mass",
    "rollout_kept_mass",
    "sampling_support",
]

SEQUENCE_MODES = ("sequence_mask", "sequence_truncate")  # TRL's vLLM modes whose ratio is one per row

# What the truncated support's ratio logs beside TRL's ``sampling/importance_sampling_ratio/*`` (which then holds
# (S1)): the untruncated ratio exp(ℓ^old − s), as TRL's correction alone computes it, and the mean log K_t per token.
FULL_RATIO_METRIC = "sampling/importance_sampling_ratio_full"
KEPT_MASS_METRIC = "sampling/log_kept_mass/mean"
POSITIONS_PER_PASS = 1 << 26  # logits elements (positions × vocabulary) per float32 pass: 256 MiB


class SamplingSupport(NamedTuple):
    """The truncation vLLM applies after the temperature, in its order: min-p, top-k, top-p."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def sampling_support(temperature: float, top_k: int | None, top_p: float | None, min_p: float | None,
                     generation_kwargs: Mapping[str, Any] | None = None) -> SamplingSupport:
    """The support vLLM samples from under TRL's settings: TRL passes ``generation_kwargs`` to vLLM after its own
    top-k / top-p / min-p, so those keys there win."""
    extra = dict(generation_kwargs or {})
    top_k = extra.get("top_k", top_k)
    top_p = extra.get("top_p", top_p)
    min_p = extra.get("min_p", min_p)
    return SamplingSupport(float(temperature), int(top_k or 0) if (top_k or 0) > 0 else 0,
                           1.0 if top_p is None else float(top_p), float(min_p or 0.0))


def kept_log_mass(logits: Tensor, support: SamplingSupport, support_logits: Tensor | None = None) -> Tensor:
    """log K = log Σ_{v∈S} p(v) for tempered ``logits`` (P, V), S the support vLLM samples from; (P,), 0 untruncated.

    vLLM's order: min-p keeps p(v) ≥ min_p · max_v p(v); top-k keeps the logits at or above the k-th largest (ties
    kept); top-p, on the distribution renormalised over what is left, sorts it ascending and drops every token whose
    running mass is ≤ 1 − top_p, the largest always kept. S is decided on ``support_logits`` (default ``logits``):
    the engine's own tempered logits where they differ from the trainer's, as vLLM's head returns them in the model's
    dtype (:func:`engine_logits`). K is the kept tokens' mass under the untruncated p of ``logits``."""
    z = logits.float() if logits.dtype != torch.float64 else logits
    total = torch.logsumexp(z, dim=-1)
    if not support.truncates:
        return torch.zeros_like(total)
    decide = z if support_logits is None else support_logits.to(z.dtype)
    if support.min_p > 0.0:
        probs = torch.softmax(decide, dim=-1)
        decide = decide.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * support.min_p, float("-inf"))
    vocabulary = z.size(-1)
    if 0 < support.top_k < vocabulary:
        kth = torch.topk(decide, support.top_k, dim=-1).values[..., -1:]
        decide = decide.masked_fill(decide < kth, float("-inf"))
    if support.top_p >= 1.0:
        return torch.logsumexp(z.masked_fill(decide == float("-inf"), float("-inf")), dim=-1) - total
    # the candidates, descending: the finite logits (ties at the k-th kept), as many as the widest row holds
    width = int((decide > float("-inf")).sum(-1).max()) if support.top_k > 0 or support.min_p > 0 else vocabulary
    top = torch.topk(decide, max(width, 1), dim=-1)
    ascending, order = top.values.flip(-1), top.indices.flip(-1)
    running = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    dropped = running <= 1.0 - torch.tensor(support.top_p, dtype=running.dtype)
    dropped[..., -1] = False
    kept = z.gather(-1, order).masked_fill(dropped | (ascending == float("-inf")), float("-inf"))
    return torch.logsumexp(kept, dim=-1) - total


def engine_logits(logits: Tensor, temperature: float, dtype: torch.dtype | None) -> Tensor | None:
    """The tempered logits vLLM decides its support on, from the trainer's untempered float32 ``logits``: vLLM's
    head returns them in the model's ``dtype`` and its sampler casts them to float32 before the temperature, so a
    16-bit model's support is decided on logits rounded to 16 bits (ties at the k-th included). None for a 32- or
    64-bit ``dtype`` (the trainer's logits are the engine's)."""
    if dtype is None or torch.finfo(dtype).bits >= 32:
        return None
    return logits.to(dtype).to(logits.dtype) / temperature


def hidden_log_mass(hidden: Tensor, head: Any, support: SamplingSupport,
                    engine_dtype: torch.dtype | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """log K_t of each position of ``hidden`` (…, d), through the head TRL's fused head projects with, h Wᵀ
    multiplied in ``dtype`` (:func:`~dfpo_trl.trl_hooks.lm_head.head_logits`), in passes of
    :data:`POSITIONS_PER_PASS` logits; the support decided as vLLM running in ``engine_dtype`` decides it (logits
    multiplied in that dtype already are the engine's: no rounding)."""
    flat = hidden.reshape(-1, hidden.size(-1))
    step = max(1, POSITIONS_PER_PASS // head.weight.size(0))
    engine_dtype = None if dtype is not None and dtype == engine_dtype else engine_dtype
    out = []
    for i in range(0, flat.size(0), step):
        logits = head_logits(flat[i:i + step], head, 1.0, dtype)
        out.append(kept_log_mass(logits / support.temperature, support,
                                 engine_logits(logits, support.temperature, engine_dtype)))
    return (torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)).reshape(hidden.shape[:-1])


class KeptMass:
    """Around one call of TRL's ``_get_per_token_logps_and_entropies`` (its rollout forward): log K_t of every
    completion token from the LM head's input, computed per chunk as the chunk passes (nothing of h is kept), and
    ℓ^old − log K handed back to TRL in place of ℓ^old (module docstring, eq. S1)."""

    def __init__(self, support: SamplingSupport, cast_lm_head_to_fp32: bool = False) -> None:
        self.support = support
        self.cast_lm_head_to_fp32 = cast_lm_head_to_fp32  # TRL's field: its head multiplies in float32
        self.old: Tensor | None = None  # TRL's untruncated ℓ^old, as its forward returned it
        self.log_mass: Tensor | None = None  # (B, T), 0 outside the completion

    @property
    def done(self) -> bool:
        return self.log_mass is not None

    def run(self, model: torch.nn.Module, arguments: tuple[tuple[Any, ...], dict[str, Any]],
            forward: Callable[[], Any]) -> Any:
        """``model`` the unwrapped policy, ``arguments`` the call's (args, kwargs), ``forward`` the call itself."""
        call = bind_call("_get_per_token_logps_and_entropies", *arguments[0], **arguments[1])
        keep, attention = int(call["logits_to_keep"]), call["attention_mask"]
        backbone = lm_head_input_module(model, "vllm_importance_sampling_support='truncated'")
        head = fused_lm_head(model)
        chunks: list[Tensor] = []

        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            # completion token t is predicted from hidden position S − 1 − T + t (TRL shifts its labels by one)
            with torch.no_grad(), gathered_for_reading(head.weight, head.bias):
                # the logits TRL scores ℓ^old with (its kernel's dtype, autocast's under mixed precision); the
                # support as vLLM decides it for a policy of the head's dtype (engine_logits)
                chunks.append(hidden_log_mass(h[:, -(keep + 1):-1].detach(), head, self.support, head.weight.dtype,
                                              trl_head_dtype(h, self.cast_lm_head_to_fp32)))

        handle = backbone.register_forward_hook(hook)
        try:
            out = forward()
        finally:
            handle.remove()
        if not chunks:
            raise RuntimeError("vllm_importance_sampling_support='truncated': the rollout forward never reached the "
                               "LM head's input module.")
        old = out[0]
        log_mass = torch.cat(chunks, dim=0).to(device=old.device, dtype=old.dtype)
        self.log_mass = log_mass.masked_fill(attention[:, -keep:].to(old.device) == 0, 0.0)
        self.old = old
        return (old - self.log_mass, *out[1:])


def rollout_kept_mass(trainer: Any) -> KeptMass | None:
    """A :class:`KeptMass` for the next rollout of ``trainer`` (a DFPOTrainer) when it takes TRL's ratio against the
    truncated support and vLLM truncates; None otherwise (log K = 0: TRL's ratio is (S1) as it stands)."""
    if trainer.args.vllm_importance_sampling_support != "truncated" or not (
        trainer.use_vllm and trainer.vllm_importance_sampling_correction
    ):
        return None
    support = sampling_support(trainer.temperature, trainer.top_k, trainer.top_p, trainer.min_p,
                               trainer.args.generation_kwargs)
    return KeptMass(support, bool(trainer.args.cast_lm_head_to_fp32)) if support.truncates else None


def full_ratio(old: Tensor, sampling: Tensor, mask: Tensor, sequence_level: bool) -> Tensor:
    """TRL's untruncated ratio before its bounds: exp(Σ_t (ℓ^old − s)) per row (B, 1) in the sequence modes, per token
    (B, T) in the token modes; tokens vLLM could not score (NaN) count 0, as in TRL."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    return torch.exp(diff.sum(-1, keepdim=True) if sequence_level else diff)


def finish_rollout(output: dict[str, Any], kept: KeptMass, mask: Tensor, mode: str, trl_mode: str,
                   store: Any) -> None:
    """After TRL's rollout computed its ratio from ℓ^old − log K: TRL's ℓ^old back into ``output`` (bit for bit),
    the sampler's log-probs on the untruncated scale (s + log K), and into ``store`` (a
    :class:`~dfpo_trl.metrics.store.MetricStore`) the untruncated ratio's min / mean / max over what TRL's ratio
    metrics cover (rows in TRL's sequence modes, loss tokens in its token modes, ``trl_mode``) and the mean log K_t
    over loss tokens."""
    if kept.old is None or kept.log_mass is None:
        if "importance_sampling_ratio" in output:
            raise _incompatible(
                "GRPOTrainer._generate_and_score_completions computed its vLLM importance-sampling ratio without its "
                "rollout forward through _get_per_token_logps_and_entropies, where "
                "vllm_importance_sampling_support='truncated' takes log K out of the old log-probs"
            )
        return
    sequence_level = trl_mode in SEQUENCE_MODES
    output["old_per_token_logps"] = kept.old
    sampling = output.get("sampling_per_token_logps")
    if sampling is None:
        return
    output["sampling_per_token_logps"] = sampling + kept.log_mass
    ratio = full_ratio(kept.old, sampling, mask, sequence_level)
    values = ratio.reshape(-1) if sequence_level else ratio[mask.bool()]
    count = torch.tensor(float(values.numel()), device=values.device)
    inf = torch.tensor(math.inf, device=values.device)
    store.add_mean(mode, f"{FULL_RATIO_METRIC}/mean", values.double().sum(), count)
    store.add_min(mode, f"{FULL_RATIO_METRIC}/min", values.min() if values.numel() else inf, count)
    store.add_max(mode, f"{FULL_RATIO_METRIC}/max", values.max() if values.numel() else -inf, count)
    tokens = mask.bool()
    store.add_mean(mode, KEPT_MASS_METRIC, kept.log_mass[tokens].double().sum(), tokens.sum().double())
