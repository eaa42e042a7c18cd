"""A pretrained preset's heads from its own samples: the prompt plan, the sampled data, and the shipped heads.

The recipe (``adapt.distill.distill_from_samples``) needs many of the policy's own sequences; sampling them takes
about an hour on 2 CPU cores, so the default preset's heads ship with the package: one folder per head kind
(``data/heads/<preset>/<kind>/``: ``config.json`` + ``model.safetensors`` in fp16, ``distill_report.json``) and
the sampled token ids they were distilled from (``data/heads/<preset>/samples.safetensors``). All are keyed to the
policy's weights (``policy_sha256``, the SHA-256 of ``distill_cache.policy_fingerprint``): shipped heads load
only for the exact policy they were fitted to, shipped samples are reused only for it, and any other policy is
sampled and distilled from scratch. Path heads are the default; the independent ones serve the vLLM export (vLLM's
Medusa speculator takes that kind only) and runs that ask for them (``spec_heads_kind="independent"``).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from ..adapt.distill import (
    REPORT_FILE,
    HeadDistillConfig,
    TokenStream,
    build_stream,
    distill_from_samples,
    measure_heads,
    save_distilled,
)
from ..adapt.distill_cache import find_shipped_heads, policy_fingerprint
from ..adapt.samples import pack_samples, read_samples, sample_to_folder, samples_key
from ..files import atomic_folder
from .tasks import arithmetic_examples, chat_prompt, gsm8k_examples

SHIPPED_DIR = Path(__file__).parent / "data" / "heads"
SAMPLES_FILE = "samples.safetensors"
TRAIN_PROMPTS = 1152  # GSM8K-train and arithmetic chat prompts, 3 : 1 (about 220k anchors, 256 tokens); the shipped
# SmolLM2 set was fitted to the plan's first 2,944 (568k anchors, scripts/heads_temperature.py sample-more)
HELDOUT_PROMPTS = 48  # whole sequences from GSM8K-test chat prompts, never trained on (about 9k anchors)
SAMPLE_SEEDS = {"heldout": 100_000, "train": 0}


def onpolicy_distill_config() -> HeadDistillConfig:
    """The recipe of the shipped heads: path-conditioned heads over an 8,192-token draft vocabulary, fitted to the
    policy's own samples at T=1.0 (GRPO's default) and the top-16 of its T=1.0 distribution plus the realised token,
    by KL + CE + TV(p, q) (the last what a child drawn from the heads is rejected at), a fixed number of steps with
    the learning rate decayed linearly to zero and early stopping on the held-out loss.
    The engine drafts with them at any temperature (their logits rescaled to it); measured against the same recipe
    at T=0.7 in ``benchmarks/README.md``, they match it at T=0.7 and beat it at T=1.0."""
    return HeadDistillConfig(kind="path", temperature=1.0, max_new_tokens=256, sample_batch_size=64, steps=1500,
                             batch_size=512, lr=1e-3, lr_scheduler_type="linear", target_topk=16,
                             draft_vocab_size=8192, eval_every=100, patience=3, tv_weight=1.0)


def prompt_plan(tokenizer, train: int = TRAIN_PROMPTS, heldout: int = HELDOUT_PROMPTS) -> dict[str, list[list[int]]]:
    """Chat prompts of the head data: ``heldout`` (the first GSM8K-test questions) and ``train`` (GSM8K-train
    questions in a seeded shuffle, every fourth one replaced by an arithmetic-task problem). The benches' prompts
    (GSM8K test from row 1000 on, arithmetic from other seeds) are disjoint from both."""

    def render(questions):
        texts = [tokenizer.apply_chat_template(chat_prompt(q), tokenize=False, add_generation_prompt=True)
                 for q in questions]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    gsm = [e["question"] for e in gsm8k_examples("train")]
    random.Random(31).shuffle(gsm)
    arith = [e["question"] for e in arithmetic_examples(train // 4 + 1, seed=30_000)]
    mixed = [arith[i // 4] if i % 4 == 3 else gsm[i - i // 4] for i in range(train)]
    return {"heldout": render([e["question"] for e in gsm8k_examples("test", limit=heldout)]),
            "train": render(mixed)}


def sample_plan(model, tokenizer, folder: str | Path, config: HeadDistillConfig, progress: bool = True) -> dict:
    """The plan's prompts sampled from the policy into ``folder`` (resumable): ``{"heldout": pairs, "train":
    pairs}``."""
    plan = prompt_plan(tokenizer)
    return {name: sample_to_folder(model, plan[name], Path(folder) / name, tokenizer.pad_token_id, config.temperature,
                                   config.max_new_tokens, config.sample_batch_size, SAMPLE_SEEDS[name], progress)
            for name in ("heldout", "train")}


STREAM_FIELDS = ("hidden", "ids", "anchor_ok", "seq_end", "top_ids", "top_probs")


def cached_stream(model, pairs, temperature: float, topk: int, path: str | Path) -> TokenStream:
    """``build_stream`` of ``pairs`` at ``temperature``, kept in ``path`` (safetensors) so studies that refit heads
    many times pay the teacher-forced forward once."""
    path = Path(path)
    if path.is_file():
        return read_stream(path)
    stream = build_stream(model, pairs, temperature, topk, progress=True, desc=path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f: getattr(stream, f).contiguous() for f in STREAM_FIELDS}, str(path))
    return stream


def read_stream(path: str | Path) -> TokenStream:
    """A stream :func:`cached_stream` kept in ``path``."""
    tensors = load_file(str(path))
    return TokenStream(**{f: tensors[f] for f in STREAM_FIELDS})


def shipped_folder(preset: str, kind: str = "path") -> Path:
    """Where the heads of ``kind`` shipped for ``preset`` are written (``data/heads/<preset>/<kind>/``)."""
    return SHIPPED_DIR / preset / kind


def shipped_samples(preset: str, key: str) -> dict | None:
    """The shipped samples of ``preset`` when they were drawn from the policy with fingerprint ``key``."""
    path = SHIPPED_DIR / preset / SAMPLES_FILE
    return read_samples(path) if path.is_file() and samples_key(path) == key else None


def ship_samples(samples: dict, preset: str, key: str) -> Path:
    """Write the samples heads of ``preset`` were fitted to beside them, keyed by the policy's fingerprint."""
    path = SHIPPED_DIR / preset / SAMPLES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    pack_samples(samples, path, {"policy_sha256": key})
    return path


