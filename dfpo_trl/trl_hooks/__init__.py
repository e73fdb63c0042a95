"""The few places DFPO touches TRL's ``GRPOTrainer``.

``compat`` (every touch point, declared and checked at import), ``lm_head`` (what TRL's fused LM head hides),
``no_reward`` (TRL's warning for completions no reward scores, in one line), ``pending`` (TRL's default config and
the one piece of state between DFPO's overrides), ``resume`` (what a DFPO checkpoint holds besides TRL's),
``model_card`` (DFPO's and DelTA's citation on the card TRL writes) and ``callback`` (``DFPOCallback``:
transformers' callback with DFPO's pre-pass and micro-step events).
"""
