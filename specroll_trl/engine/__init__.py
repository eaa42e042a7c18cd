"""The speculative engine: a Hugging Face causal LM + Medusa-style heads + a ``GenerationConfig`` -> exact rollouts.

It imports nothing from TRL, nor from the rest of this package: ``adapt`` and the trainer build on it.
"""

from .capacity import node_budget, profile_capacity
from .generator import GenerationOutput, GenerationStats, SpeculativeConfig, SpeculativeGenerator
from .heads import SpeculativeHeads, SpeculativeHeadsConfig
from .hooks import GenerationContext, StepFeedback, StepHook

__all__ = [
    "GenerationContext",
    "GenerationOutput",
    "GenerationStats",
    "SpeculativeConfig",
    "SpeculativeGenerator",
    "SpeculativeHeads",
    "SpeculativeHeadsConfig",
    "StepFeedback",
    "StepHook",
    "node_budget",
    "profile_capacity",
]