def install_heads(preset: str, model, tokenizer, out: Path, cache: Path, kind: str = "path",
                  progress: bool = True) -> Path:
    """Heads of ``kind`` for a pretrained preset in ``out``: the shipped ones when they were fitted to this very
    policy, else distilled by the recipe from the shipped samples (same policy) or from new samples drawn into
    ``cache``."""
    key = policy_fingerprint(model)
    shipped = find_shipped_heads(model, kind, SHIPPED_DIR, key=key)
    if shipped is not None:
        with atomic_folder(out) as tmp:
            tmp.mkdir(parents=True)
            for name in ("config.json", "model.safetensors", REPORT_FILE):
                shutil.copy(shipped / name, tmp / name)
        return out
    config = dataclasses.replace(onpolicy_distill_config(), kind=kind)
    return distill_preset_heads(model, tokenizer, out, cache, key=key, samples=shipped_samples(preset, key),
                                config=config, progress=progress)


def distill_preset_heads(model, tokenizer, out: Path, cache: Path, key: str | None = None, samples: dict | None = None,
                         config: HeadDistillConfig | None = None, progress: bool = True) -> Path:
    """Run the recipe into ``out`` (heads in fp16 and their report with ``policy_sha256``). ``samples``:
    ``{"heldout", "train"}`` pairs to use (default: sampled into ``cache``, resumably)."""
    config = config or onpolicy_distill_config()
    samples = samples or sample_plan(model, tokenizer, cache, config, progress)
    heads, report = distill_from_samples(model, samples["train"], samples["heldout"], config, progress=progress,
                                         fp16_weights=True)
    return save_preset_heads(heads, report, samples, model, out, key, config)


SLICE_SEQUENCES = 8  # held-out sequences whose hit rates the report keeps, for a quick check of shipped heads


def heldout_slice(heads, model, samples: dict, config: HeadDistillConfig) -> dict:
    """Hit rates of ``heads`` on the first ``SLICE_SEQUENCES`` held-out sequences (a check that costs seconds)."""
    pairs = samples["heldout"][:SLICE_SEQUENCES]
    stream = build_stream(model, pairs, config.temperature, config.target_topk)
    return {"sequences": len(pairs), **measure_heads(heads, model, stream, config.hit_ks, config.temperature)}


def save_preset_heads(heads, report: dict, samples: dict, model, out: Path, key: str | None = None,
                      config: HeadDistillConfig | None = None) -> Path:
    """Write heads (fp16) and their report, keyed by the policy's fingerprint (``key`` when already computed), with
    their hit rates on a held-out slice (measured at the temperature and target size of ``config``, the recipe
    they were fitted with; default: the shipped recipe) and the size of the samples they were fitted to."""
    heads.half().float()  # measured as saved
    report = {**report, "policy_sha256": key or policy_fingerprint(model),
              "heldout_slice": heldout_slice(heads, model, samples, config or onpolicy_distill_config()),
              "samples": {k: len(v) for k, v in samples.items()},
              "sampled_tokens": {k: sum(len(c) for _, c in v) for k, v in samples.items()}}
    with atomic_folder(out) as tmp:
        save_distilled(heads.half(), report, tmp)
    return out
