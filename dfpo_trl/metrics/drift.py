"""Equivalent-solution drift: how the policy splits probability among answers the reward treats alike.

The DFPO paper's Corollary 3.2 (and its Appendix A.3 toy) predicts that a sequence-coupled group objective moves the
log-odds between two equally rewarded completions y_a, y_b of one prompt by η c (κ(y_a) − κ(y_b)) per update
(its eq. 5 and 41): a difference in their sequence weights, not in their reward, so it accumulates until one surface
form takes the equivalent set's mass (entropy collapse on that set). This module measures that on fixed prompts
whose correct answer can be written in K ≥ 2 equivalent forms (a task's ``equivalent_forms``;
docs/source/concepts/metrics.md, "Equivalent-solution drift", defines D1–D4):

* D1, log-odds:   o(x) = log π(y_1 | x) − log π(y_2 | x)                       (the quantity of eq. 5 / 41)
* D2, spread:     Δ(x) = max_f log π(y_f | x) − min_f log π(y_f | x)           (= |o(x)| for K = 2)
* D3, set entropy: H(x) = −Σ_f q_f log q_f,  q_f = π(y_f | x) / Σ_g π(y_g | x)  (h(p_k) of the proof for K = 2)
* D4, set mass:   M(x) = log Σ_f π(y_f | x)                                     (whether the set itself gains mass)

Everything here is a pure function of tensors except :func:`completion_log_probs`, which runs one no-grad forward of
a causal LM over (prompt, completion) pairs, and :func:`end_token_ids`, which reads the end tokens TRL stops at.

A canonical completion y_f is the form's text followed by an end token: a sampled completion ends at the first of
TRL's end tokens (the tokenizer's ``eos_token_id`` and the generation config's), so π(y_f | x) sums over them:
π(text_f | x) · Σ_e π(e | x, text_f) (docs/source/concepts/metrics.md, "Equivalent-solution drift").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "chat_end_of_turn_token",
    "completion_log_probs",
    "end_token_ids",
    "end_token_mismatch",
    "equivalent_set_stats",
    "summarise_equivalent_sets",
]


def _generation_eos_ids(model: Any) -> list[int]:
    generation_config = getattr(model, "generation_config", None)
    declared = getattr(generation_config, "eos_token_id", None)
    return [declared] if isinstance(declared, int) else [i for i in declared or [] if i is not None]


def end_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """The token ids that end a sampled completion, as TRL's trainer lists them: the tokenizer's ``eos_token_id``,
    then the model's generation config's (TRL's ``GRPOTrainer.eos_token_ids``: generation stops at any of them, and
    the completion mask ends there)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token_id: a completion's end cannot be scored")
    ids = [tokenizer.eos_token_id]
    return ids + [i for i in _generation_eos_ids(model) if i not in ids]


def chat_end_of_turn_token(tokenizer: Any) -> str | None:
    """The special token the chat template closes an assistant turn with (ChatML's ``<|im_end|>``), or None.

    Found by rendering a two-turn conversation whose assistant text is a marker and reading which of the
    tokenizer's added tokens the template writes right after it (the longest that fits)."""
    marker = "dfpo-end-of-turn-marker"
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # no template, or one that cannot render an assistant turn: no end-of-turn token
        return None
    if not isinstance(text, str) or marker not in text:
        return None
    after = text[text.rindex(marker) + len(marker):]
    matches = [token for token in map(str, tokenizer.get_added_vocab()) if token and after.startswith(token)]
    return max(matches, key=len) if matches else None


def end_token_mismatch(tokenizer: Any, model: Any) -> str | None:
    """A warning when the tokenizer's end token is neither the chat template's end-of-turn token (when the template
    has one) nor among the model's generation config's end tokens, else None. That is the GGUF reader's fault of
    transformers 5.17 (``<|im_start|>`` for SmolLM2's ``<|im_end|>``); the template check still sees it after
    transformers' Trainer has aligned the generation config to the tokenizer. The meter stays right (it scores
    every end token TRL stops at), but the run's completions and their mask may end at a token the model was not
    trained to end a turn with."""
    eos = tokenizer.eos_token
    end_of_turn = chat_end_of_turn_token(tokenizer)
    declared = _generation_eos_ids(model)
    if end_of_turn is not None and end_of_turn != eos:
        problem = f"the chat template ends a turn with {end_of_turn!r}"
    elif declared and tokenizer.eos_token_id not in declared:
        problem = f"the model's generation config ends with eos_token_id={declared} " \
                  f"({tokenizer.convert_ids_to_tokens(declared)})"
    else:
        return None
    return (
        f"the tokenizer's end token is {eos!r} (id {tokenizer.eos_token_id}) but {problem}; completions stop at "
        "every end token TRL lists, and the completion mask ends at the first. Set tokenizer.eos_token to the "
        "model's end-of-turn token (the embedded model's conversion does: dfpo_trl.cli.embedded.align_end_token)."
    )


