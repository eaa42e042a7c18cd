"""specroll-trl: exact batched speculative rollouts for TRL's GRPOTrainer."""

from . import zoo
from .buffer import BufferCapture, HeadBuffer
from .consolidation import ConsolidationCallback, ConsolidationConfig, consolidate_heads
from .distill import HeadDistillConfig, distill_heads
from .drift import DriftMonitor
from .engine import GenerationOutput, SpeculativeConfig, SpeculativeGenerator, profile_capacity
from .heads import SpeculativeHeads, SpeculativeHeadsConfig
from .trainer import SpecGRPOConfig, SpecGRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "BufferCapture",
    "ConsolidationCallback",
    "ConsolidationConfig",
    "DriftMonitor",
    "HeadBuffer",
    "consolidate_heads",
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
