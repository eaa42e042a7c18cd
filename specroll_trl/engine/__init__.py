"""The speculative engine: a Hugging Face causal LM + Medusa-style heads + a ``GenerationConfig`` -> exact rollouts.

It imports nothing from TRL, nor from the rest of this package: ``adapt`` and the trainer build on it.
"""

from .capacity import node_budget, profile_capacity
from .generator import GenerationOutput, SpeculativeConfig, SpeculativeGenerator
from .heads import SpeculativeHeads, SpeculativeHeadsConfig
from .hooks import StepFeedback, StepHook

__all__ = [
    "GenerationOutput",
    "SpeculativeConfig",
    "SpeculativeGenerator",
    "SpeculativeHeads",
    "SpeculativeHeadsConfig",
    "StepFeedback",
    "StepHook",
    "node_budget",
    "profile_capacity",
]
