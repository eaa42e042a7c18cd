"""Distilled heads cached on disk, keyed by everything that determines them: the policy's weights, the prompts and
the distillation settings. A second run on the same policy and data loads the heads instead of distilling again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import torch

from ..engine.heads import SpeculativeHeads
from ..files import atomic_folder, specroll_home
from .distill import REPORT_FILE, HeadDistillConfig, distill_heads, save_distilled

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the distillation recipe changes what the same key would produce


def default_cache_dir() -> Path:
    """``$SPECROLL_HOME/heads`` (``SPECROLL_HOME`` defaults to ``~/.cache/specroll_trl``)."""
    return specroll_home() / "heads"


def policy_fingerprint(model) -> str:
    """SHA-256 over the policy's parameter and buffer names, shapes, dtypes and bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# Heads fitted at length to a known policy ship with the package (the lab's data; the library only reads files).
SHIPPED_HEADS_DIR = Path(__file__).resolve().parents[1] / "experiments" / "data" / "heads"


def find_shipped_heads(model, kind: str = "path", root: str | Path | None = None,
                       key: str | None = None) -> Path | None:
    """The shipped heads folder of ``kind`` whose ``distill_report.json`` names this very policy (``policy_sha256``
    equal to :func:`policy_fingerprint`, or ``key`` when already computed) and holds weights, or ``None``. The one
    lookup of shipped heads: the trainer and the lab's presets both use it."""
    root = Path(root or SHIPPED_HEADS_DIR)
    reports = sorted(root.glob(f"*/{kind}/{REPORT_FILE}")) if root.is_dir() else []
    reports = [r for r in reports if (r.parent / "model.safetensors").is_file()]
    if not reports:
        return None
    key = key or policy_fingerprint(model)
    for report in reports:
        try:
            if json.loads(report.read_text()).get("policy_sha256") == key:
                return report.parent
        except (OSError, ValueError):
            continue
    return None


def cache_key(model, prompt_ids: list[list[int]], pad_token_id: int, config: HeadDistillConfig) -> str:
    settings = dataclasses.asdict(config)  # time bounds included: a run cut short by them is reused as such
    prompts = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()
    payload = {"format": CACHE_FORMAT, "policy": policy_fingerprint(model), "prompts": prompts,
               "pad": pad_token_id, "settings": settings}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cached_distill_heads(model, prompt_ids: list[list[int]], pad_token_id: int, config: HeadDistillConfig,
                         cache_dir: str | Path | None, progress: bool = True):
    """``distill_heads`` through the cache in ``cache_dir`` (``None``: no cache): returns ``(heads, report)``,
    ``report["cache"]`` saying ``"hit"``, ``"miss"`` or ``"off"``. A distillation cut short by its time bounds is
    cached too (``report["truncated"]``; the bounds are part of the key). A folder appears whole or not at all.
    The caller's random state is left as it was, hit or miss: a trainer that distils its heads draws the same
    rollouts afterwards as one that found them in the cache."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _distill_through_cache(model, prompt_ids, pad_token_id, config, cache_dir, progress)


def _distill_through_cache(model, prompt_ids, pad_token_id, config, cache_dir, progress):
    if cache_dir is None:
        heads, report = distill_heads(model, prompt_ids, pad_token_id, config, progress=progress)
        return heads, {**report, "cache": "off"}
    folder = Path(cache_dir) / cache_key(model, prompt_ids, pad_token_id, config)
    report_file = folder / REPORT_FILE
    if report_file.is_file():
        try:
            heads = SpeculativeHeads.from_pretrained(folder)
            heads.check_compatible(model)
            report = json.loads(report_file.read_text())
            logger.info("speculative heads loaded from the distillation cache: %s", folder)
            return heads, {**report, "cache": "hit", "cache_folder": str(folder)}
        except (OSError, ValueError) as err:  # an unreadable entry is rebuilt, not fatal
            logger.warning("ignoring the unreadable cached heads in %s: %s", folder, err)
    heads, report = distill_heads(model, prompt_ids, pad_token_id, config, progress=progress)
    report = {**report, "cache": "miss", "cache_folder": str(folder)}
    try:
        with atomic_folder(folder) as tmp:
            save_distilled(heads, report, tmp)
    except OSError as err:  # a read-only or full disk costs the next run a distillation, not this one its heads
        logger.warning("could not cache the distilled heads in %s: %s", folder, err)
    return heads, report
