"""The choice of a run's group layout (docs/source/concepts/layouts.md): the choice, its one-line description with cost,
its refusals.

A transform needs every member's s̄ at the same θ. :func:`choose_layout` picks the cheapest layout that makes the
coefficients exact for the batch sizes and process count, and refuses only what no layout can make exact;
:func:`describe_layout` is the start-up line that says why and what it costs (the pre-pass's rows are its schedule's
closed form, :func:`~dfpo_trl.groups.prepass_schedule.pre_pass_rows`, re-exported here); the multimodal refusals
belong to the layouts that regroup TRL's rollout, which treat every tensor as one row per sample.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..config.options import GROUP_LAYOUT_AUTO, GROUP_LAYOUT_PRE_PASS, GROUP_LAYOUT_REDISTRIBUTED
from ..trl_hooks.compat import MULTIMODAL_KEYS
from .prepass_schedule import pre_pass_rows

if TYPE_CHECKING:
    from ..config import DFPOConfig

__all__ = [
    "LAYOUT_CROSS_PROCESS",
    "LAYOUT_GROUP_GRANULAR",
    "LAYOUT_PER_SAMPLE",
    "LAYOUT_PRE_PASS",
    "LAYOUT_REDISTRIBUTED",
    "choose_layout",
    "describe_layout",
    "model_is_multimodal",
    "multimodal_refusal",
    "pre_pass_rows",
    "refuse_multimodal_batch",
    "refuse_multimodal_model",
    "regroups_batches",
]

logger = logging.getLogger(__name__)

# Group layouts of docs/source/concepts/layouts.md, cheapest first; the two a user may ask for by group_layout are its
# values.
LAYOUT_GROUP_GRANULAR = "group_granular"  # whole groups in every micro-batch: free
LAYOUT_CROSS_PROCESS = "cross_process"  # groups spread over processes in one micro-step: all-gather scalars
LAYOUT_REDISTRIBUTED = GROUP_LAYOUT_REDISTRIBUTED  # rollout moved once: micro-steps hold whole groups across processes
LAYOUT_PRE_PASS = GROUP_LAYOUT_PRE_PASS  # groups spread over micro-steps: no-grad pre-pass at each optimizer step
LAYOUT_PER_SAMPLE = "per_sample"  # no transform: TRL's per-sample shuffle, group metrics off


def choose_layout(args: DFPOConfig, processes: int) -> str:
    """The cheapest exact layout for these batch sizes (docs/source/concepts/layouts.md); refuse only what cannot be
    exact. With every DFPO option off (and ``group_granular_batches`` not forced) TRL's per-sample order is kept."""
    per_device, group_size = args.per_device_train_batch_size, args.num_generations
    whole = per_device % group_size == 0
    if args.group_granular_batches is True and not whole:
        raise ValueError(
            f"group_granular_batches=True needs whole groups in every micro-batch, but "
            f"per_device_train_batch_size={per_device} is not a multiple of num_generations={group_size}. "
            f"Set per_device_train_batch_size to a multiple of {group_size}, or group_granular_batches=None."
        )
    if whole and args.wants_group_granular_batches:
        # TRL slices the global generation batch per process in blocks of per_device * steps_per_generation
        # rows, a multiple of G, so a group-granular split keeps every group inside one micro-batch.
        return LAYOUT_GROUP_GRANULAR
    if not args.sequence_rewrite_active:
        if args.group_layout != GROUP_LAYOUT_AUTO:
            logger.warning("group_layout=%r has no effect: no DFPO option needs in-group coefficients.",
                           args.group_layout)
        return LAYOUT_PER_SAMPLE
    if not args.transform_stop_gradient:
        raise ValueError(
            "transform_stop_gradient=False differentiates the transform through every member's s̄, so the "
            "whole group must be in one micro-batch, but per_device_train_batch_size="
            f"{per_device} is not a multiple of num_generations={group_size}. Set "
            f"per_device_train_batch_size to a multiple of {group_size}."
        )
    redistributable = processes > 1 and (per_device * processes) % group_size == 0
    if args.group_layout == LAYOUT_REDISTRIBUTED and not redistributable:
        raise ValueError(
            f"group_layout='redistributed' needs per_device_train_batch_size × num_processes = {per_device} × "
            f"{processes} to be a multiple of num_generations={group_size} (every micro-step then holds whole "
            "groups across processes). Change the per-device batch or the process count, or use "
            "group_layout='auto'."
        )
    if args.steps_per_generation == 1 and args.group_layout == GROUP_LAYOUT_AUTO:
        # Each micro-step trains on the whole global generation batch: groups may straddle processes but
        # are whole across them, so gathering (group id, s̄, Â) in the micro-step is exact.
        return LAYOUT_CROSS_PROCESS
    if redistributable and args.group_layout in (GROUP_LAYOUT_AUTO, LAYOUT_REDISTRIBUTED):
        return LAYOUT_REDISTRIBUTED
    if args.steps_per_generation % args.gradient_accumulation_steps != 0:
        raise ValueError(
            f"group_transform={args.group_transform!r} with groups spread over micro-steps "
            f"(per_device_train_batch_size={per_device} is not a multiple of num_generations={group_size}) "
            "needs every optimizer step inside one generation batch: set steps_per_generation to a multiple "
            f"of gradient_accumulation_steps={args.gradient_accumulation_steps}, or "
            f"per_device_train_batch_size to a multiple of {group_size}."
        )
    return LAYOUT_PRE_PASS


