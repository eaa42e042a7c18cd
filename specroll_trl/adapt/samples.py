"""On-policy samples for head distillation: drawn by the engine at large batch, resumable, stored as token ids.

``sample_to_folder`` samples a list of prompts shard by shard (one ``generate`` call of ``batch_size`` prompts per
shard, seeded by the shard's index) and writes each shard as soon as it is done, so a killed run resumes where it
stopped and a rerun with the same arguments reproduces the same ids. Only token ids are kept: hidden states and the
target's distributions are recomputed from them by one teacher-forced forward (``distill.build_stream``), far
cheaper per token than sampling. ``pack_samples`` / ``read_samples`` keep a whole sample set in one small
safetensors file, which ships beside the heads so a rebuild needs no re-sampling.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..engine.generator import SpeculativeGenerator
from ..engine.heads import SpeculativeHeads

Pair = tuple[list[int], list[int]]


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` of unpadded prompts."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def sampling_config(model, temperature: float, max_new_tokens: int) -> GenerationConfig:
    """Plain ancestral sampling at ``temperature`` (no top-k / top-p), the policy's eos ids."""
    gen = model.generation_config
    return GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                            max_new_tokens=max_new_tokens, eos_token_id=gen.eos_token_id,
                            pad_token_id=gen.pad_token_id, bos_token_id=gen.bos_token_id)


@torch.no_grad()
def sample_to_folder(model, prompts: list[list[int]], folder: str | os.PathLike, pad_token_id: int,
                     temperature: float, max_new_tokens: int, batch_size: int = 64, seed: int = 0,
                     progress: bool = True) -> list[Pair]:
    """Sample one completion per prompt into ``folder`` (``shard_00000.json``, ...), skipping shards already there;
    returns every ``(prompt, completion)`` pair in prompt order. The engine runs with no draft nodes, so finished
    rows leave the batch and each step costs only the rows still generating."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, num_heads=1, draft_ids=[0]),
                                  sampling_config(model, temperature, max_new_tokens), capacity=1, max_nodes=0,
                                  topk_per_head=1)
    shards = range(0, len(prompts), batch_size)
    bar = tqdm(shards, desc="sampling the policy", disable=not progress, unit="shard")
    for index, start in enumerate(bar):
        chunk = prompts[start : start + batch_size]
        path = folder / f"shard_{index:05d}.json"
        if path.is_file() and json.loads(path.read_text())["prompts"] == chunk:
            continue
        torch.manual_seed(seed + index)
        ids, mask = left_pad(chunk, pad_token_id)
        out = engine.generate(ids, mask)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"prompts": chunk, "completions": out.completion_ids, "seed": seed + index,
                                   "temperature": temperature, "seconds": out.stats.seconds}))
        tmp.replace(path)
        bar.set_postfix(tok_s=f"{sum(map(len, out.completion_ids)) / out.stats.seconds:.0f}")
    return read_folder(folder, len(shards))


def read_folder(folder: str | os.PathLike, num_shards: int | None = None) -> list[Pair]:
    """The pairs of every shard in ``folder`` (the first ``num_shards``, which must all be there)."""
    paths = sorted(Path(folder).glob("shard_*.json"))
    if num_shards is not None:
        missing = [i for i in range(num_shards) if not (Path(folder) / f"shard_{i:05d}.json").is_file()]
        if missing:
            raise FileNotFoundError(f"{folder} lacks shards {missing[:5]} of {num_shards}")
        paths = paths[:num_shards]
    pairs: list[Pair] = []
    for path in paths:
        shard = json.loads(path.read_text())
        pairs.extend(zip(shard["prompts"], shard["completions"]))
    return pairs


def pack_samples(groups: dict[str, list[Pair]], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write named groups of ``(prompt, completion)`` pairs (e.g. ``train``, ``heldout``) to one safetensors file
    of ids and lengths: ids as uint16 when every one fits (vocabularies under 65,536 tokens; half the shipped
    bytes), else int32."""
    tensors = {}
    for name, pairs in groups.items():
        for part, seqs in (("prompt", [p for p, _ in pairs]), ("completion", [c for _, c in pairs])):
            ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
            fits_uint16 = len(ids) == 0 or (int(ids.min()) >= 0 and int(ids.max()) < 2**16)
            tensors[f"{name}.{part}_ids"] = ids.to(torch.uint16) if fits_uint16 else ids
            tensors[f"{name}.{part}_lengths"] = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    save_file(tensors, str(path), metadata={"groups": json.dumps(list(groups)), **(metadata or {})})


def samples_key(path: str | os.PathLike) -> str | None:
    """The ``policy_sha256`` a sample file was written with (``None`` when it has none)."""
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("policy_sha256")


def read_samples(path: str | os.PathLike) -> dict[str, list[Pair]]:
    """The groups ``pack_samples`` wrote."""
    tensors = load_file(str(path))
    names = sorted({key.split(".")[0] for key in tensors})
    groups = {}
    for name in names:
        parts = []
        for part in ("prompt", "completion"):
            ids, lengths = tensors[f"{name}.{part}_ids"].tolist(), tensors[f"{name}.{part}_lengths"].tolist()
            offsets = [0]
            for n in lengths:
                offsets.append(offsets[-1] + n)
            parts.append([ids[a:b] for a, b in zip(offsets, offsets[1:])])
        groups[name] = list(zip(*parts))
    return groups
