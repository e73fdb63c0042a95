"""``dfpo_trl.testing.measures``, public: the library's own meters and the terms of its objective, under stable names,
for the checks that measure the library against itself (the benchmarks' single-process references, the studies'
term sizes, the pre-pass's predicted row count against a forward hook, a profile read by DFPO's labels).

Every name is the library's own object, not a copy (tests/test_testing.py checks the identity), so a check through
it measures exactly what a training run computes; the modules that define them stay internal and may move, and
only this list is kept stable (docs/source/contributing.md, "Measures").
"""

from __future__ import annotations

from ..groups.ids import WHOLE_GROUPS_KEY, consecutive_group_ids, group_index
from ..groups.prepass_schedule import pre_pass_rows
from ..metrics.curves import jitter2, steps_to_threshold
from ..metrics.drift import (
    completion_log_probs,
    end_token_ids,
    equivalent_set_stats,
    summarise_equivalent_sets,
)
from ..metrics.drift_meter import DriftMeterCallback
from ..objectives.weights import loss_mask, post_clip_weights, sequence_log_ratio, sign_aware_post_clip
from ..profiling import PROFILE_LABELS
from ..trl_hooks.sync_watchdog import STALL_EXIT_CODE, SyncWatchdog, streamed_size

__all__ = [
    # the objective's terms (docs/source/concepts/design.md): the sequence log-ratio (eq. 44), the sign-aware post-clip
    # weight s̄ (eq. 46-47), the row weights a micro-step computes, the mask its loss reads
    "loss_mask",
    "post_clip_weights",
    "sequence_log_ratio",
    "sign_aware_post_clip",
    # the groups as explicit ids (docs/source/concepts/layouts.md)
    "WHOLE_GROUPS_KEY",
    "consecutive_group_ids",
    "group_index",
    # the rows the pre-pass forwards per optimizer step, the closed form the start-up line prints
    "pre_pass_rows",
    # the mechanism metrics over a run's curve (docs/source/concepts/metrics.md)
    "jitter2",
    "steps_to_threshold",
    # the equivalent-solution drift meter (docs/source/concepts/metrics.md)
    "DriftMeterCallback",
    "completion_log_probs",
    "end_token_ids",
    "equivalent_set_stats",
    "summarise_equivalent_sets",
    # the deadline on the server-mode weight sync (docs/source/guides/cli.md): its exit code, the guard that logs each
    # phase and the line that says what a sync streamed
    "STALL_EXIT_CODE",
    "SyncWatchdog",
    "streamed_size",
    # the labels DFPO's parts of a micro-step carry for torch.profiler (docs/source/contributing.md, "Profile labels")
    "PROFILE_LABELS",
]
