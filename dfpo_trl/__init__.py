"""dfpo-trl: token-gradient-cancellation-aware RL objectives (DFPO, GRPO-fix, DelTA) for Hugging Face TRL."""

from .config import DFPOConfig
from .trainer import DFPOTrainer

__all__ = ["DFPOConfig", "DFPOTrainer"]
__version__ = "0.1.0"
