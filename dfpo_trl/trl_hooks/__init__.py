"""The few places DFPO touches TRL's ``GRPOTrainer``.

``compat`` (every touch point, declared and checked at import), ``lm_head`` (what TRL's fused LM head hides) and
``step_reward`` (each completion's reward carried with its row).
"""
