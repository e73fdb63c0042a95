"""What TRL 1.16's fused LM head reads, for the metrics and weights that need it (DelTA, eq. 24 energy).

TRL's ``add_fused_lm_head`` replaces the logits with per-token log-probabilities computed in tiles, so h (the
backbone output the head projects) and the head's logit transform are not visible to a trainer. This module
holds the shared pieces:

* :func:`lm_head_input_module` and :class:`HiddenCapture`: a forward hook on the backbone whose
  ``last_hidden_state`` the fused head consumes, keeping the completion positions of one policy forward
  (DelTA's rollout forward, docs/source/concepts/delta.md; the energy metric's training forward,
  docs/source/concepts/metrics.md);
* :func:`fused_lm_head`: the head's weight and bias and the logit transform TRL applies before its
  temperature (``logit_scale`` and ``final_logit_softcapping``, read as ``add_fused_lm_head`` reads them);
* :func:`head_logits` and :func:`trl_head_dtype`: the logits that head scores with, multiplied in the dtype TRL's
  kernel multiplies in;
* :func:`gathered_for_reading`: a read-only DeepSpeed ZeRO-3 gather of partitioned head parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
from accelerate.utils import is_peft_model
from torch import Tensor

from .compat import bind_call


def lm_head_input_module(model: torch.nn.Module, purpose: str = "token_weighting='delta'") -> torch.nn.Module:
    """The backbone whose ``last_hidden_state`` TRL's fused LM head projects (``model.base_model`` of the
    causal LM, as ``trl.trainer.utils.add_fused_lm_head`` looks it up); PEFT wrappers are looked through.
    Its output is the final norm's output, the h of DelTA's proxy (1 − p) h and of the LM-head gradient
    h (e_y − p)ᵀ. ``purpose`` names the option that needs it in the error message."""
    inner = model.get_base_model() if is_peft_model(model) else model
    backbone = getattr(inner, "base_model", None)
    if not isinstance(backbone, torch.nn.Module) or backbone is inner:
        raise ValueError(
            f"{purpose} needs a causal LM with a backbone (`base_model`) feeding its LM head; "
            f"{type(inner).__name__} has none."
        )
    return backbone


class HiddenCapture:
    """Collects the completion positions' final hidden states of one policy log-prob forward (per chunk).

    After :meth:`run`, ``hidden`` is (B, T, d), detached, aligned with TRL's per-token log-probs, and ``logps``
    the forward's detached log-probs.
    """

    def __init__(self, purpose: str = "token_weighting='delta'") -> None:
        self.purpose = purpose
        self.chunks: list[Tensor] = []
        self.hidden: Tensor | None = None
        self.logps: Tensor | None = None

    @property
    def done(self) -> bool:
        return self.hidden is not None

    def run(self, module: torch.nn.Module, logits_to_keep: int, forward: Callable[[], Any]) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            # log_probs[:, j] is predicted from hidden position j (TRL shifts labels by one), and TRL keeps the
            # last logits_to_keep of them: completion token t <-> hidden position S - 1 - T + t.
            self.chunks.append(h[:, -(logits_to_keep + 1) : -1].detach().clone())

        handle = module.register_forward_hook(hook)
        try:
            out = forward()
        finally:
            handle.remove()
        if not self.chunks:
            raise RuntimeError(f"{self.purpose}: the policy forward never reached the hooked backbone.")
        self.hidden = torch.cat(self.chunks, dim=0)
        self.chunks = []
        self.logps = out[0].detach()
        return out


def capture_log_prob_forward(
    capture: HiddenCapture, model: torch.nn.Module, arguments: tuple[tuple[Any, ...], dict[str, Any]],
    forward: Callable[[], Any],
) -> Any:
    """Run one call of TRL's ``_get_per_token_logps_and_entropies`` (``forward``) with ``capture`` hooked on the
    backbone its fused head reads. ``model`` is the unwrapped policy; ``arguments`` the call's (args, kwargs), whose
    ``logits_to_keep`` is read by name. The one wiring DelTA's rollout forward and the energy metric share."""
    args, kwargs = arguments
    logits_to_keep = bind_call("_get_per_token_logps_and_entropies", *args, **kwargs)["logits_to_keep"]
    return capture.run(lm_head_input_module(model, capture.purpose), int(logits_to_keep), forward)


