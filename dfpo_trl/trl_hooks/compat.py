"""Every point where dfpo_trl touches TRL's ``GRPOTrainer`` internals, declared and checked in one place.

DFPO enters TRL through private methods (it overrides some, calls others) and reads a few private attributes and
conditions: ``GRPOTrainer``'s (:data:`TOUCH_POINTS`) and those of TRL's vLLM backend ``VLLMGeneration``, whose
set-up, weight sync and generation request run under DFPO's watchdog (:data:`VLLM_TOUCH_POINTS`). Private APIs change
between releases without notice, and a renamed hook would not fail: TRL would simply stop calling DFPO's override
and the run would silently train plain GSPO. So at import this module checks that each hooked or called method
exists with the parameters DFPO relies on, and raises :class:`TRLCompatibilityError` naming the supported TRL range
when one does not; at construction :func:`check_trainer_attributes` does the same for the attributes. An installed
TRL outside the tested range whose checks pass gets a :class:`UntestedTRLWarning`. DFPO reads TRL's call arguments
by name (:func:`bind_call`), never by position.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import trl
from packaging.version import Version
from torch import Tensor
from trl import GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from .errors import TRLCompatibilityError, UntestedTRLWarning

__all__ = [
    "MULTIMODAL_KEYS",
    "SUPPORTED_TRL",
    "TOUCH_POINTS",
    "TRAINER_ATTRIBUTES",
    "TRLCompatibilityError",
    "UntestedTRLWarning",
    "VLLM_TOUCH_POINTS",
    "bind_call",
    "check_one_value_each",
    "check_rewrite_ran",
    "check_touch_points",
    "check_trainer_attributes",
    "disable_gradient_checkpointing",
    "diverted_metrics",
    "eval_forward_chunks",
    "generate_every",
    "get_config_model_id",
    "split_tensor_dict",
    "trl_off_policy_keep",
    "trl_runs_old_logps_forward",
]

# The TRL releases dfpo_trl is tested against (pyproject pins the same range).
SUPPORTED_TRL = (Version("1.16.0"), Version("1.17.0"))
SUPPORTED_TRL_TEXT = ">=1.16.0,<1.17 (tested: 1.16.x)"


class TouchPoint(NamedTuple):
    """A ``GRPOTrainer`` method DFPO overrides or calls, and the parameters it relies on.

    ``ordered``: DFPO's override declares these parameters itself (TRL passes them by position), so they must
    come first, in this order; otherwise DFPO binds the call by name and only their presence matters.
    """

    name: str
    parameters: tuple[str, ...]
    ordered: bool
    why: str


TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("__init__", ("model", "reward_funcs", "args", "train_dataset", "processing_class"), False,
               "DFPOTrainer binds its constructor arguments by name to build a default DFPOConfig"),
    TouchPoint("_compute_loss", ("model", "inputs"), True,
               "DFPO hands TRL's loss a copy of the inputs it rewrites after the policy forward"),
    TouchPoint("_get_per_token_logps_and_entropies",
               ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"), False,
               "the loss's policy forward, where DFPO rewrites advantages and old log-probs; also called by DFPO"),
    TouchPoint("_prepare_inputs", ("generation_batch",), True,
               "TRL's rollout buffer, which DFPO regroups into whole groups and pre-passes"),
    TouchPoint("_generate_and_score_completions", ("inputs",), True,
               "the rollout, to which DFPO adds group and row ids and DelTA's weights"),
    TouchPoint("log", ("logs", "start_time"), True, "where DFPO flushes its metrics into TRL's"),
    TouchPoint("_calculate_rewards", ("inputs", "prompts", "completions", "completion_ids_list"), True,
               "each completion's reward, which step_reward carries with its row"),
    TouchPoint("create_model_card", ("model_name", "dataset_name", "tags"), False,
               "the card TRL writes from _name, _tag_names and _paper, to which DFPO adds DelTA's citation"),
    TouchPoint("get_off_policy_mask",
               ("advantages", "per_token_logps", "sampling_per_token_logps", "mask", "off_policy_threshold"), False,
               "TRL's off-policy sequence mask, which DFPO computes as TRL's loss will to fold it into the clip "
               "survivors U"),
    # Resume (trl_hooks/resume.py): the rollout state written with each checkpoint and restored from it.
    TouchPoint("_save_checkpoint", ("model", "trial"), True,
               "each checkpoint, to which DFPO adds the rollout buffer and micro-step counter"),
    TouchPoint("_get_output_dir", ("trial",), False, "the run folder holding the checkpoint folders"),
    TouchPoint("_load_optimizer_and_scheduler", ("checkpoint",), True,
               "the resume point where DFPO restores the rollout state and advances the prompt sampler"),
    TouchPoint("_get_train_sampler", ("dataset",), True,
               "TRL's prompt sampler, advanced past the epochs trained on resume"),
    TouchPoint("_issue_warnings_after_load", ("load_result",), True,
               "transformers' missing-key warning on resume, from which DFPO drops tied weights"),
)

# TRL's vLLM backend, as trl_hooks/sync_watchdog.py's WatchedVLLMGeneration subclasses it: the three methods it
# overrides (each runs TRL's own under a deadline in server mode) and the constructor parameters whose attributes it
# reads (TRL stores each under its own name).
VLLM_TOUCH_POINTS: tuple[TouchPoint, ...] = (
    TouchPoint("__init__", ("model", "accelerator", "mode", "server_base_url", "server_host", "server_port",
                            "group_port", "server_timeout", "max_completion_length"), False,
               "WatchedVLLMGeneration reads the server's address, TRL's wait for it and the completion length"),
    TouchPoint("_init_vllm", (), True,
               "the server connection and NCCL weight-transfer set-up, which DFPO runs under vllm_sync_timeout"),
    TouchPoint("sync_weights", (), True, "the weight sync, which DFPO runs under vllm_sync_timeout"),
    TouchPoint("generate", ("prompts", "images", "num_generations", "profiler"), True,
               "the generation request, which DFPO runs under vllm_generation_timeout"),
)

# Attributes a constructed GRPOTrainer must have: the buffer and micro-step counter DFPO's layouts read, TRL's
# metric store, and the loss settings DFPO's rewrite reproduces.
TRAINER_ATTRIBUTES: tuple[str, ...] = (
    "_buffered_inputs", "_step", "_metrics", "num_generations", "num_generations_eval", "num_iterations",
    "epsilon_low", "epsilon_high", "loss_type", "importance_sampling_level", "temperature", "use_vllm",
    "vllm_importance_sampling_correction", "off_policy_mask_threshold",
    # the sampling settings TRL hands vLLM, from which vllm_importance_sampling_support rebuilds the support
    "top_k", "top_p", "min_p", "vllm_importance_sampling_mode",
    "callback_handler", "control",  # transformers' own: DFPOCallback's events go through them (trl_hooks/callback.py)
)


# Multimodal inputs TRL's rollout may put in a batch and its log-prob helper consumes (TRL 1.16's
# `_get_per_token_logps_and_entropies` keyword arguments). Several are not one row per sample: pixel_values rows are
# image patches or tiles, counted by image_grid_thw / num_images / num_tiles.
MULTIMODAL_KEYS: tuple[str, ...] = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)



def _import_helpers() -> tuple[Callable[..., Any], ...]:
    """TRL's helper functions DFPO calls: gradient checkpointing off for no-grad passes, the model id behind a
    default output_dir, and the buffer split of ``_prepare_inputs``."""
    try:
        from trl.models.utils import disable_gradient_checkpointing
        from trl.trainer.utils import get_config_model_id, split_tensor_dict
    except ImportError as exc:
        raise _incompatible(f"a TRL helper is gone ({exc})") from exc
    return disable_gradient_checkpointing, get_config_model_id, split_tensor_dict


def _incompatible(detail: str) -> TRLCompatibilityError:
    return TRLCompatibilityError(
        f"dfpo_trl supports trl{SUPPORTED_TRL_TEXT}; the installed trl {trl.__version__} differs where DFPO hooks "
        f"it: {detail}. Without this hook DFPO's options would be silently ignored. Install a supported TRL "
        "(pip install 'trl>=1.16,<1.17')."
    )


def _parameters(method: Callable[..., Any]) -> list[str]:
    names = list(inspect.signature(method).parameters)
    return names[1:] if names and names[0] == "self" else names


def check_touch_points(trainer_cls: type = GRPOTrainer, generation_cls: type = VLLMGeneration) -> None:
    """Raise :class:`TRLCompatibilityError` unless every method of :data:`TOUCH_POINTS` exists on ``trainer_cls``
    and every one of :data:`VLLM_TOUCH_POINTS` on ``generation_cls``, with the parameters DFPO relies on; warn when
    TRL's version is outside the tested range."""
    _check_methods(trainer_cls, "GRPOTrainer", TOUCH_POINTS)
    _check_methods(generation_cls, "VLLMGeneration", VLLM_TOUCH_POINTS)
    version = Version(trl.__version__)
    if not SUPPORTED_TRL[0] <= version < SUPPORTED_TRL[1]:
        warnings.warn(
            f"dfpo_trl is tested with trl{SUPPORTED_TRL_TEXT}, but trl {trl.__version__} is installed. Every TRL "
            "method and parameter DFPO hooks is present, but TRL's loss may have changed: check the results.",
            UntestedTRLWarning,
            stacklevel=2,
        )


