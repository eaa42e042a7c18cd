"""Packed linear kernels (``engine.kernels``): same numbers as ``F.linear`` to float rounding, repacked when the
weights move, chosen per bucket of query rows by what the engine's own forwards measure, and the exactness proofs
(greedy identity, chi-square) hold with every forward forced through them."""

import time

import pytest
import torch
from torch import nn
from transformers import GenerationConfig

from specroll_trl.engine import SpeculativeGenerator, SpeculativeHeads
from specroll_trl.engine import kernels as kernels_mod
from specroll_trl.engine.kernels import TRIALS, LinearKernels, kernels_of, packed_kernel_available, rows_bucket

from .conftest import left_padded, make_model
from .test_engine import (
    PROMPTS,
    chi_square_pvalue,
    engine_samples,
    exact_completion_distribution,
    generate_reference,
    noisy_heads,
)

pytestmark = pytest.mark.skipif(not packed_kernel_available(), reason="this torch build has no oneDNN")


def force_packed(monkeypatch, model) -> LinearKernels:
    """Every forward of ``model`` through the packed kernel, whatever its row count (the proofs' worst case)."""
    monkeypatch.setattr(kernels_mod, "MAX_PACKED_ROWS", 1 << 20)
    kernels = kernels_of(model)
    kernels.choice.update({rows_bucket(r): True for r in range(1, 1 << 16)})
    return kernels


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_packed_forward_matches_f_linear_and_restores_the_modules():
    model = make_model(vocab=64, hidden=64)
    ids = torch.randint(0, 64, (2, 7))
    reference = logits(model, ids)
    kernels = LinearKernels(model)
    assert len(kernels.modules) == len([m for m in model.modules() if isinstance(m, nn.Linear)])
    kernels.choice[rows_bucket(14)] = True
    with kernels.active(), kernels.forward(14):
        assert kernels.use_packed
        packed = logits(model, ids)
    torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in kernels.modules)
    with pytest.raises(RuntimeError, match="boom"), kernels.active(), kernels.forward(14):
        raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in kernels.modules) and not kernels.use_packed


def test_weights_changed_in_place_are_repacked():
    model = make_model(vocab=48, hidden=32)
    ids = torch.randint(0, 48, (1, 5))
    kernels = LinearKernels(model)
    kernels.choice[rows_bucket(5)] = True
    with kernels.active():
        pass
    with torch.no_grad():  # an optimizer step: in place
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference = logits(model, ids)
    with kernels.active(), kernels.forward(5):
        packed = logits(model, ids)
    torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-4)
    assert kernels.pack_seconds > 0


@pytest.mark.parametrize("slow_kernel,chosen", [(True, False), (False, True)])
def test_the_faster_kernel_is_chosen_per_bucket_by_the_forwards_it_runs(slow_kernel, chosen):
    """Forwards of a bucket alternate the two kernels ``TRIALS`` times each; the faster is kept from then on."""
    kernels = LinearKernels(make_model())
    seen = []
    with kernels.active():
        for _ in range(2 * TRIALS):
            with kernels.forward(3):
                seen.append(kernels.use_packed)
                if kernels.use_packed == slow_kernel:
                    time.sleep(0.02)
        assert seen == [False, True] * TRIALS
        assert kernels.choice == {3: chosen}
        with kernels.forward(3):
            assert kernels.use_packed == chosen
        with kernels.forward(2):  # another bucket: measured anew
            assert not kernels.use_packed
        with kernels.forward(10**6):  # past MAX_PACKED_ROWS: F.linear, nothing measured
            assert not kernels.use_packed
    assert set(kernels.trials) == {2, 3}


def test_only_plain_float32_cpu_linears_take_part():
    model = make_model()
    hooked = model.model.layers[0].mlp.down_proj
    hooked.forward = lambda x, original=hooked.forward: original(x)  # e.g. an accelerate hook
    kernels = LinearKernels(model)
    assert hooked not in kernels.modules and len(kernels.modules) > 0
    assert LinearKernels(make_model().to(torch.bfloat16)).modules == []
    assert kernels_of(model) is kernels_of(model)  # one packed copy per model, however many engines


def test_greedy_identity_with_every_forward_packed(monkeypatch):
    model = make_model(vocab=40, scale=4.0, seed=3)
    force_packed(monkeypatch, model)
    heads = noisy_heads(model, std=0.3, kind="path")
    ids, mask = left_padded([[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, heads, gc, capacity=64, max_nodes=6).generate(ids, mask)
    assert out.completion_ids == generate_reference(model, ids, mask, gc)
    assert kernels_of(model).trials == {}  # nothing measured: every forward ran packed


@pytest.mark.parametrize("rule", ["top-k", "drawn"])
def test_sampling_is_exact_with_every_forward_packed(monkeypatch, rule):
    model = make_model(vocab=6, hidden=16, seed=11, scale=2.0)
    force_packed(monkeypatch, model)
    heads = noisy_heads(model, std=0.5, kind="path", num_heads=2)
    gc = GenerationConfig(do_sample=True, temperature=0.9, top_k=4, max_new_tokens=3, eos_token_id=1, pad_token_id=0)
    samples, stats = engine_samples(model, heads, gc, n_per_prompt=4000, seed=2, candidates=rule)
    assert stats.drafted_row_steps > 0
    for prompt, rows in zip(PROMPTS, samples):
        assert chi_square_pvalue(rows, exact_completion_distribution(model, prompt, gc)) > 1e-3


def test_engine_without_packing_leaves_the_model_alone():
    model = make_model()
    engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2),
                                  GenerationConfig(max_new_tokens=4, eos_token_id=1, pad_token_id=0),
                                  capacity=8, pack_linears=False)
    engine.generate(torch.tensor([[3, 4, 5]]))
    assert engine.kernels.modules == [] and engine.kernels.packed == {}
