"""``LinearKernels``: which kernel computes each of a model's linear layers in a forward over a given number of query
rows.

A verification forward over a few query tokens is where a CPU BLAS pays most above what reading the weights costs:
for more than one row ``F.linear`` runs a GEMM that repacks the weight on every call, so a forward over 3 tokens
costs about 1.7x one token's although it reads the same weights (``benchmarks/README.md``, "A step at the
weight-read limit"). A weight packed once in oneDNN's blocked layout is read once per call at any row count.
Which is faster depends on the machine, the layer's shape and the row count (on these cores the packed
``lm_head`` wins at every row count, the small decoder matrices lose at one row), so it is measured, never
assumed, and in place: per weight shape and bucket of query rows, the calls of the layers of that shape inside
the engine's own forwards alternate the two kernels until each has run ``TRIALS`` times, then the faster (by median,
by at least ``1 - MIN_GAIN``) computes every later call of every layer of that shape. No forward is spent on
measuring, and a decoder's repeated layers settle a new bucket within its first forward (measured per layer, every
layer took six forwards, half of its calls on the slower kernel; a layer with a shape of its own, such as the
``lm_head``, still does).

A layer's weight is packed at its first packed call of a generation call and the copy dropped when the call
ends, so generation always reads the parameters the trainer updated (a weight's version counter is no witness:
trainers update parameters through ``.data``, which does not move it), layers whose choice is ``F.linear`` cost
no packing, and between calls (while the trainer trains) no copy takes memory; the time spent packing is counted
(``pack_seconds``). Only plain ``nn.Linear`` modules with whole (unsharded) float32 weights on CPU whose ``forward``
nobody replaced (accelerate's hooks, PEFT's wrappers keep theirs; a LoRA layer's base ``nn.Linear`` takes part) are
candidates, and only where oneDNN is built in: elsewhere (a GPU, ZeRO-3, FSDP) every forward
computes as the model does. During a generation call the packed copies double those weights' memory.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

MAX_PACKED_ROWS = 256  # above this many query rows GEMM's own packing is amortised: F.linear, nothing measured
TRIALS = 3  # calls per kernel, per weight shape and bucket, before the choice is made
MIN_GAIN = 0.95  # packed must be 5% faster to be chosen: a tie keeps the model's own kernel (and its rounding)


def packed_kernel_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def rows_bucket(rows: int) -> int:
    """Query-row counts that share a choice: 1-4 each alone, then powers of two (5-8 -> 8, 9-16 -> 16, ...)."""
    return rows if rows <= 4 else 1 << (rows - 1).bit_length()


def _eligible(module: nn.Module) -> bool:
    weight = module.weight
    return (type(module) is nn.Linear and "forward" not in module.__dict__ and type(weight.data) is torch.Tensor
            and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.numel() > 0)  # not sharded (ZeRO-3: empty; FSDP2: DTensor), not on an accelerator


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearKernels:
    """A model's eligible linear layers, their packed weights, and per layer and bucket of query rows the choice
    between ``F.linear`` and the packed kernel, measured for each weight shape. Use ``with kernels.active():`` around
    a generation call and ``with kernels.forward(rows):`` around each forward whose kernels are chosen by its rows."""

    def __init__(self, model: nn.Module):
        self.modules = ([m for m in model.modules() if isinstance(m, nn.Linear) and _eligible(m)]
                        if packed_kernel_available() else [])
        self.packed: dict[nn.Linear, torch.Tensor] = {}
        shapes = [(tuple(m.weight.shape), m.bias is not None) for m in self.modules]
        self.shape_of = [sorted(set(shapes)).index(s) for s in shapes]  # layer -> its shape's id
        self.trials: dict[tuple[int, int], tuple[list[float], list[float]]] = {}  # (shape, bucket) -> seconds
        self.choice: dict[tuple[int, int], bool] = {}  # (layer, bucket) -> packed wins
        self.bucket: int | None = None  # of the forward running, None: outside one (F.linear)
        self.pack_seconds = 0.0
        self.setup_calls = 0  # calls that packed a weight or measured the kernels: a forward with one is not typical

    def _packed(self, module: nn.Linear) -> torch.Tensor:
        """The module's weight packed as it is in this generation call (packed at its first use in the call)."""
        packed = self.packed.get(module)
        if packed is None:
            start = time.perf_counter()
            packed = self.packed[module] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 3)
            self.pack_seconds += time.perf_counter() - start
            self.setup_calls += 1
        return packed

    def _forward(self, index: int, module: nn.Linear):
        weight, bias = module.weight, module.bias

        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.bucket is None or torch.is_grad_enabled():
                return F.linear(x, weight, bias)
            key = (index, self.bucket)
            packed = self.choice.get(key)
            if packed is not None:
                return packed_linear(x, self._packed(module), bias) if packed else F.linear(x, weight, bias)
            shape = self.shape_of[index]
            times = self.trials.setdefault((shape, self.bucket), ([], []))
            packed_weight = self._packed(module) if len(times[1]) < len(times[0]) else None  # F.linear first
            start = time.perf_counter()
            out = F.linear(x, weight, bias) if packed_weight is None else packed_linear(x, packed_weight, bias)
            times[packed_weight is not None].append(time.perf_counter() - start)
            self.setup_calls += 1
            if len(times[1]) >= TRIALS:
                packed = statistics.median(times[1]) < MIN_GAIN * statistics.median(times[0])
                self.choice.update({(i, self.bucket): packed for i, s in enumerate(self.shape_of) if s == shape})
            return out

        return forward

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside, the eligible layers compute with the kernel chosen for the rows of the ``forward(rows)`` block they
        run in (``F.linear`` outside one); the packed copies made inside are dropped on leaving."""
        if not self.modules:
            yield
            return
        self.packed.clear()
        for index, module in enumerate(self.modules):
            module.forward = self._forward(index, module)
        try:
            yield
        finally:
            self.bucket = None
            self.packed.clear()
            for module in self.modules:
                module.__dict__.pop("forward", None)

    @contextmanager
    def forward(self, rows: int) -> Iterator[None]:
        """One forward over ``rows`` query rows: each layer with the kernel chosen (or being measured) for it and
        their bucket."""
        if not self.modules or rows > MAX_PACKED_ROWS:
            yield
            return
        self.bucket = rows_bucket(rows)
        try:
            yield
        finally:
            self.bucket = None


_KERNELS: weakref.WeakKeyDictionary[nn.Module, LinearKernels] = weakref.WeakKeyDictionary()


def kernels_of(model: nn.Module) -> LinearKernels:
    """The model's ``LinearKernels``, one per model however many engines run on it (one packed copy, one choice)."""
    kernels = _KERNELS.get(model)
    if kernels is None:
        kernels = _KERNELS[model] = LinearKernels(model)
    return kernels
