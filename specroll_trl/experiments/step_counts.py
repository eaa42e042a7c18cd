"""What a decoding step does besides the model's forward, counted: tensor operations, host-device synchronisations
and Python lines, per step, for ``generate``, the engine without drafts and the engine with a tree.

On a GPU a decoding step of a small policy takes a few milliseconds, so what the engine does around the forward is
what eats a speculative gain: each tensor operation is a kernel launch, each synchronisation (``.item()``,
``.tolist()``, ``bool(t)``, ``nonzero``, boolean indexing) stalls the launch queue, and each Python iteration over
rows, nodes or depths is host time. These counters read them on any device:

  * ``ops``: ATen operations dispatched outside the model's forward (a ``TorchDispatchMode``);
  * ``syncs``: calls that must read a tensor's value on the host (a ``TorchFunctionMode``: ``item``, ``tolist``,
    ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``nonzero``, ``unique``, ``masked_select`` and indexing
    with a boolean tensor), outside the model's forward;
  * ``lines``: Python lines executed in ``specroll_trl/engine`` (``sys.settrace``): what grows with a loop over
    rows or nodes.

Counts are totals over a call divided by its decoding steps (forwards after the prefill).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ENGINE_DIR = str(Path(__file__).resolve().parents[1] / "engine")
SYNC_METHODS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
                "masked_select", "argwhere"}


@dataclass
class StepCounts:
    ops: float
    syncs: float
    lines: float
    steps: int

    def as_dict(self) -> dict:
        return {"ops_per_step": self.ops, "syncs_per_step": self.syncs, "engine_lines_per_step": self.lines,
                "steps": self.steps}


class _Counter(TorchDispatchMode):
    def __init__(self, flags: dict):
        super().__init__()
        self.flags, self.ops = flags, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.flags["in_model"]:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _name(func) -> str:
    return getattr(func, "__name__", "")


class _Syncs(TorchFunctionMode):
    def __init__(self, flags: dict):
        super().__init__()
        self.flags, self.syncs = flags, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.flags["in_model"]:
            name = _name(func)
            if name in SYNC_METHODS or (name in ("__getitem__", "__setitem__") and len(args) > 1
                                        and _has_bool_index(args[1])):
                self.syncs += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextmanager
def counting(model):
    """Count ops, syncs and engine lines outside ``model``'s forward; yields a dict filled on exit."""
    flags, result = {"in_model": False}, {}
    pre = model.register_forward_pre_hook(lambda *a: flags.__setitem__("in_model", True))
    post = model.register_forward_hook(lambda *a: flags.__setitem__("in_model", False))
    lines = [0]

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(ENGINE_DIR):
            return None

        def local(frame, event, arg):
            if event == "line" and not flags["in_model"]:
                lines[0] += 1
            return local

        return local

    ops, syncs = _Counter(flags), _Syncs(flags)
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        with syncs, ops:
            yield result
    finally:
        sys.settrace(previous)
        pre.remove()
        post.remove()
        result.update(ops=ops.ops, syncs=syncs.syncs, lines=lines[0])


def count_engine(engine, input_ids, attention_mask, seed: int = 0) -> StepCounts:
    """Per-step counts of one ``engine.generate`` call (prefill and finish spread over the steps)."""
    torch.manual_seed(seed)
    with counting(engine.model) as counts:
        stats = engine.generate(input_ids, attention_mask).stats
    steps = max(1, stats.forwards - 1)
    return StepCounts(counts["ops"] / steps, counts["syncs"] / steps, counts["lines"] / steps, steps)


def count_generate(model, input_ids, attention_mask, generation_config, seed: int = 0) -> StepCounts:
    """Per-step counts of ``model.generate`` (its own work around the forward; it runs no engine lines)."""
    torch.manual_seed(seed)
    with counting(model) as counts:
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
    steps = max(1, out.shape[1] - input_ids.shape[1] - 1)
    return StepCounts(counts["ops"] / steps, counts["syncs"] / steps, counts["lines"] / steps, steps)
