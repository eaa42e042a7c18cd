"""The rejection walk's C++ kernel (``engine.walk_kernel``): the reference's decisions on the same uniforms, the
engine's samples the same through either, and the reference wherever the kernel cannot run."""

import pytest
import torch
from transformers import GenerationConfig

from specroll_trl.engine import drawn as drawn_mod
from specroll_trl.engine import walk_kernel
from specroll_trl.engine.drawn import TreeShape, draw_tree
from specroll_trl.engine.generator import SpeculativeGenerator

from .conftest import make_model, native_kernel_unbuilt
from .test_engine import engine_samples, noisy_heads

needs_kernel = pytest.mark.skipif(not walk_kernel.walk_kernel_available(),
                                  reason="no C++ compiler built the walk kernel")


def random_draft(gen, trial, vocab_size=12, target_near_q=0.9):
    """A drawn tree of a shape, width, fixed count, batch and vocabulary that vary with ``trial``, the target near
    the heads' ``q`` (so that rows walk deep), and uniforms for its walk."""
    heads, width = 1 + trial % 4, 1 + trial % 3
    fixed, batch = trial % (width + 1), 1 + trial % 5
    vocab = None if trial % 2 else torch.randperm(vocab_size, generator=gen)[: vocab_size // 2].sort().values
    drafted = vocab_size if vocab is None else len(vocab)
    shape = TreeShape.best_first(torch.rand(heads, width, generator=gen), 1 + trial % 13)

    def propose(d, frontier, path, path_tokens):
        logits = 2 * torch.randn(batch, frontier.numel(), drafted, generator=gen)
        if trial % 7 == 0:  # heads with no mass on some tokens: children of q-mass 0
            logits[..., : drafted // 2] = -torch.inf
        return torch.zeros(batch, frontier.numel(), 2), logits.log_softmax(-1)

    draft = draw_tree(torch.zeros(batch, dtype=torch.long), shape, propose, vocab, fixed)
    q = torch.zeros(batch, shape.size, vocab_size)
    q[..., torch.arange(vocab_size) if vocab is None else vocab] = draft.q[:, draft.slot]
    noise = torch.randn(batch, shape.size, vocab_size, generator=gen).softmax(-1)
    probs = target_near_q * q + (1 - target_near_q) * noise
    if trial % 5 == 0:  # a truncated target (top-k): zeros where q has mass
        probs = probs * (torch.rand(probs.shape, generator=gen) < 0.6)
        probs[..., 0] += 1e-3
        probs = probs / probs.sum(-1, keepdim=True)
    uniforms = torch.rand(batch, shape.max_depth + 2, shape.children.shape[1], dtype=torch.float64, generator=gen)
    return draft, probs, fixed, uniforms


@needs_kernel
def test_the_kernel_decides_as_the_reference_walk():
    """On the same uniforms, the kernel accepts the same nodes, samples the same next root (inside the draft
    vocabulary and outside it), tries the same children; chances and reaches agree to float rounding."""
    gen = torch.Generator().manual_seed(0)
    depths, outside = set(), 0
    for trial in range(300):
        draft, probs, fixed, uniforms = random_draft(gen, trial)
        torch.manual_seed(trial)  # the draw outside the draft vocabulary: the same uniform in both
        reference = drawn_mod.rejection_walk(draft, probs, fixed, uniforms)
        torch.manual_seed(trial)
        kernel = walk_kernel.walk(draft, probs, fixed, uniforms)
        assert torch.equal(kernel.accepted, reference.accepted), trial
        assert torch.equal(kernel.next_root, reference.next_root), trial
        assert torch.equal(kernel.tried, reference.tried), trial
        assert torch.allclose(kernel.alpha_sum, reference.alpha_sum, rtol=1e-5, atol=1e-6), trial
        assert torch.allclose(kernel.reach, reference.reach, rtol=1e-4, atol=1e-7), trial
        depths.update((reference.accepted >= 0).sum(1).tolist())
        if draft.vocab is not None:
            outside += int((~torch.isin(reference.next_root, draft.vocab)).sum())
    assert min(depths) == 1 and max(depths) >= 4  # rows stopping at the root and rows reaching deep
    assert outside > 20  # next roots drawn outside the draft vocabulary were compared too


@needs_kernel
def test_the_kernel_refuses_uniforms_too_narrow():
    draft, probs, fixed, uniforms = random_draft(torch.Generator().manual_seed(1), 2)
    assert draft.shape.children.shape[1] == 3
    with pytest.raises(ValueError, match="inconsistent sizes"):
        walk_kernel.walk(draft, probs, fixed, uniforms[..., :1])


@needs_kernel
def test_the_engine_walks_through_the_kernel_on_cpu(monkeypatch):
    def reference_called(*args):
        raise AssertionError("the reference walk ran where the kernel can")

    monkeypatch.setattr(walk_kernel, "rejection_walk", reference_called)
    model = make_model(vocab=40, scale=4.0, seed=3)
    gc = GenerationConfig(do_sample=True, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([[5, 6, 7, 8]] * 3)
    out = SpeculativeGenerator(model, noisy_heads(model, std=0.3, kind="path"), gc, capacity=10**9, max_nodes=4,
                               candidates="drawn").generate(ids, torch.ones_like(ids))
    assert out.stats.drawn_row_steps > 0 and all(len(c) == 12 for c in out.completion_ids)


@pytest.mark.parametrize("setting", [{"CXX": "/nonexistent/c++"}, {"SPECROLL_WALK_KERNEL": "0"}])
def test_without_the_kernel_the_reference_walks(monkeypatch, tmp_path, setting):
    with native_kernel_unbuilt(monkeypatch, tmp_path, walk_kernel, setting):
        assert not walk_kernel.walk_kernel_available()
        draft, probs, fixed, uniforms = random_draft(torch.Generator().manual_seed(2), 3)
        torch.manual_seed(0)
        fallback = walk_kernel.walk(draft, probs, fixed, uniforms)
        torch.manual_seed(0)
        reference = drawn_mod.rejection_walk(draft, probs, fixed, uniforms)
        assert torch.equal(fallback.accepted, reference.accepted)
        assert torch.equal(fallback.next_root, reference.next_root)
        assert not list(tmp_path.glob("kernels/*.so"))


@needs_kernel
@pytest.mark.parametrize("kind", ["path", "independent"])
def test_the_engine_samples_the_same_completions_through_either_walk(monkeypatch, kind):
    """Same seed, same completions, row for row, whether the engine walks through the kernel or the reference: the
    chi-square proofs of either (``tests/test_engine.py`` runs this machine's: the kernel) hold for both."""
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    heads = noisy_heads(model, std=0.4, seed=1, kind=kind)
    gc = GenerationConfig(do_sample=True, max_new_tokens=3, eos_token_id=1, pad_token_id=0, temperature=0.7, top_k=4,
                          repetition_penalty=1.3)
    through = {}
    for path in ("kernel", "reference"):
        if path == "reference":
            monkeypatch.setattr(walk_kernel, "walk_kernel_available", lambda: False)
        through[path], stats = engine_samples(model, heads, gc, n_per_prompt=4000, seed=9, candidates="drawn",
                                              fixed_children=1)
        assert stats["accepted"] > 0.2 * stats["row_forwards"]
    assert through["kernel"] == through["reference"]
