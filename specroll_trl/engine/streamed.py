"""``streamed_linear``: a linear layer over 1 to ``MAX_ROWS`` rows that reads each weight row once, for
verification forwards over a few query tokens on CPU.

A drafted step's forward over 3-9 query tokens reads the same weights as a one-token forward, yet on a 2-core Xeon
the decoder's linears cost 1.7x their one-row time at 5 rows with ``F.linear`` (a GEMM that repacks the weight on
every call) and 1.5x with weights packed once for oneDNN or MKL (``benchmarks/README.md``, "A step at the
weight-read limit"). The kernel here streams every weight row from memory once, with a software prefetch ahead of
it, and multiplies it with every row of the input, which stays in cache: up to ~5 rows it runs at about the speed
of reading the weights. It reads the parameters in place (nothing packed, nothing copied), so it always computes
with the weights the trainer just updated.

It is C++ (``streamed_linear.cpp`` beside this module), built on first use with the system's C++ compiler
(``$CXX``, else ``c++``/``g++``) for this machine's instruction set, cached under ``$SPECROLL_HOME/kernels/`` by a
hash of the source, the compiler and the CPU's flags, and loaded through ``ctypes``; its OpenMP threads are
torch's. Where there is no compiler or the build fails, ``streamed_kernel_available()`` is false and the engine
chooses among the other kernels; ``SPECROLL_STREAMED_KERNEL=0`` turns it off. Like every kernel it is only a
candidate: ``engine.kernels`` measures it against ``F.linear`` and the packed kernel per weight shape and row count.
Its sums run in another order than a BLAS's: outputs agree to float rounding, as any two kernels' do.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from ..files import specroll_home

MAX_ROWS = 8  # the kernel has code for 1-8 rows; above, a GEMM's repacking is amortised
SOURCE = Path(__file__).with_name("streamed_linear.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

logger = logging.getLogger(__name__)


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU: built once (atomically, several processes may race)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    library = specroll_home() / "kernels" / f"streamed_linear-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_name(f"{library.name}.tmp{os.getpid()}")
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], capture_output=True, text=True,
                           check=True, timeout=300)
            os.replace(partial, library)
        finally:
            partial.unlink(missing_ok=True)
    return library


@functools.cache
def _library():
    """The loaded kernel, or None (turned off, no compiler, a failed build: the reason is logged once)."""
    if os.environ.get("SPECROLL_STREAMED_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.info("streamed linear kernel unavailable: no C++ compiler (set $CXX)")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("streamed linear kernel unavailable: building it with %s failed: %s", compiler, detail)
        return None
    library.streamed_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    library.streamed_linear.restype = ctypes.c_int
    return library


def streamed_kernel_available() -> bool:
    return _library() is not None


def streamable(weight: torch.Tensor) -> bool:
    """Whether the kernel can read this weight in place: float32, on CPU, contiguous, two-dimensional."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous())


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for at most ``MAX_ROWS`` rows of ``x`` (all but its last dimension), float32 on
    CPU, outside autograd; the weight must be ``streamable``."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features).contiguous()
    if not 0 < rows.shape[0] <= MAX_ROWS or x.dtype != torch.float32 or not streamable(weight):
        raise ValueError(f"streamed_linear takes 1-{MAX_ROWS} float32 rows and a contiguous float32 CPU weight; got "
                         f"{rows.shape[0]} rows of {x.dtype}, weight {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    _library().streamed_linear(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0], out_features,
                               in_features)  # returns non-zero only for a row count checked above
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out_features)
