"""``dfpo-train`` with one more weight push to the vLLM server when training ends, for the server-mode checks.

TRL pushes the trainer's weights to the server at the start of each rollout, so after the last optimizer steps the
server still holds the weights of the last rollout's start. The weight-sync checks (``vllm_server.py``,
``paper_shape.py``) compare the server with the saved final model, so this entry point pushes them once more (under
ZeRO-3 or FSDP TRL's ``sync_weights`` gathers the partitioned parameters first; every process takes part):

    accelerate launch --config_file recipes/accelerate/zero3_2gpu.yaml dfpo_bench.launch.final_sync RECIPE \
        [--field v ...]
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]

from dfpo_bench.lib.vllm_tools import install  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    install()
    from dfpo_trl.cli import dfpo_train

    sys.exit(dfpo_train(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