def _check_methods(owner: type, label: str, points: tuple[TouchPoint, ...]) -> None:
    for point in points:
        method = getattr(owner, point.name, None)
        if not callable(method):
            raise _incompatible(f"{label}.{point.name} does not exist ({point.why})")
        found = _parameters(method)
        if point.ordered:
            ok = found[: len(point.parameters)] == list(point.parameters)
        else:
            ok = set(point.parameters) <= set(found)
        if not ok:
            expected = ", ".join(point.parameters)
            raise _incompatible(
                f"{label}.{point.name} has parameters ({', '.join(found)}) where DFPO expects "
                f"({expected}{', ...' if not point.ordered else ''}){' in this order' if point.ordered else ''} "
                f"({point.why})"
            )


def check_trainer_attributes(trainer: Any) -> None:
    """Raise :class:`TRLCompatibilityError` unless a constructed trainer has every attribute DFPO reads."""
    missing = [name for name in TRAINER_ATTRIBUTES if not hasattr(trainer, name)]
    if missing:
        raise _incompatible(f"a constructed GRPOTrainer has no attribute {', '.join(missing)}")


def check_rewrite_ran(forward_left: object | None, active_options: str) -> None:
    """Raise :class:`TRLCompatibilityError` when TRL's ``_compute_loss`` never ran its policy forward through
    ``_get_per_token_logps_and_entropies`` (``forward_left``: what DFPO left for that forward, still there) while DFPO
    options are on: DFPO's input rewrite did not run, and the options would be silently ignored."""
    if forward_left is not None and active_options:
        raise _incompatible(
            "GRPOTrainer._compute_loss never ran its policy forward through _get_per_token_logps_and_entropies, so "
            f"DFPO's input rewrite did not run ({active_options})"
        )


