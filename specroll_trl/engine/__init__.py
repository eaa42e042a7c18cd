"""The speculative engine: a Hugging Face causal LM + Medusa-style heads + a ``GenerationConfig`` -> exact rollouts.

It imports nothing from TRL, nor from the rest of this package: ``adapt`` and the trainer build on it.
"""

from .budget import FixedBudget, NodeBudget, OnlineBudget, node_budget
from .generator import GenerationOutput, GenerationStats, SpeculativeConfig, SpeculativeGenerator
from .heads import SpeculativeHeads, SpeculativeHeadsConfig
from .hooks import GenerationContext, StepFeedback, StepHook

__all__ = [
    "FixedBudget",
    "GenerationContext",
    "GenerationOutput",
    "GenerationStats",
    "NodeBudget",
    "OnlineBudget",
    "SpeculativeConfig",
    "SpeculativeGenerator",
    "SpeculativeHeads",
    "SpeculativeHeadsConfig",
    "StepFeedback",
    "StepHook",
    "node_budget",
]
