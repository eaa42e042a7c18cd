"""Keeping the heads in step with a moving policy: offline distillation, Reflex (the fast, per-trajectory
correction), the capture buffer, the drift monitor and head-only consolidation (the slow path).

Builds on ``specroll_trl.engine`` only; nothing here imports TRL.
"""

from .buffer import BufferCapture, HeadBuffer
from .consolidation import ConsolidationCallback, ConsolidationConfig, ConsolidationReport, consolidate_heads
from .distill import HeadDistillConfig, distill_heads
from .drift import DriftMonitor

__all__ = [
    "BufferCapture",
    "ConsolidationCallback",
    "ConsolidationConfig",
    "ConsolidationReport",
    "DriftMonitor",
    "HeadBuffer",
    "HeadDistillConfig",
    "consolidate_heads",
    "distill_heads",
]