class FusedHead(NamedTuple):
    """The LM head TRL's fused head projects with, and its logit transform before the temperature:
    logits = softcap · tanh(logit_scale · (h Wᵀ + b) / softcap) / temperature (no tanh when softcap is None)."""

    weight: Tensor
    bias: Tensor | None
    logit_scale: float
    final_logit_softcapping: float | None


def trl_head_dtype(hidden: Tensor, cast_lm_head_to_fp32: bool = False) -> torch.dtype:
    """The dtype TRL 1.16's fused head multiplies h Wᵀ in (``trl.kernels.ChunkedLogProbFunction``): float32 under
    ``cast_lm_head_to_fp32``, else autocast's dtype where autocast is on (bf16 mixed precision), else ``hidden``'s."""
    if cast_lm_head_to_fp32:
        return torch.float32
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


def head_logits(hidden: Tensor, head: FusedHead, temperature: float, dtype: torch.dtype | None = None) -> Tensor:
    """The tempered logits TRL's fused head scores ``hidden`` (…, d) with: h Wᵀ + b multiplied in ``dtype`` (default
    float32, float64 for float64 input; :func:`trl_head_dtype` for TRL's own), then in float32 (float64) softcap ·
    tanh(logit_scale · z / softcap) / temperature, no tanh without softcapping. Autocast is off inside, so ``dtype``
    is the one that multiplies."""
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    dtype = wide if dtype is None else dtype
    with torch.autocast(hidden.device.type, enabled=False):
        z = hidden.to(dtype) @ head.weight.detach().to(dtype).T
        if head.bias is not None:
            z = z + head.bias.detach().to(dtype)
    z = z.to(wide) * head.logit_scale
    if head.final_logit_softcapping is not None:
        z = torch.tanh(z / head.final_logit_softcapping) * head.final_logit_softcapping
    return z / temperature


def fused_lm_head(model: torch.nn.Module) -> FusedHead:
    """The head and transform of the (unwrapped, possibly PEFT) policy, read as TRL 1.16's ``add_fused_lm_head``
    reads them: the base model's ``get_output_embeddings()`` weight and bias (a LoRA wrapper on the head is
    looked through, as TRL's kernel does), ``final_logit_softcapping``, and the first of ``logit_scale``,
    ``output_multiplier``, ``lm_head_multiplier``, 1 / ``logits_scaling`` (× for HyperCLOVA X), else 1."""
    inner = model.get_base_model() if is_peft_model(model) else model
    head = inner.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(inner).__name__} has no output embeddings (LM head) with a weight.")
    text_config = inner.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    scale = 1.0 if scale is None else float(scale)
    return FusedHead(head.weight, getattr(head, "bias", None), scale, None if softcap is None else float(softcap))


def gathered_for_reading(*params: Tensor | None) -> AbstractContextManager[Any]:
    """Read-only gather of DeepSpeed ZeRO-3 partitioned parameters (``GatheredParameters(...,
    modifier_rank=None)``: nothing is written back). Only parameters that are ZeRO-3 ones (``ds_id``) and not
    already available are gathered; otherwise a null context. Every process must enter it the same number of
    times (the gather is collective)."""
    zero3 = {id(p): p for p in params if p is not None and hasattr(p, "ds_id")}
    if not zero3:
        return nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    missing = [p for p in zero3.values() if p.ds_status != ZeroParamStatus.AVAILABLE]
    if not missing:
        return nullcontext()
    return deepspeed.zero.GatheredParameters(missing, modifier_rank=None)
