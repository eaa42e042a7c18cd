"""Shared fixtures: random-init small Qwen2 models (instant) and the `nano` zoo policy with heads (built once)."""

import contextlib
import os

if "OMP_NUM_THREADS" not in os.environ:
    # The test models are tiny: a second intra-op thread buys nothing, and on a 2-core machine shared with other
    # work each op's thread barrier stalls (the fast lane took 10 min instead of 75 s). Inherited by subprocesses.
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case torch was imported before this file


@contextlib.contextmanager
def native_kernel_unbuilt(monkeypatch, tmp_path, module, setting: dict):
    """``module``'s C++ kernel (``engine.streamed``, ``engine.walk_kernel``) as on a machine that lacks it: an empty
    cache and ``setting`` (a compiler that does not exist, or the kernel's switch off)."""
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))  # no library built before
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    module._library.cache_clear()
    try:
        yield
    finally:
        module._library.cache_clear()


def make_model(vocab: int = 32, hidden: int = 32, layers: int = 2, seed: int = 0, eos: int = 1, pad: int = 0,
               attn: str = "sdpa", scale: float = 1.0) -> Qwen2ForCausalLM:
    """A random-init Qwen2 (fp32, eval); ``scale`` sharpens its next-token distributions."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos,
        pad_token_id=pad, tie_word_embeddings=False, attn_implementation=attn,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    return model


def left_padded(prompts: list[list[int]], pad: int = 0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def cut_after_eos(rows: list[list[int]], eos: set[int]) -> list[list[int]]:
    return [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in rows]


@pytest.fixture(scope="session")
def specroll_home():
    """The zoo cache the library uses: $SPECROLL_HOME, default ``~/.cache/specroll_trl``, so that the toy policies
    and heads a first run builds (``nano``: about 2 minutes) are reused by the next (CI points it at an empty
    folder and builds everything)."""
    from specroll_trl.files import specroll_home as library_home

    path = str(library_home())
    os.environ["SPECROLL_HOME"] = path
    return path


@pytest.fixture(scope="session")
def nano(specroll_home):
    """``(model, tokenizer, heads)`` of the nano zoo policy with distilled heads."""
    from specroll_trl.experiments import zoo

    model, tokenizer = zoo.load_policy("nano", progress=False)
    heads = zoo.load_heads("nano", progress=False)
    return model, tokenizer, heads
