"""``streamed_linears``: linear layers over 1 to ``MAX_ROWS`` rows that read each weight row once, for verification
forwards over a few query tokens on CPU.

A drafted step's forward over 3-9 query tokens reads the same weights as a one-token forward, yet on a 2-core Xeon
the decoder's linears cost ~1.5x their one-row time at 5 rows with ``F.linear`` (a GEMM that repacks the weight on
every call) or with weights packed once for oneDNN. The kernel here streams every weight row from memory once, with
a software prefetch ahead of it, and multiplies it with every row of the input, which stays in cache: there a
5-row pass cost ~1.3x a one-row pass, and a 4-node step 0.92x what it cost without this kernel
(``benchmarks/README.md``, "The weights streamed in place"). It reads the parameters in place (nothing packed,
nothing copied), so it always computes with the weights the trainer just updated; several weights that read one
input (a layer's query, key and value projections) are one call, their rows shared by the threads.

It is C++ (``streamed_linear.cpp`` beside this module), built on first use by ``engine.native``; its OpenMP
threads are torch's. Where there is no compiler or the build fails, ``streamed_kernel_available()`` is false and the
engine chooses among the other kernels; ``SPECROLL_STREAMED_KERNEL=0`` turns it off. Like every kernel it is only a
candidate: ``engine.kernels`` measures it against ``F.linear`` and the packed kernel per weight shape and row count.
Its sums run in another order than a BLAS's: outputs agree to float rounding, as any two kernels' do.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .native import load_library

MAX_ROWS = 8  # the kernel has code for 1-8 rows; at 9-16 it ran no faster than the packed kernel
MAX_MATRICES = 16  # weights computed as one product
SOURCE = Path(__file__).with_name("streamed_linear.cpp")


@functools.cache
def _library():
    """The loaded kernel, or None (turned off, no compiler, a failed build: the reason is logged once)."""
    library = load_library(SOURCE, "SPECROLL_STREAMED_KERNEL")
    if library is not None:
        library.streamed_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_long, ctypes.c_long]
        library.streamed_linear.restype = ctypes.c_int
    return library


def streamed_kernel_available() -> bool:
    return _library() is not None


def streamable(weight: torch.Tensor) -> bool:
    """Whether the kernel can read this weight in place: float32, on CPU, contiguous, two-dimensional."""
    return weight.dtype == torch.float32 and weight.is_cpu and weight.dim() == 2 and weight.is_contiguous()


def streamed_linears(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
                     ) -> list[torch.Tensor]:
    """``[F.linear(x, w, b) for w, b in zip(weights, biases)]`` as one product (1 to ``MAX_MATRICES`` weights of
    ``x``'s last size), for at most ``MAX_ROWS`` rows of ``x`` (all but its last dimension), float32 on CPU, outside
    autograd; every weight must be ``streamable``. Lean: it runs ~120 times a forward of a 30-layer model."""
    in_features, count = x.shape[-1], len(weights)
    rows = x.reshape(-1, in_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    m = rows.shape[0]
    if (not 0 < m <= MAX_ROWS or x.dtype != torch.float32 or not 0 < count <= MAX_MATRICES
            or not all(streamable(w) and w.shape[1] == in_features for w in weights)):
        raise ValueError(f"streamed_linear takes 1-{MAX_ROWS} float32 rows and 1-{MAX_MATRICES} contiguous float32 CPU "
                         f"weights of their width; got {m} rows of {x.dtype} x {in_features}, weights "
                         f"{[(w.dtype, tuple(w.shape)) for w in weights]}")
    sizes = [w.shape[0] for w in weights]
    outs = [torch.empty(m, n) for n in sizes]
    pointers = ctypes.c_void_p * count
    _library().streamed_linear(rows.data_ptr(), pointers(*[w.data_ptr() for w in weights]),
                               pointers(*[o.data_ptr() for o in outs]), (ctypes.c_long * count)(*sizes), count, m,
                               in_features)  # returns non-zero only for counts checked above
    shape = x.shape[:-1]
    return [(out if bias is None else out.add_(bias)).view(*shape, n) for out, bias, n in zip(outs, biases, sizes)]


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the streamed kernel (``streamed_linears`` of one weight)."""
    return streamed_linears(x, [weight], [bias])[0]
