"""dfpo-trl: token-gradient-cancellation-aware RL objectives (DFPO, GRPO-fix, DelTA) for Hugging Face TRL."""

from ._quiet import silence_library_deprecations
from .config import DFPOConfig
from .objectives.transforms import register_transform, registered_transforms, unregister_transform
from .trainer import DFPOTrainer

silence_library_deprecations()

__all__ = ["DFPOConfig", "DFPOTrainer", "register_transform", "registered_transforms", "unregister_transform"]
__version__ = "0.1.0"
