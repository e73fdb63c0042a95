"""dfpo-trl: token-gradient-cancellation-aware RL objectives (DFPO, GRPO-fix, DelTA) for Hugging Face TRL."""

from ._quiet import silence_library_deprecations
from .config import DFPOConfig
from .trainer import DFPOTrainer

silence_library_deprecations()

__all__ = ["DFPOConfig", "DFPOTrainer"]
__version__ = "0.1.0"
