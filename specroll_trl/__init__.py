"""specroll-trl: exact batched speculative rollouts for TRL's GRPOTrainer.

Layers, each importing only those below it: ``engine`` (the speculative generator; no TRL), ``adapt`` (Reflex,
capture, drift, consolidation, distillation), ``trainer`` (``SpecGRPOConfig``/``SpecGRPOTrainer``, imported lazily
so that the engine works without TRL), and the lab in ``experiments`` and ``cli``.
"""

from importlib import import_module

from .adapt import (
    BufferCapture,
    ConsolidationCallback,
    ConsolidationConfig,
    DriftMonitor,
    HeadBuffer,
    HeadDistillConfig,
    consolidate_heads,
    distill_heads,
)
from .engine import (
    GenerationOutput,
    GenerationStats,
    SpeculativeConfig,
    SpeculativeGenerator,
    SpeculativeHeads,
    SpeculativeHeadsConfig,
    StepHook,
)

__version__ = "0.1.0"

_LAZY = {"SpecGRPOConfig": "trainer", "SpecGRPOTrainer": "trainer"}


def __getattr__(name: str):
    if name in _LAZY:  # the trainer needs TRL; import it only when asked for
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BufferCapture",
    "ConsolidationCallback",
    "ConsolidationConfig",
    "DriftMonitor",
    "GenerationOutput",
    "GenerationStats",
    "HeadBuffer",
    "HeadDistillConfig",
    "SpecGRPOConfig",
    "SpecGRPOTrainer",
    "SpeculativeConfig",
    "SpeculativeGenerator",
    "SpeculativeHeads",
    "SpeculativeHeadsConfig",
    "StepHook",
    "consolidate_heads",
    "distill_heads",
]
