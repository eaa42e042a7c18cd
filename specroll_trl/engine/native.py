"""Building and loading the engine's C++ kernels (``*.cpp`` beside this module): on first use, with the system's C++
compiler (``$CXX``, else ``c++``/``g++``) for this machine's instruction set, cached under ``$SPECROLL_HOME/kernels/``
by a hash of the source, the flags, the compiler and the CPU's flags, loaded through ``ctypes``. Their OpenMP threads
are torch's (the library binds to the ``libgomp`` torch already loaded). Each kernel has an environment switch
(``=0`` turns it off) and a PyTorch path the engine takes where it is off, absent or failed to build.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

from ..files import specroll_home

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

logger = logging.getLogger(__name__)


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(source: Path, compiler: str) -> Path:
    """The shared library for this source, compiler and CPU: built once (atomically, several processes may race)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    library = specroll_home() / "kernels" / f"{source.stem}-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_name(f"{library.name}.tmp{os.getpid()}")
        try:
            subprocess.run([compiler, *FLAGS, str(source), "-o", str(partial)], capture_output=True, text=True,
                           check=True, timeout=300)
            os.replace(partial, library)
        finally:
            partial.unlink(missing_ok=True)
    return library


def load_library(source: Path, switch: str) -> ctypes.CDLL | None:
    """``source`` built and loaded, or None: turned off (``$switch=0``), no compiler, or a failed build (the reason
    logged). Callers cache the result."""
    if os.environ.get(switch, "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.info("%s unavailable: no C++ compiler (set $CXX)", source.name)
        return None
    try:
        return ctypes.CDLL(str(_build(source, compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("%s unavailable: building it with %s failed: %s", source.name, compiler, detail)
        return None
