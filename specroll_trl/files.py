"""The local cache: where it is (``$SPECROLL_HOME``), and writing into it so that a folder appears whole or not at
all (the zoo's policies, distilled heads)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def specroll_home() -> Path:
    """Root of the local cache: ``$SPECROLL_HOME``, default ``~/.cache/specroll_trl``."""
    return Path(os.environ.get("SPECROLL_HOME", Path.home() / ".cache" / "specroll_trl")).expanduser()


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