class _DivertedMetrics:
    """TRL's ``_metrics[mode]`` during one call, with the appends to ``names`` going to a sink instead."""

    def __init__(self, metrics: dict[str, list[float]], names: tuple[str, ...]) -> None:
        self.metrics, self.sink = metrics, {name: [] for name in names}

    def __getitem__(self, name: str) -> list[float]:
        return self.sink[name] if name in self.sink else self.metrics[name]


@contextmanager
def diverted_metrics(metrics: dict[str, Any], mode: str, names: tuple[str, ...]) -> Iterator[dict[str, list[float]]]:
    """Inside the ``with`` block, the values TRL appends to ``metrics[mode][name]`` for ``names`` go to the sink it
    yields, which the caller drops after :func:`check_one_value_each`: DFPO's own count of them is then the only one
    logged, and TRL's values are never written to its logs. Every other name reaches ``metrics[mode]`` as before."""
    real = metrics[mode]
    diverted = _DivertedMetrics(real, names)
    metrics[mode] = diverted
    try:
        yield diverted.sink
    finally:
        metrics[mode] = real


def check_one_value_each(sink: dict[str, list[float]]) -> None:
    """Raise :class:`TRLCompatibilityError` unless TRL appended exactly one value to each diverted metric: TRL 1.16's
    ``_compute_loss`` does so per clipped-loss call; anything else means TRL changed how it logs them, and DFPO's
    count would sit beside a wrong one or stand in for none."""
    for name, values in sink.items():
        if len(values) != 1:
            raise _incompatible(
                f"GRPOTrainer._compute_loss appended {len(values)} values to _metrics[{name!r}] where DFPO expects "
                "one per call (DFPO's own count of the clip fractions replaces TRL's)"
            )


def bind_call(method_name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The arguments of a call to ``GRPOTrainer.<method_name>`` (without ``self``) by parameter name, read
    against TRL's own signature: positional arguments are named as TRL names them, whatever their order."""
    signature = inspect.signature(getattr(GRPOTrainer, method_name))
    bound = signature.bind(None, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))
    return arguments


#: The rows TRL's off-policy mask keeps, of (Â, current, old, sampler's log-probs or None, loss mask): see below.
OffPolicyKeep = Callable[[Tensor, Tensor, Tensor, "Tensor | None", Tensor], Tensor]


