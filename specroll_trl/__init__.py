"""specroll-trl: exact batched speculative rollouts for TRL's GRPOTrainer."""

from . import zoo
from .distill import HeadDistillConfig, distill_heads
from .engine import GenerationOutput, SpeculativeConfig, SpeculativeGenerator, profile_capacity
from .heads import SpeculativeHeads, SpeculativeHeadsConfig
from .trainer import SpecGRPOConfig, SpecGRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "GenerationOutput",
    "HeadDistillConfig",
    "SpecGRPOConfig",
    "SpecGRPOTrainer",
    "SpeculativeConfig",
    "SpeculativeGenerator",
    "SpeculativeHeads",
    "SpeculativeHeadsConfig",
    "distill_heads",
    "profile_capacity",
    "zoo",
]
