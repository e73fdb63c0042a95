"""DFPO's metrics (docs/metrics.md): the store that carries them into TRL's logs, the mechanism, energy, curve and
drift metrics, and the backward hooks that read the token coefficients."""
