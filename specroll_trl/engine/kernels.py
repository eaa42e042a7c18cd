"""``LinearKernels``: which kernel computes each of a model's linear layers in a forward over a given number of query
rows: ``F.linear``, the oneDNN-packed kernel (over the rows as they are, or padded), or the streamed one
(``engine/streamed.py``).

A verification forward over a few query tokens is where a CPU BLAS pays most above what reading the weights costs:
for more than one row ``F.linear`` runs a GEMM that repacks the weight on every call, so a forward over 3 tokens
costs about 1.7x one token's although it reads the same weights (``benchmarks/README.md``, "A step at the
weight-read limit"). A weight packed once in oneDNN's blocked layout is read once per call at any row count; the
streamed kernel reads the weight in place, row by row, once for up to 8 rows. Which is fastest depends on the
machine, the layer's shape and the row count (on these cores the packed ``lm_head`` wins at every row count, the
small decoder matrices lose at one row), so it is measured, never assumed, and in place. The packed kernel is not
monotonic in the rows: on 2 AMD EPYC cores SmolLM2's 121 products took 40 / 48 / 35 / 33 ms at 1 / 2 / 3 / 4 rows on
one thread (26 / 28 / 24 / 23 at two), so for 1-3 rows it is a candidate twice, as is and with the rows padded with
zeros to ``PADDED_ROWS`` (each row's outputs are its own: the padding's are dropped). Per weight shape and bucket
of query rows, the engine's own forwards take the kernels in turn until each has run ``TRIALS`` forwards, then the
fastest (by median; another than ``F.linear`` only if faster by at least ``1 - MIN_GAIN``) computes every later call
of every layer of that shape. Within one forward every layer of a shape runs the same kernel and the
forward's sample is their mean time per call: alternating the kernels call by call inside a forward timed each
kernel on other layers and in a cache the other kernel's reads had just disturbed, and on a 2-core Xeon left 4-6 of
30 choices on the kernel that runs up to 26% slower per call in steady state (``benchmarks/README.md``, "The kernels'
choice measured forward by forward"). A packed forward counts only when every copy it read was packed
in an earlier forward: one packed just before its call is still in cache, where in steady state the copy streams
from memory like the weight does. The drafting side's layers are measured apart from the model's, even where their
shapes agree: a head's few small weights stay in cache from step to step, a decoder's stream from memory. No
forward is spent on measuring: a new bucket settles within ``len(candidates) * TRIALS + 1`` of the forwards that use
it.

Layers a forward calls one after another on the same input tensor (a block's query, key and value projections, an
MLP's gate and up projections: *siblings*, learnt from the calls of the first forward a ``LinearKernels`` sees, the
engine's prefill) are one unit of the choice: packed, their weights are stacked into one matrix and computed as one
product, whose slices the later siblings return when they are called on that very tensor (same object, same version;
otherwise one computes alone); the streamed kernel computes them in one call too, reading each weight in place;
``F.linear`` computes each as the model does. On a 2-core Xeon the 210 decoder linears of SmolLM2 ran packed in one
product per set of siblings 5-15% faster than packed one by one at 1-17 rows (``benchmarks/README.md``, "Siblings
in one product").

A layer's weight is packed at its first packed call of a generation call and the copy dropped when the call
ends, so generation always reads the parameters the trainer updated (a weight's version counter is no witness:
trainers update parameters through ``.data``, which does not move it), layers whose choice is ``F.linear`` cost
no packing, and between calls (while the trainer trains) no copy takes memory; the time spent packing is counted
(``pack_seconds``). Only plain ``nn.Linear`` modules with whole (unsharded) float32 weights on CPU whose ``forward``
nobody replaced (accelerate's hooks, PEFT's wrappers keep theirs; a LoRA layer's base ``nn.Linear`` takes part) are
candidates, and only where oneDNN is built in or the streamed kernel was built: elsewhere (a GPU, ZeRO-3, FSDP) every
forward computes as the model does. During a generation call the packed copies double those weights' memory.

The drafting side takes part the same way for one call (``adopt``): the heads' linears and their vocabulary
projection (``VocabProjection.linear``, a draft vocabulary's rows of the ``lm_head``: at one row ``F.linear`` over
8,192 x 576 took 0.97 ms and the packed kernel 0.17 ms here, at three rows 2.6 against 0.19 ms). They are rebuilt
or retrained between calls, so only their choice, by weight shape, outlives a call.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .streamed import MAX_MATRICES, streamable, streamed_kernel_available, streamed_linears
from .streamed import MAX_ROWS as MAX_STREAMED_ROWS

LINEAR, PACKED, STREAMED, PADDED = 0, 1, 2, 3  # the kernels, as ``LinearKernels.choice`` names them
MAX_PACKED_ROWS = 256  # above this many query rows GEMM's own packing is amortised: F.linear, nothing measured
TRIALS = 3  # forwards per kernel, per weight shape and bucket, before the choice is made
MIN_GAIN = 0.95  # another kernel must be 5% faster to be chosen: a tie keeps the model's own (and its rounding)
PADDED_ROWS = 4  # the rows the padded kernel computes (fewer rows are padded up to it)


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


def eligible_linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear) and _eligible(m)]


def weight_shape(module: nn.Linear, drafting: bool = False) -> tuple[tuple[int, ...], bool, bool]:
    """What a kernel choice is made for: the weight's shape, whether a bias is added, and whether the layer drafts
    (the heads and their vocabulary projection) rather than belongs to the model."""
    return tuple(module.weight.shape), module.bias is not None, drafting


def siblings_shape(siblings: tuple[nn.Linear, ...], drafting: bool = False) -> tuple:
    """``weight_shape`` of a lone layer; for siblings computed as one product, every member's weight shape and
    whether any adds a bias."""
    if len(siblings) == 1:
        return weight_shape(siblings[0], drafting)
    return tuple(tuple(m.weight.shape) for m in siblings), any(m.bias is not None for m in siblings), drafting


@dataclass
class Trial:
    """One shape's measurement in the forward running: its kernel there, and the time and number of its calls."""

    kernel: int
    seconds: float = 0.0
    calls: int = 0
    spoiled: bool = False  # a copy was packed in this forward: it was read from cache


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def padded_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``packed_linear`` over ``x``'s rows padded with zero rows to ``PADDED_ROWS`` (more rows: as they are)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] >= PADDED_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    padded = rows.new_zeros(PADDED_ROWS, rows.shape[1])
    padded[:rows.shape[0]] = rows
    out = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")
    return out[:rows.shape[0]].view(*x.shape[:-1], out.shape[-1])  # the first rows: contiguous, no copy


