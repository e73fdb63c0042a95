"""The line ``dfpo-train`` prints within a second, before torch, transformers and TRL are imported: what runs next, in
order, and what it is expected to take where that was measured (docs/source/guides/cli.md, "What you see").

Without it a first run sat silent for minutes on a loaded machine (the imports, the embedded model's conversion,
then the held-out evaluation before training, each without a line). Each later phase then shows its own progress:
the conversion a line with the time it has taken, the evaluation a bar with its time left. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .embedded import CONVERSION_MEASURED, embedded_model_converted, gguf_converted

__all__ = ["next_steps"]


def _model_step(model: Any) -> str:
    if not model:
        if embedded_model_converted():
            return "the embedded SmolLM2-135M-Instruct (converted by an earlier run)"
        return f"converting the embedded SmolLM2-135M-Instruct once ({CONVERSION_MEASURED}; later runs reuse it)"
    path = os.path.expanduser(str(model))
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        if gguf_converted(path):
            return f"{model} (converted by an earlier run)"
        return f"converting {model} once (no measured time for this file)"
    return f"loading {model}"


def _as_int(value: Any, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def next_steps(value: Callable[[str], Any]) -> str:
    """What the run does next, from the command line's values (the flag, else the recipe, else the default): the
    imports, the model (converted once, with the measured time), the held-out evaluation before training, the
    optimizer steps."""
    steps = ["importing torch, transformers and TRL (seconds; a minute on a loaded machine)", _model_step(
        value("model_name_or_path"))]
    eval_size = _as_int(value("eval_size"), 1)
    if str(value("skip_eval")).lower() not in ("true", "1", "yes") and eval_size > 0:
        measure = "avg@k (vLLM)" if str(value("use_vllm")).lower() in ("true", "1", "yes") else "greedy accuracy"
        bar = " (a bar shows its time left)" if str(value("disable_tqdm")).lower() not in ("true", "1", "yes") else ""
        steps.append(f"the held-out {measure} on {eval_size} problems before training{bar}")
    max_steps = _as_int(value("max_steps"), -1)
    steps.append(f"{max_steps} optimizer steps" if max_steps > 0 else "num_train_epochs epochs of optimizer steps")
    return "next: " + "; then ".join(steps)
