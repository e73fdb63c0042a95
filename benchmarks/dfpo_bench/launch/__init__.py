"""The jobs that launch real set-ups: accelerate, DeepSpeed ZeRO-3, FSDP2, vLLM colocate and server mode, two nodes."""