@dataclass
class Packed:
    """Siblings' weights stacked and packed for one generation call, their stacked bias and each one's output width."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    widths: list[int]


def stacked_bias(siblings: tuple[nn.Linear, ...]) -> torch.Tensor | None:
    if all(m.bias is None for m in siblings):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                      for m in siblings])


class SiblingFinder:
    """Which linears a forward calls one after another on the same input tensor (a block's query, key and value
    projections; an MLP's gate and up projections), learnt from the calls of one forward."""

    def __init__(self):
        self.runs: list[list[nn.Linear]] = []
        self.last_input: torch.Tensor | None = None  # held, so that no later tensor can take its identity

    def record(self, module: nn.Linear, x: torch.Tensor) -> None:
        if self.runs and x is self.last_input:
            self.runs[-1].append(module)
        else:
            self.runs.append([module])
        self.last_input = x

    def siblings(self) -> dict[nn.Linear, tuple[nn.Linear, ...]]:
        """Each module called with others in a run -> the run; a module seen in two runs is left alone."""
        seen: dict[nn.Linear, int] = {}
        for run in self.runs:
            for module in run:
                seen[module] = seen.get(module, 0) + 1
        return {module: tuple(run) for run in self.runs if len(run) > 1 and all(seen[m] == 1 for m in run)
                for module in run}


class LinearKernels:
    """A model's eligible linear layers (and, for one generation call, those of modules it ``adopt``s), their packed
    weights, and per weight shape and bucket of query rows the choice between ``F.linear``, the packed kernel (as is
    or padded) and the streamed kernel, measured. Use ``with kernels.active():`` around a generation call and ``with
    kernels.forward(rows):`` around each forward whose kernels are chosen by its rows. ``LinearKernels(None)`` leaves
    every layer alone."""

    def __init__(self, model: nn.Module | None):
        self.enabled = model is not None and (packed_kernel_available() or streamed_kernel_available())
        self.modules = eligible_linears(model) if self.enabled else []
        if self.modules:
            streamed_kernel_available()  # built (once per machine and source) here, not inside a timed call
        self.adopted: list[nn.Linear] = []  # taking part in the running call only
        self.siblings: dict[nn.Linear, tuple[nn.Linear, ...]] | None = None  # None: not learnt yet
        self.finder = SiblingFinder()
        self.stash: dict[nn.Linear, tuple[torch.Tensor, int, torch.Tensor]] = {}  # input, its version, output
        self.packed: dict[tuple[nn.Linear, ...], Packed] = {}
        self.streamable: dict[tuple[nn.Linear, ...], bool] = {}  # units the streamed kernel reads, this call
        self.unit_shapes: dict[tuple[nn.Linear, ...], tuple] = {}  # the model's units -> their siblings_shape
        self.trials: dict[tuple, tuple[list[float], ...]] = {}  # (shape, bucket) -> per kernel, per forward
        self.running_trials: dict[tuple, Trial] = {}  # in the forward running
        self.choice: dict[tuple, int] = {}  # (shape, bucket) -> the kernel kept (LINEAR, PACKED, STREAMED, PADDED)
        self.bucket: int | None = None  # of the forward running, None: outside one (F.linear)
        self.running = False
        self.pack_seconds = 0.0
        # calls that packed a weight or measured the model's kernels: a step with one is not typical (up to twice as
        # slow). A drafting layer measured costs a step ~1 ms at most and is not counted: a width first drafted at a
        # rare row count measures the heads' kernels in up to nine of its first drafted steps, and left untimed
        # those were the budget's only chances to learn that width's cost there (at eight rows, one thread: 143
        # plain steps at three or four rows in one call, its four drafted ones all untimed)
        self.setup_calls = 0

    def units(self) -> list[tuple[nn.Linear, ...]]:
        """The model's eligible layers as they are computed: siblings together (once learnt), the others alone."""
        siblings = self.siblings or {}
        return list(dict.fromkeys(siblings.get(m, (m,)) for m in self.modules))

    def _packed(self, siblings: tuple[nn.Linear, ...]) -> Packed:
        """The siblings' weights stacked and packed as they are in this generation call (at their first use in it)."""
        packed = self.packed.get(siblings)
        if packed is None:
            start = time.perf_counter()
            weight = torch.cat([m.weight.detach() for m in siblings]) if len(siblings) > 1 else siblings[0].weight
            packed = self.packed[siblings] = Packed(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 3),
                                                    stacked_bias(siblings), [m.out_features for m in siblings])
            self.pack_seconds += time.perf_counter() - start
            self.setup_calls += 1
        return packed

    def _product(self, kernel: int, siblings: tuple[nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        """The first sibling's output from one product over all of them, packed or streamed; the others' wait in
        ``stash``."""
        if kernel in (PACKED, PADDED):
            packed = self._packed(siblings)
            out = (packed_linear if kernel == PACKED else padded_linear)(x, packed.weight, packed.bias)
            if len(siblings) == 1:
                return out
            parts = [part.contiguous() for part in out.split(packed.widths, dim=-1)]  # a model may `.view` them
        else:
            parts = streamed_linears(x, [m.weight for m in siblings], [m.bias for m in siblings])
        for module, part in zip(siblings[1:], parts[1:]):
            self.stash[module] = (x, x._version, part)
        return parts[0]

    def candidates(self, bucket: int) -> list[int]:
        """The kernels measured for a bucket of rows on this machine, ``F.linear`` first."""
        packed = packed_kernel_available()
        streamed = bucket <= MAX_STREAMED_ROWS and streamed_kernel_available()
        return [LINEAR] + [PACKED] * packed + [STREAMED] * streamed + [PADDED] * (packed and bucket < PADDED_ROWS)

    def _compute(self, kernel: int, module: nn.Linear, siblings: tuple[nn.Linear, ...], x: torch.Tensor):
        if kernel in (PACKED, PADDED) and siblings[0] is module:
            return self._product(kernel, siblings, x)
        if kernel == STREAMED and x.numel() <= MAX_STREAMED_ROWS * x.shape[-1]:
            unit = siblings if siblings[0] is module and len(siblings) <= MAX_MATRICES else (module,)
            streams = self.streamable.get(unit)
            if streams is None:  # once per unit and call: weights keep their layout inside a call
                streams = self.streamable[unit] = all(streamable(m.weight) for m in unit)
            if streams:
                return self._product(STREAMED, unit, x)
        return F.linear(x, module.weight, module.bias)

    def _forward(self, module: nn.Linear, drafting: bool = False):
        weight, bias = module.weight, module.bias
        alone = (module,)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.siblings is None and not drafting:
                self.finder.record(module, x)
            if self.bucket is None or torch.is_grad_enabled():
                return F.linear(x, weight, bias)
            siblings = alone if drafting or not self.siblings else self.siblings.get(module, alone)
            leads = siblings[0] is module
            if not leads:
                waiting = self.stash.pop(module, None)
                if waiting is not None and waiting[0] is x and waiting[1] == x._version:
                    return waiting[2]  # computed with its first sibling's packed product
            shape = self.unit_shapes.get(siblings) if not drafting else siblings_shape(siblings, True)
            if shape is None:  # once per unit of the model (drafting layers are rebuilt every call: not kept)
                shape = self.unit_shapes[siblings] = siblings_shape(siblings)
            key = (shape, self.bucket)
            kernel = self.choice.get(key)
            if kernel is not None:
                return self._compute(kernel, module, siblings, x)
            trial = self.running_trials.get(key)
            if trial is None:
                times = self.trials.setdefault(key, tuple([] for _ in range(PADDED + 1)))
                turn = min(self.candidates(self.bucket), key=lambda k: len(times[k]))  # F.linear first
                trial = self.running_trials[key] = Trial(turn)
            if trial.kernel != LINEAR and not leads:  # its first sibling ran on another input: alone, untimed
                return F.linear(x, weight, bias)
            trial.spoiled |= trial.kernel in (PACKED, PADDED) and siblings not in self.packed
            start = time.perf_counter()
            out = self._compute(trial.kernel, module, siblings, x)
            trial.seconds += time.perf_counter() - start
            trial.calls += leads  # a call: all the siblings, one product packed or one call each
            self.setup_calls += not drafting
            return out

        return forward

    def _settle(self) -> None:
        """Fold the forward's trials into each shape's samples; choose where every kernel has ``TRIALS``."""
        for key, trial in self.running_trials.items():
            times = self.trials[key]
            if not trial.spoiled:
                times[trial.kernel].append(trial.seconds / trial.calls)
            candidates = self.candidates(key[1])
            if min(len(times[k]) for k in candidates) >= TRIALS:
                median = {k: statistics.median(times[k]) for k in candidates}
                fastest = min(candidates, key=median.get)
                self.choice[key] = fastest if median[fastest] < MIN_GAIN * median[LINEAR] else LINEAR
        self.running_trials.clear()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside, the eligible layers compute with the kernel chosen for the rows of the ``forward(rows)`` block they
        run in (``F.linear`` outside one); the packed copies made inside are dropped on leaving."""
        if not self.enabled:
            yield
            return
        self.packed.clear()
        for module in self.modules:
            module.forward = self._forward(module)
        self.running = True
        try:
            yield
        finally:
            self.bucket, self.running = None, False
            self._learn_siblings()
            self.packed.clear()
            self.streamable.clear()
            self.stash.clear()
            for module in self.modules + self.adopted:
                module.__dict__.pop("forward", None)
            self.adopted.clear()

    def adopt(self, module: nn.Module) -> None:
        """Inside ``active()``, the eligible linears of ``module`` (the heads, their vocabulary projection) take part
        too, until the block ends; their choices are kept by shape for later calls."""
        if self.running:
            for linear in eligible_linears(module):
                linear.forward = self._forward(linear, drafting=True)
                self.adopted.append(linear)

    @contextmanager
    def forward(self, rows: int) -> Iterator[None]:
        """One forward over ``rows`` query rows: each layer with the kernel chosen (or being measured) for its shape
        and their bucket."""
        if not self.enabled or rows > MAX_PACKED_ROWS:
            yield
            return
        self._learn_siblings()
        self.bucket = rows_bucket(rows)
        try:
            yield
        except BaseException:
            self.running_trials.clear()  # a forward cut short measures nothing
            raise
        else:
            self._settle()
        finally:
            self.bucket = None
            self.stash.clear()
            self._learn_siblings()

    def _learn_siblings(self) -> None:
        """Once a forward of the model ran (the prefill, or the first forward block), fix its siblings for good."""
        if self.siblings is None and self.finder.runs and self.bucket is None:
            self.siblings = self.finder.siblings()
            self.finder = SiblingFinder()


_KERNELS: weakref.WeakKeyDictionary[nn.Module, LinearKernels] = weakref.WeakKeyDictionary()


def kernels_of(model: nn.Module) -> LinearKernels:
    """The model's ``LinearKernels``, one per model however many engines run on it (one packed copy, one choice)."""
    kernels = _KERNELS.get(model)
    if kernels is None:
        kernels = _KERNELS[model] = LinearKernels(model)
    return kernels
