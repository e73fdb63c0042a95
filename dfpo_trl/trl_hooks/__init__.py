"""The few places DFPO touches TRL's GRPOTrainer: the declared touch points, the fused LM head's hidden states, and
the per-step reward carried with each rollout row."""