def describe_layout(layout: str, args: DFPOConfig, processes: int) -> str:
    """One start-up line: the group layout the trainer chose (docs/source/concepts/layouts.md), why, and what it
    costs."""
    b, G = args.per_device_train_batch_size, args.num_generations
    A, S = args.gradient_accumulation_steps, args.steps_per_generation
    head = f"DFPO group layout: {layout}"
    if layout == LAYOUT_GROUP_GRANULAR:
        return f"{head} (per_device_train_batch_size {b} holds whole groups of num_generations {G}): no extra cost"
    if layout == LAYOUT_CROSS_PROCESS:
        return (f"{head} (groups straddle the {processes} processes; steps_per_generation 1): one all-gather of 6 "
                "floats per sequence per micro-step, no extra forward")
    if layout == LAYOUT_REDISTRIBUTED:
        return (f"{head} (groups straddle micro-steps; {b} rows x {processes} processes is a multiple of G = {G}): "
                "one all-to-all of the rollout per rollout and an all-gather of 6 floats per sequence per "
                "micro-step, no extra forward")
    if layout == LAYOUT_PRE_PASS:
        why = f"per_device_train_batch_size {b} is not a multiple of num_generations {G}"
        fix = f"a per_device_train_batch_size that is a multiple of {G} makes the layout free (group_granular)"
        rows = pre_pass_rows(b, A, S, G, args.num_iterations)
        forwarding = [r for r in rows if r > 0]
        if not forwarding:
            return f"{head} ({why}): no extra forward, every optimizer step is the first of its rollout; {fix}"
        trained = A * b  # rows an optimizer step trains on, per process
        gather = ", and an all-gather of 6 floats per sequence" if processes > 1 else ""
        if (b * S) % G == 0:
            mean = sum(forwarding) / len(forwarding)
            share = 100 * mean / (3 * trained)  # a no-grad forward ~ 1/3 of a forward + backward
            amount = f"{mean:.3g} rows per process ({trained} trained), about +{share:.0f}% of their compute"
        else:  # groups straddle processes: a step may also forward the local members of another process's groups
            high = 100 * b * S / (3 * trained)
            amount = f"{trained}-{b * S} rows per process, about +33% to +{high:.0f}% of their compute"
        return (
            f"{head} ({why}): {len(forwarding)} of every {len(rows)} optimizer steps add a no-grad forward over "
            f"{amount}{gather} (docs/source/concepts/layouts.md, the pre-pass and its cost); {fix}"
        )
    return (f"{head} (no in-group transform active: TRL's batch order): no extra cost; group metrics only on "
            "micro-batches that hold whole groups (group_granular_batches: true gives them every step)")


def regroups_batches(layout: str) -> bool:
    """Whether ``layout`` concatenates, permutes or re-forwards TRL's buffered rollout (group shuffle,
    redistribution, pre-pass): code that treats every tensor as one row per sample."""
    return layout in (LAYOUT_GROUP_GRANULAR, LAYOUT_PRE_PASS, LAYOUT_REDISTRIBUTED)


def model_is_multimodal(model: Any, processing_class: Any) -> bool:
    """A ``vision_config`` on the (unwrapped) model's config, or an ``image_processor`` on the processing class."""
    has_vision = getattr(getattr(model, "config", None), "vision_config", None) is not None
    return has_vision or getattr(processing_class, "image_processor", None) is not None


def multimodal_refusal(layout: str, options: str, why: str) -> str:
    """The error of a vision-language run in a layout that regroups the rollout; ``options`` are the DFPO options
    that need it (as the config describes them), ``why`` what made the run multimodal."""
    option = options or "group_granular_batches=True"
    return (
        f"{option} needs the {layout!r} layout, which regroups TRL's rollout into whole groups "
        "(or re-forwards it in a pre-pass) as if every tensor had one row per sample, but "
        f"{why}: {', '.join(MULTIMODAL_KEYS[:4])}, ... are not one row per sample (pixel_values rows are "
        "image patches) and the pre-pass does not pass them to the model. Vision-language batches are not "
        "supported with this layout: use a text-only model, or turn the option off."
    )


def refuse_multimodal_model(layout: str, options: str, model: Any, processing_class: Any) -> None:
    """Raise :func:`multimodal_refusal`'s error at start-up when ``layout`` regroups the rollout and the
    (unwrapped) model or its processor is multimodal."""
    if regroups_batches(layout) and model_is_multimodal(model, processing_class):
        raise ValueError(multimodal_refusal(layout, options, "the model or its processor is multimodal"))


def refuse_multimodal_batch(batch: dict[str, Any], layout: str, options: str) -> None:
    """Raise :func:`multimodal_refusal`'s error when a rollout carries multimodal inputs."""
    present = [key for key in MULTIMODAL_KEYS if batch.get(key) is not None]
    if present:
        raise ValueError(multimodal_refusal(layout, options, f"the rollout carries {', '.join(present)}"))
