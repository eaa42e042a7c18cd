"""Writing into a cache (the zoo's policies, distilled heads): a folder appears whole or not at all."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield ``<out>.tmp<pid>`` to build in; when the block succeeds it replaces ``out``, and on any failure (or
    after the rename) no temporary folder is left behind."""
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
