"""``dfpo-train`` with one more weight push to the vLLM server when training ends, for the server-mode checks.

TRL pushes the trainer's weights to the server at the start of each rollout, so after the last optimizer steps the
server still holds the weights of the last rollout's start. The weight-sync checks (``vllm_server.py``,
``paper_shape.py``) compare the server with the saved final model, so this entry point pushes them once more (under
ZeRO-3 or FSDP TRL's ``sync_weights`` gathers the partitioned parameters first; every process takes part):

    accelerate launch --config_file recipes/accelerate/zero3_2gpu.yaml benchmarks/final_sync.py RECIPE [--field v ...]
"""

from __future__ import annotations

import sys
from typing import Any

FINAL_SYNCS = {"count": 0}


def install() -> None:
    """Make ``GRPOTrainer.train`` (and so ``DFPOTrainer``'s) end with one ``sync_weights`` in server mode."""
    from trl import GRPOTrainer

    original = GRPOTrainer.train
    if getattr(original, "_final_sync", False):
        return

    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        if self.args.use_vllm and self.args.vllm_mode == "server":
            self.vllm_generation.sync_weights()
            FINAL_SYNCS["count"] += 1
        return output

    train._final_sync = True  # type: ignore[attr-defined]
    GRPOTrainer.train = train


def main(argv: list[str] | None = None) -> None:
    install()
    from dfpo_trl.app.main import main as dfpo_train

    sys.exit(dfpo_train(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
