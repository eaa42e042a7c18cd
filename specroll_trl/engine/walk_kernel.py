"""``walk``: a drawn tree's rejection walk as one C++ call on CPU, ``drawn.rejection_walk`` (the reference, and the
path on a GPU or where the kernel is not built) everywhere else.

Same contract, same decisions: on the same uniforms the kernel accepts the same nodes and samples the same next root
as the reference, its chances and reaches agree to float rounding (its sums run in float64 where the reference's
run in float32). What it saves is host work: the reference issues ~150 tensor operations on tiny tensors a step
(1.4-1.6 ms of a 4-node step at one row on two AMD cores, against 0.19 ms through the kernel). Built on first use by
``engine.native`` (``rejection_walk.cpp`` beside this module); ``SPECROLL_WALK_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .drawn import DrawnDraft, RejectionOutcome, rejection_walk
from .native import load_library

SOURCE = Path(__file__).with_name("rejection_walk.cpp")


@functools.cache
def _library():
    library = load_library(SOURCE, "SPECROLL_WALK_KERNEL")
    if library is not None:
        library.rejection_walk.argtypes = ([ctypes.c_int64] * 4 + [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
                                           + [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p]
                                           + [ctypes.c_int64] + [ctypes.c_void_p] + [ctypes.c_int64]
                                           + [ctypes.c_void_p] * 6)
        library.rejection_walk.restype = ctypes.c_int
    return library


def walk_kernel_available() -> bool:
    return _library() is not None


def _pointer(tensor: torch.Tensor | None):
    return None if tensor is None else tensor.data_ptr()


def walk(draft: DrawnDraft, probs: torch.Tensor, fixed: int, uniforms: torch.Tensor) -> RejectionOutcome:
    """``drawn.rejection_walk(draft, probs, fixed, uniforms)``, through the kernel where it can run: float32
    ``probs`` and ``q`` on CPU, a tree with children. ``uniforms [B, D+2, K]`` as the reference reads them; the
    draw outside the draft vocabulary takes its own uniform per row, as the reference does."""
    shape, batch = draft.shape, probs.shape[0]
    if (probs.device.type != "cpu" or probs.dtype != torch.float32 or draft.q.dtype != torch.float32
            or shape.max_depth < 1 or not walk_kernel_available()):
        return rejection_walk(draft, probs, fixed, uniforms)
    width = shape.children.shape[1]
    outside = torch.rand(batch, dtype=torch.float64) if draft.vocab is not None else None
    accepted = torch.empty((batch, shape.max_depth + 1), dtype=torch.long)
    next_root = torch.empty(batch, dtype=torch.long)
    alpha_sum = torch.empty((shape.max_depth, width), dtype=torch.float64)
    tried = torch.empty_like(alpha_sum)
    reach = torch.empty((batch, shape.size), dtype=torch.float64)
    inputs = [t.contiguous() for t in (shape.parent, shape.rank, shape.depth, shape.children, shape.ancestor_at,
                                       draft.q, draft.slot, draft.index, probs, uniforms)]
    parent, rank, depth, children, ancestor_at, q, slot, index, probs, uniforms = inputs
    vocab = None if draft.vocab is None else draft.vocab.contiguous()
    failed = _library().rejection_walk(
        shape.size, width, shape.max_depth, ancestor_at.shape[1], *map(_pointer, (parent, rank, depth, children,
                                                                                   ancestor_at)),
        batch, q.shape[1], q.shape[2], _pointer(q), _pointer(slot), _pointer(index), _pointer(vocab), probs.shape[-1],
        _pointer(probs), fixed, _pointer(uniforms), uniforms.shape[-1], _pointer(outside),
        *map(_pointer, (accepted, next_root, alpha_sum, tried, reach)))
    if failed:
        raise ValueError(f"rejection walk kernel: inconsistent sizes (tree of {shape.size} nodes, {width} children "
                         f"a node, depth {shape.max_depth}; uniforms {tuple(uniforms.shape)})")
    return RejectionOutcome(accepted, next_root, alpha_sum, tried, reach)