def equivalent_set_stats(logps: Tensor) -> dict[str, Tensor]:
    """Per-prompt D1–D4 from ``logps`` (P, K), K ≥ 2: log π(y_f | x_p) of each prompt's K equivalent completions.

    Returns ``log_odds`` (P,) (D1, form 0 against form 1), ``spread`` (P,) (D2), ``entropy`` (P,) (D3, nats, at most
    log K) and ``set_logp`` (P,) (D4). Computed in float64 from log-probabilities, so completions far below float
    resolution (log π of −200) still give exact odds.
    """
    if logps.dim() != 2 or logps.size(1) < 2:
        raise ValueError(f"logps must have shape (prompts, forms) with at least 2 forms, got {tuple(logps.shape)}")
    if not torch.isfinite(logps).all():
        raise ValueError("logps must be finite: a completion the model cannot produce has no defined odds")
    values = logps.double()
    log_q = torch.log_softmax(values, dim=1)
    return {
        "log_odds": values[:, 0] - values[:, 1],
        "spread": values.max(dim=1).values - values.min(dim=1).values,
        "entropy": -(log_q.exp() * log_q).sum(dim=1),
        "set_logp": torch.logsumexp(values, dim=1),
    }


def summarise_equivalent_sets(logps: Tensor) -> dict[str, float]:
    """The logged drift metrics of one measurement: D1–D4 pooled over prompts.

    ``log_odds_abs_mean`` / ``log_odds_abs_std`` are the mean and (population) standard deviation over prompts of
    the spread D2 (|o| for two forms), ``log_odds_mean`` the signed mean of D1 (which form is winning),
    ``set_entropy`` the mean of D3 and ``set_entropy_normalised`` that over log K (1 = the forms equally likely, 0 =
    one form has all of the set's mass), ``set_logp_mean`` the mean of D4.

    Args:
        logps: (P, K) log π(y_f | x_p), K ≥ 2, finite.

    Returns:
        The six metrics above, as floats.
    """
    stats = equivalent_set_stats(logps)
    spread = stats["spread"]
    forms = logps.size(1)
    return {
        "log_odds_abs_mean": spread.mean().item(),
        "log_odds_abs_std": spread.std(unbiased=False).item(),
        "log_odds_mean": stats["log_odds"].mean().item(),
        "set_entropy": stats["entropy"].mean().item(),
        "set_entropy_normalised": stats["entropy"].mean().item() / math.log(forms),
        "set_logp_mean": stats["set_logp"].mean().item(),
    }


@torch.no_grad()
def completion_log_probs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    completions: Sequence[str],
    *,
    temperature: float = 1.0,
    batch_size: int = 32,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    end_ids: Sequence[int] | None = None,
) -> Tensor:
    """log π(completion, end | prompt) of each pair: the completion's tokens, then any one of the end tokens.

    ``prompts`` are conversational (a list of messages, rendered with the chat template and its generation prompt, as
    TRL renders them) or plain strings; each completion is tokenized on its own and followed by an end token, the
    token that ends a sampled completion: ``end_ids`` (:func:`end_token_ids`, what TRL stops at; default the
    tokenizer's EOS), whose probabilities are summed (log-sum-exp) since a sampled completion ends at whichever comes.
    Logits are divided by ``temperature`` before the softmax, as TRL samples and computes the policy's
    log-probabilities. Runs in eval mode and restores the model's mode. Returns a float64 tensor (len(prompts),) on
    the CPU.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions")
    if end_ids is None:
        end_ids = end_token_ids(tokenizer)
    if not end_ids:
        raise ValueError("end_ids is empty: a completion's end cannot be scored")
    rendered = [
        prompt
        if isinstance(prompt, str)
        else tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
        )
        for prompt in prompts
    ]
    prompt_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    completion_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in completions]
    ends = torch.tensor(list(end_ids), dtype=torch.long)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(ends[0])
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[Tensor] = []
    try:
        for start in range(0, len(prompt_ids), batch_size):
            rows = [p + c for p, c in zip(prompt_ids[start : start + batch_size],
                                          completion_ids[start : start + batch_size], strict=True)]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(rows), width), dtype=torch.long)
            for i, row in enumerate(rows):  # right padding: positions stay those of an unpadded forward
                ids[i, : len(row)] = torch.tensor(row)
                attention[i, : len(row)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
            for i, row in enumerate(rows):
                # the logit at position t predicts token t + 1: the completion's tokens, then the end token
                first = len(prompt_ids[start + i]) - 1
                log_probs = torch.log_softmax(logits[i, first : len(row)].float() / temperature, dim=-1)
                targets = torch.tensor(row[first + 1 :], dtype=torch.long, device=log_probs.device)
                body = log_probs[:-1].gather(-1, targets.unsqueeze(-1)).double().sum()
                end = torch.logsumexp(log_probs[-1, ends.to(log_probs.device)].double(), dim=0)
                out.append((body + end).cpu())
    finally:
        model.train(was_training)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)