def trl_off_policy_keep(
    get_off_policy_mask: Callable[..., Tensor], threshold: float, advantages: Tensor, per_token_logps: Tensor,
    old_per_token_logps: Tensor, sampling_per_token_logps: Tensor | None, mask: Tensor,
) -> Tensor:
    """The rows TRL 1.16's off-policy sequence mask keeps in ``_compute_loss``.

    Args:
        get_off_policy_mask: the trainer's ``get_off_policy_mask`` (TRL's static method, or a subclass's
            override: not a copy, so either is followed). threshold: TRL's ``off_policy_mask_threshold``.
        advantages: Â (B,). per_token_logps: the current log-probs (B, T).
        old_per_token_logps: the old log-probs TRL's loss reads (B, T): the detached current ones when TRL
            computed none. sampling_per_token_logps: the sampler's (B, T), used instead where the rollout has them.
        mask: the loss mask (B, T).

    Returns:
        (B,) bool, what the mask TRL's loss calls keeps.
    """
    sampling = old_per_token_logps if sampling_per_token_logps is None else sampling_per_token_logps
    keep = get_off_policy_mask(
        advantages=advantages.unsqueeze(1), per_token_logps=per_token_logps, sampling_per_token_logps=sampling,
        mask=mask, off_policy_threshold=threshold,
    )
    return keep.squeeze(1) != 0


def generate_every(trainer: Any) -> int:
    """Micro-steps between two rollouts, as TRL 1.16's ``_prepare_inputs`` counts them."""
    return trainer.args.steps_per_generation * trainer.num_iterations


def off_policy_step(trainer: Any) -> bool:
    """Whether the current micro-step trains on a rollout the policy has taken an optimizer step since: TRL 1.16's
    ``_step`` counts micro-steps (it is advanced after the loss), a rollout serves ``generate_every`` of them, and
    its first ``gradient_accumulation_steps`` still run at the θ that generated it (ratios 1, φ = 1)."""
    return trainer._step % generate_every(trainer) >= trainer.args.gradient_accumulation_steps


def applies_is_ratio(trainer: Any) -> bool:
    """Whether TRL 1.16's loss multiplies in its vLLM importance-sampling ratio (after DFPO's rewrite)."""
    return bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction and trainer.loss_type != "vespo")


def applied_is_ratio(trainer: Any, inputs: dict[str, Any]) -> Any:
    """TRL's vLLM importance-sampling ratio where TRL 1.16's loss multiplies it in (after DFPO's rewrite), else
    None: ``inputs["importance_sampling_ratio"]``, (B, T) in the token modes, (B, 1) in the sequence modes."""
    return inputs.get("importance_sampling_ratio") if applies_is_ratio(trainer) else None


def trl_runs_old_logps_forward(trainer: Any) -> bool:
    """TRL 1.16's condition for computing old log-probs in the rollout (``_generate_and_score_completions``):
    the off-policy case, where θ can differ from θ_old and DFPO's transforms act."""
    return trainer.args.gradient_accumulation_steps % generate_every(trainer) != 0 or bool(
        trainer.use_vllm and trainer.vllm_importance_sampling_correction
    )


def eval_forward_chunks(trainer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a call to TRL's log-prob helper (``args`` after the model: input_ids,
    attention_mask, logits_to_keep, batch_size), with ``batch_size`` at most ``per_device_train_batch_size`` in
    evaluation. TRL runs the evaluation's forwards (old log-probs, eval loss) over the whole eval batch at once; in
    chunks of the training's size, ``per_device_eval_batch_size`` sets the prompts per vLLM call, not the forward's
    memory (docs/source/concepts/decisions.md, "Held-out avg@k through vLLM"). Rows are independent: the values
    are the unchunked call's."""
    if trainer.model.training or len(args) >= 4:  # training, or batch_size given by position (never by TRL 1.16)
        return kwargs
    rows = (kwargs["input_ids"] if "input_ids" in kwargs else args[0]).size(0)
    chunk = trainer.args.per_device_train_batch_size
    return {**kwargs, "batch_size": chunk} if (kwargs.get("batch_size") or rows) > chunk else kwargs


def on_policy_identity_warning(trainer: Any, transform: str) -> str | None:
    """The warning for a sequence rewrite that cannot act: on-policy, TRL computes no old log-probs, every post-clip
    weight is 1 and the transform is the identity (None when TRL runs the off-policy forward)."""
    if trl_runs_old_logps_forward(trainer):
        return None
    return (
        f"group_transform={transform!r} runs on-policy (steps_per_generation <= gradient_accumulation_steps, "
        "num_iterations=1, no vLLM importance sampling): every post-clip weight is 1 and the transform is the "
        "identity. Raise steps_per_generation or num_iterations for it to act."
    )


disable_gradient_checkpointing, get_config_model_id, split_tensor_dict = _import_helpers()
check_touch_points()
