"""DFPO's metrics (docs/source/concepts/metrics.md).

``store`` (the only path into TRL's logs), ``mechanism`` (Asym, residuals, φ), ``diagnostics`` (whether the
transform acted at all), ``energy`` and ``energy_aggregate`` (eq. 24, per position and per token
type), ``curves`` (EMA, Jitter₂, steps to threshold), ``drift`` (D1–D4), ``clip`` (TRL's clip fractions, counted
before DFPO's rewrite), ``objective`` (the objective's return values logged, in one place), ``step_reward`` (each
completion's reward carried with its row, logged per optimizer step) and ``hooks`` (the backward hooks that read the
token coefficients).
"""
