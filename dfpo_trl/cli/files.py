"""The files a run writes to ``output_dir``, and the earlier run's set aside in ``previous_run/``
(docs/source/guides/cli.md).

Standard library only: the script arguments and the command line's fast checks read these names before torch is
imported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["PLOT_FILE", "PREVIOUS_RUN_DIR", "SAVED_MODEL_PATTERNS", "SUMMARY_FILE", "set_aside_previous_outputs"]

SUMMARY_FILE = "dfpo_summary.json"
PLOT_FILE = "dfpo_metrics.png"
# Where a run moves the results an earlier run left in its output_dir (docs/source/guides/cli.md); the one before is
# deleted.
PREVIOUS_RUN_DIR = "previous_run"
# What `save_model` writes, for summaries written before they listed their files ("files").
SAVED_MODEL_PATTERNS = (
    "config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
    "model.safetensors.index.json", "pytorch_model*.bin", "adapter_config.json", "adapter_model.safetensors",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "added_tokens.json", "training_args.bin",
)  # fmt: skip


def set_aside_previous_outputs(output_dir: str) -> list[str]:
    """Move what an earlier run wrote to ``output_dir`` (its summary, figure and saved model: the files its summary
    lists) into ``output_dir/previous_run/``, replacing an older ``previous_run/``, so that nothing there can be
    taken for this run's results (docs/source/guides/cli.md). Checkpoints (``checkpoint-*/``) and other files stay.
    Returns the names moved."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    names = {PLOT_FILE}
    summary = out / SUMMARY_FILE
    if summary.is_file():
        names.add(SUMMARY_FILE)
        try:
            listed = json.loads(summary.read_text()).get("files")
        except (ValueError, OSError, AttributeError):
            listed = None
        if isinstance(listed, list):
            names.update(str(n) for n in listed if Path(str(n)).name == str(n) and str(n) not in ("", ".", ".."))
        else:  # a summary from before the files were listed
            names.update(p.name for pattern in SAVED_MODEL_PATTERNS for p in out.glob(pattern))
    present = sorted(n for n in names if (out / n).is_file())
    if not present:
        return []
    target = out / PREVIOUS_RUN_DIR
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()
    target.mkdir()
    for name in present:
        (out / name).rename(target / name)
    return present
