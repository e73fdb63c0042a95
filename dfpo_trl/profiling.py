"""Labels on DFPO's parts of a micro-step for ``torch.profiler``: while a profiler records, each part runs inside
``torch.profiler.record_function(label)``, so a trace or a ``key_averages()`` table shows DFPO's own time and kernels
apart from TRL's (docs/source/contributing.md, "Profile labels"). Without a profiler a part costs one check of
``torch.autograd._profiler_enabled()`` and a shared ``nullcontext`` (about 0.2 µs, some 30 a micro-step), not the
microseconds a ``record_function`` costs; the labels never touch a tensor, so no number changes.

:data:`PROFILE_LABELS` is the one list of the labels; :func:`profiled` refuses a label outside it, so a part cannot be
labelled under a name a reader of the profile does not know. The trainer labels its own methods and its calls into the
objective and the meters, so the math modules stay free of the profiler; the group layout, the pre-pass, the metric
store and the meters' backward hooks label themselves.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = ["PROFILE_LABELS", "profiled"]

#: Every label DFPO puts on a part of a training step -> what the part does. A label's time includes the labels
#: nested in it (and TRL's code it calls); its own ("self") time is what no deeper label covers.
PROFILE_LABELS: dict[str, str] = {
    "dfpo/prepare_inputs": "DFPOTrainer._prepare_inputs: TRL's buffering, the regroup of a new rollout, the pre-pass",
    "dfpo/pre_pass": "the pre-pass layout's one call per optimizer step (s̄ and s̃ at its θ for every micro-batch)",
    "dfpo/compute_loss": "DFPOTrainer._compute_loss: TRL's loss with DFPO's rewrite and its clip-fraction recount",
    "dfpo/get_per_token_logps_and_entropies": "DFPOTrainer's wrapper of TRL's log-prob helper (hands the first "
    "forward of a DFPO override to what it left)",
    "dfpo/rewrite_after_forward": "after the loss's policy forward: the objective written into TRL's inputs, its "
    "metrics, the backward hooks",
    "dfpo/log_step_reward": "each row's reward logged at a micro-step",
    "dfpo/whole_groups": "the micro-batch's whole groups, as the group layout delivers them",
    "dfpo/micro_step_objective": "DFPO's objective of one micro-step (pure tensor math, no host read)",
    "dfpo/log_micro_step": "the objective's metrics, pending on the device",
    "dfpo/watch_token_coefficients": "the shared-prefix cancellation meter's set-up and its backward hook",
    "dfpo/watch_token_coefficients.backward_hook": "that meter, in the backward pass",
    "dfpo/watch_gradient_energy": "the energy meter's LM-head read and its backward hook",
    "dfpo/watch_gradient_energy.backward_hook": "that meter, in the backward pass",
    "dfpo/metric_store.add": "one metric added to the store (device tensors, read at the logging step)",
    "dfpo/log": "DFPOTrainer.log: DFPO's metrics flushed, then TRL's log",
    "dfpo/flush_metrics": "DFPO's metrics reduced over the processes and handed to TRL's averaging (host reads)",
}


def profiled(label: str) -> AbstractContextManager[Any]:
    """``with profiled(label):`` runs its block inside ``record_function(label)`` while a profiler records, and as it
    is otherwise (a shared ``nullcontext``: no frame is added, so tracebacks and call depths stay as they are).
    ``label`` must be one of :data:`PROFILE_LABELS`."""
    if label not in PROFILE_LABELS:
        raise ValueError(f"{label!r} is not in PROFILE_LABELS (dfpo_trl/profiling.py): add it there, with what it is")
    if not torch.autograd._profiler_enabled():
        return _OFF
    return torch.profiler.record_function(label)


_OFF = nullcontext()
