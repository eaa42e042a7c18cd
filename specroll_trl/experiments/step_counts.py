"""What a decoding step does besides the model's forward, counted: tensor operations, host-device synchronisations
and Python lines, per step, for ``generate``, the engine without drafts and the engine with a tree.

On a GPU a decoding step of a small policy takes a few milliseconds, so what the engine does around the forward is
what eats a speculative gain: each tensor operation is a kernel launch, each synchronisation (``.item()``,
``.tolist()``, ``bool(t)``, ``nonzero``, boolean indexing) stalls the launch queue, and each Python iteration over
rows, nodes or depths is host time. These counters read them on any device:

  * ``ops``: ATen operations dispatched outside the model's forward (a ``TorchDispatchMode``);
  * ``kernels``: those of them that compute or copy (not a view, whose result aliases its input without writing):
    on a GPU, the launches;
  * ``syncs``: calls that must read a tensor's value on the host (a ``TorchFunctionMode``: ``item``, ``tolist``,
    ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``nonzero``, ``unique``, ``equal``, ``masked_select``
    and indexing with a boolean tensor), outside the model's forward and outside the engine's planning; the node
    budget keeps its estimates in host tensors by design (on a GPU only its copy of a drafted step's path scores
    crosses), and so does the drawn trees' shape (rebuilt every ``refresh`` steps from one copy of the acceptance
    rates by rank, ``AcceptanceByRank.shape``), so their reads are counted apart, ``budget_syncs``;
  * ``lines``: Python lines executed in ``specroll_trl/engine`` (``sys.settrace``): what grows with a loop over
    rows or nodes.

Counts are totals over a call's decoding loop (the engine's: from its first draft to its last step; ``generate``'s:
the whole call) divided by its decoding steps (forwards after the prefill).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine.drawn import AcceptanceByRank

ENGINE_DIR = str(Path(__file__).resolve().parents[1] / "engine")
BUDGET_FILE = str(Path(ENGINE_DIR) / "budget.py")
PLANNING_CODES = {AcceptanceByRank.shape.__code__}  # host-side planning outside budget.py
SYNC_METHODS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique", "equal",
                "masked_select", "argwhere"}


@dataclass
class StepCounts:
    ops: float
    kernels: float
    syncs: float
    budget_syncs: float
    lines: float
    steps: int

    def as_dict(self) -> dict:
        return {"ops_per_step": self.ops, "kernels_per_step": self.kernels, "syncs_per_step": self.syncs,
                "budget_syncs_per_step": self.budget_syncs,
                "engine_lines_per_step": self.lines, "steps": self.steps}


class _Counter(TorchDispatchMode):
    def __init__(self, flags: dict):
        super().__init__()
        self.flags, self.ops, self.kernels = flags, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.flags["active"] and not self.flags["in_model"]:
            self.ops += 1
            self.kernels += not _is_view(func)
        return func(*args, **(kwargs or {}))


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _name(func) -> str:
    return getattr(func, "__name__", "")


class _Syncs(TorchFunctionMode):
    def __init__(self, flags: dict):
        super().__init__()
        self.flags, self.syncs, self.budget_syncs = flags, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.flags["active"] and not self.flags["in_model"]:
            name = _name(func)
            if name in SYNC_METHODS or (name in ("__getitem__", "__setitem__") and len(args) > 1
                                        and _has_bool_index(args[1])):
                if self.flags["in_budget"]:
                    self.budget_syncs += 1
                else:
                    self.syncs += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextmanager
def counting(model, active: bool = True):
    """Count ops, syncs and engine lines outside ``model``'s forward while ``flags["active"]`` holds; yields
    ``(flags, result)``, ``result`` filled on exit."""
    flags, result = {"in_model": False, "active": active, "in_budget": 0}, {}
    pre = model.register_forward_pre_hook(lambda *a: flags.__setitem__("in_model", True))
    post = model.register_forward_hook(lambda *a: flags.__setitem__("in_model", False))
    lines = [0]

    def trace(frame, event, arg):
        if not frame.f_code.co_filename.startswith(ENGINE_DIR):
            return None
        budget = frame.f_code.co_filename == BUDGET_FILE or frame.f_code in PLANNING_CODES
        flags["in_budget"] += budget

        def local(frame, event, arg):
            if event == "line" and flags["active"] and not flags["in_model"]:
                lines[0] += 1
            elif event == "return":
                flags["in_budget"] -= budget
            return local

        return local

    ops, syncs = _Counter(flags), _Syncs(flags)
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        with syncs, ops:
            yield flags, result
    finally:
        sys.settrace(previous)
        pre.remove()
        post.remove()
        result.update(ops=ops.ops, kernels=ops.kernels, syncs=syncs.syncs, budget_syncs=syncs.budget_syncs,
                      lines=lines[0])


def _per_step(counts: dict, steps: int) -> StepCounts:
    return StepCounts(*(counts[name] / steps for name in ("ops", "kernels", "syncs", "budget_syncs", "lines")), steps)


def count_engine(engine, input_ids, attention_mask, seed: int = 0) -> StepCounts:
    """Per-step counts of one ``engine.generate`` call (prefill and finish spread over the steps)."""
    torch.manual_seed(seed)
    draft, finish = engine._draft, engine._finish
    with counting(engine.model, active=False) as (flags, counts):
        def first_draft(*args):
            flags["active"] = True
            return draft(*args)

        def last_step(*args):
            flags["active"] = False
            return finish(*args)

        engine._draft, engine._finish = first_draft, last_step
        try:
            stats = engine.generate(input_ids, attention_mask).stats
        finally:
            del engine._draft, engine._finish
    steps = max(1, stats.forwards - 1)
    return _per_step(counts, steps)


def count_generate(model, input_ids, attention_mask, generation_config, seed: int = 0) -> StepCounts:
    """Per-step counts of ``model.generate`` (its own work around the forward; it runs no engine lines)."""
    torch.manual_seed(seed)
    with counting(model) as (_, counts):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
    steps = max(1, out.shape[1] - input_ids.shape[1] - 1)
    return _per_step(counts, steps)


def bench_counts(model_name: str, batch_sizes=(1, 8), nodes=(4,), max_new_tokens: int = 64, temperature: float = 1.0,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, progress: bool = True) -> list[dict]:
    """One record per (batch size, mode): per-step counts of ``generate``, the engine without drafts (``fixed_0``)
    and with ``N`` nodes per row of each rule (``fixed_N_<rule>``), on the bench prompts (GSM8K-test chat prompts
    for a pretrained preset). The counts do not depend on the machine: a GPU run reads against a CPU one."""
    from ..adapt.samples import left_pad
    from ..engine import SpeculativeGenerator
    from .heads_bench import bench_prompts
    from .zoo import load_heads, load_policy, trl_generation_config

    model, tokenizer = load_policy(model_name, progress=progress, dtype=dtype)
    heads = load_heads(model_name, progress=progress)
    model, heads = model.to(device), heads.to(device=device, dtype=dtype)
    gc = trl_generation_config(model, tokenizer, max_new_tokens, temperature)
    records = []
    for batch in batch_sizes:
        ids, mask = (t.to(device) for t in left_pad(bench_prompts(tokenizer, batch), tokenizer.pad_token_id))
        modes = {"generate": None, "fixed_0": dict(max_nodes=0)}
        modes.update({f"fixed_{n}_{rule}": dict(max_nodes=n, candidates=rule)
                      for n in nodes for rule in ("top-k", "drawn")})
        for mode, options in modes.items():
            if options is None:
                counts = count_generate(model, ids, mask, gc)
            else:
                engine = SpeculativeGenerator(model, heads, gc, capacity=10**9, **options)
                engine.generate(ids, mask, max_new_tokens=8)  # warm-up: kernel choices, drawn shapes
                counts = count_engine(engine, ids, mask)
            records.append({"model": model_name, "batch_size": batch, "mode": mode, "device": device,
                            "temperature": temperature, **counts.as_dict()})
            if progress:
                print(f"batch {batch:>3} {mode:<16} ops/step {counts.ops:7.1f}  kernels/step {counts.kernels:7.1f}  "
                      f"syncs/step {counts.syncs:5.2f} "
                      f"(budget {counts.budget_syncs:4.2f})  engine lines/step {counts.lines:6.1f}", flush=True)
    return records
