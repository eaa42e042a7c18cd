"""Reflex: bounded corrections, a gate that stays shut on noise and opens on persistent error, no state
leaking between rows or calls, presets as hook lists, and the engine's exactness with Reflex on."""

import pytest
import torch
from transformers import GenerationConfig

from specroll_trl.adapt.reflex import (
    REFLEX_PRESETS,
    GroupTokenLookup,
    HiddenStateConfig,
    HiddenStateReflex,
    LookupConfig,
    TokenLookup,
    reflex_hooks,
)
from specroll_trl.engine.generator import SpeculativeGenerator
from specroll_trl.engine.hooks import DraftSlots, GenerationContext, StepFeedback
from specroll_trl.engine.tree import DraftTree

from .conftest import left_padded, make_model
from .test_engine import PROMPTS, chi_square_pvalue, engine_samples, exact_completion_distribution, noisy_heads

V, D, H = 128, 64, 2
ALL = DraftSlots.all_heads(H)  # independent heads' slots: slot j is head j


def context(batch=3, lm_head=None, input_ids=None, attention_mask=None):
    input_ids = torch.ones((batch, 1), dtype=torch.long) if input_ids is None else input_ids
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    return GenerationContext(input_ids, mask, H, lm_head)


def started(hook=None, batch=3, input_ids=None, attention_mask=None):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(D, V, bias=False)
    reflex = hook or HiddenStateReflex()
    reflex.start(context(batch, lm_head, input_ids, attention_mask))
    return reflex, lm_head


def one_step(rows, z, p, candidates):
    """A step in which every row committed exactly its root's successor (count 1, no draft accepted)."""
    b = len(rows)
    tree = DraftTree(torch.zeros((b, 1), dtype=torch.long), torch.zeros((b, 1), dtype=torch.long),
                     torch.full((b, 1), -1), torch.ones((b, 1, 1), dtype=torch.bool), torch.zeros((b, 1, H + 1)))
    return tree, p[:, None, :]


def feed(reflex, rows, index, z, p, candidates):
    tree, probs = one_step(rows, z, p, candidates)
    reflex.feedback(StepFeedback(rows=rows, root_index=torch.full((len(rows),), index), z=z, candidates=candidates,
                                 tree=tree, probs=probs, accepted=torch.zeros((len(rows), 1), dtype=torch.long),
                                 emitted=torch.zeros((len(rows), 1), dtype=torch.long),
                                 count=torch.ones(len(rows), dtype=torch.long),
                                 finished=torch.zeros(len(rows), dtype=torch.bool)))


def test_corrections_never_exceed_the_bound():
    reflex, _ = started(HiddenStateReflex(eta=50.0, kappa=0.3, rho_min=0.0))
    reflex.memory.normal_(0, 10)
    reflex.rho.fill_(1.0)
    z = torch.randn(3, H, D)
    out = reflex.adjust(torch.arange(3), z, ALL)
    ratio = (out - z).norm(dim=-1) / z.norm(dim=-1)
    assert (ratio <= 0.3 + 1e-5).all() and (ratio > 0.29).all()


def test_noise_feedback_keeps_the_gate_shut_and_proposals_unchanged():
    reflex, _ = started()
    rows = torch.arange(3)
    gen = torch.Generator().manual_seed(1)
    for i in range(60):
        z = torch.randn(3, H, D, generator=gen)
        p = torch.softmax(3 * torch.randn(3, V, generator=gen), -1)
        feed(reflex, rows, i, z, p, torch.randint(0, V, (3, H, 2), generator=gen))
        z_next = torch.randn(3, H, D, generator=gen)
        assert torch.equal(reflex.adjust(rows, z_next, ALL), z_next)
    assert reflex.metrics()["reflex_gate"] == 0.0


def test_persistent_mismatch_opens_the_gate_and_improves_the_head():
    reflex, lm_head = started(HiddenStateReflex(eta=4.0, kappa=1.0))
    rows = torch.arange(1)
    target = 7
    p = torch.zeros(1, V)
    p[0, target] = 1.0
    z = torch.randn(1, H, D)
    with torch.no_grad():
        before = torch.softmax(lm_head(z), -1)[0, :, target]
    for i in range(12):
        z_used = reflex.adjust(rows, z, ALL)
        cand = lm_head(z_used).topk(2, -1).indices
        feed(reflex, rows, i, z_used, p, cand)
    gate = reflex.gate(rows)
    assert (gate > 0.5).all()
    with torch.no_grad():
        after = torch.softmax(lm_head(reflex.adjust(rows, z, ALL)), -1)[0, :, target]
    assert (after > before).all()


def test_state_is_per_row_and_reset_per_call():
    reflex, lm_head = started(batch=2)
    p = torch.zeros(1, V)
    p[0, 3] = 1.0
    for i in range(8):
        feed(reflex, torch.tensor([0]), i, torch.randn(1, H, D), p, torch.zeros((1, H, 2), dtype=torch.long))
    assert reflex.memory[0].abs().sum() > 0 and reflex.memory[1].abs().sum() == 0
    z = torch.randn(1, H, D)
    assert torch.equal(reflex.adjust(torch.tensor([1]), z, ALL), z)
    reflex.start(context(2, lm_head))
    assert reflex.memory.abs().sum() == 0 and reflex.rho.abs().sum() == 0


def test_invalid_reflex_config():
    with pytest.raises(ValueError, match="lam"):
        HiddenStateConfig(lam=1.0)
    with pytest.raises(ValueError, match="support_k"):
        HiddenStateReflex(support_k=0)


HARD = dict(temperature=0.7, top_k=0, min_p=0.15, repetition_penalty=1.5)
FORCED = ("baseline", dict(eta=5.0, rho_min=-1.0 + 1e-3))
GROUP_LOOKUP = ("lookup-group", dict(prior=0.6, group_size=2))  # prompts repeat 12000x


LOOKUP = ("lookup", dict(prior=0.6))
BOTH = ("baseline+lookup", dict(eta=5.0, rho_min=-1.0 + 1e-3, prior=0.6))


def slow(*case):
    return pytest.param(*case, marks=pytest.mark.slow)


# the fast lane: the baseline, the group lookup and both presets together; each head kind
@pytest.mark.parametrize("settings,preset,kind", [
    (dict(temperature=1.0, top_k=0), FORCED, "independent"), slow(HARD, FORCED, "independent"),
    (HARD, GROUP_LOOKUP, "independent"), slow(HARD, LOOKUP, "independent"),
    slow(dict(temperature=1.0, top_k=0), FORCED, "path"), slow(HARD, FORCED, "path"), slow(HARD, GROUP_LOOKUP, "path"),
    slow(HARD, LOOKUP, "path"), slow(HARD, BOTH, "independent"), (HARD, BOTH, "path")])
def test_engine_stays_exact_with_reflex_on(settings, preset, kind, monkeypatch):
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    heads = noisy_heads(model, std=0.4, seed=1, kind=kind)
    gc = GenerationConfig(do_sample=True, max_new_tokens=3, eos_token_id=1, pad_token_id=0, **settings)
    original = SpeculativeGenerator.__init__

    def with_reflex(self, *args, **kwargs):
        original(self, *args, hooks=reflex_hooks(preset[0], **preset[1]), **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "__init__", with_reflex)
    samples, stats = engine_samples(model, heads, gc, n_per_prompt=12000, seed=7)
    assert stats["drawn_row_steps"] > 0  # the default rule drew candidates from the Reflex-adjusted q
    assert stats["reflex_feedback"] > 0  # corrections really happened:
    assert stats["reflex_norm"] > 0 if preset[0].startswith("baseline") else stats["reflex_lookup_hit"] > 0
    for prompt, rows in zip(PROMPTS, samples):
        assert chi_square_pvalue(rows, exact_completion_distribution(model, prompt, gc)) > 1e-3


@pytest.mark.parametrize("kind", ["independent", "path"])
@pytest.mark.parametrize("preset", [("baseline", dict(rho_min=-0.99)), ("lookup", {}), ("lookup-group", {}),
                                    ("baseline+lookup", dict(rho_min=-0.99))])
def test_engine_with_reflex_greedy_equals_generate(preset, kind):
    model = make_model(vocab=40, scale=4.0, seed=3)
    heads = noisy_heads(model, std=0.3, kind=kind)
    ids, mask = left_padded([[5, 6, 7, 8], [3, 4], [9]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=25, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, heads, gc, capacity=64, hooks=reflex_hooks(preset[0], **preset[1])).generate(
        ids, mask)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
    ref = [r[: next((i + 1 for i, t in enumerate(r) if t == 1), len(r))] for r in ref]
    assert out.completion_ids == ref


def test_presets_and_variant_fields_are_validated():
    (default,) = reflex_hooks()
    assert type(default) is TokenLookup and default.config == LookupConfig() and default.config.cyclic
    baseline = reflex_hooks("baseline")
    assert [type(h) for h in baseline] == [HiddenStateReflex] and baseline[0].config.eta == 1.0  # no lookup
    assert reflex_hooks("lookup", prior=0.5)[0].config.prior == 0.5
    assert reflex_hooks("lookup")[0] is not reflex_hooks("lookup")[0] is not REFLEX_PRESETS["lookup"][0]  # fresh
    memory, lookup = reflex_hooks("baseline+lookup", eta=2.0, prior=0.1)  # each field goes to the hook that has it
    assert (memory.config.eta, lookup.config.prior, lookup.config.decay) == (2.0, 0.1, 0.8)
    assert type(reflex_hooks("lookup-group", group_size=2)[0]) is GroupTokenLookup
    with pytest.raises(ValueError, match="preset"):
        reflex_hooks("nope")
    with pytest.raises(ValueError, match="'lookup'.*eta.*prior"):  # names the preset, the field, what it takes
        reflex_hooks("lookup", eta=1.0)
    with pytest.raises(ValueError, match="ngram"):
        reflex_hooks("lookup", ngram=0)
    with pytest.raises(TypeError, match="LookupConfig"):
        HiddenStateReflex(LookupConfig())


def feed_steps(reflex, rows, counts, z_of=None, candidates=2, offer_of=None):
    """Steps whose root sits at completion index ``i`` and which commit ``counts[s]`` tokens; the target puts all
    its mass on token ``index % V`` at every index (and samples it), so resolved pairs can be checked. ``offer_of``:
    the tokens a lookup offered at the step (what its ``adjust_logprobs`` leaves in ``_offered``)."""
    index = 0
    for count in counts:
        b, width = len(rows), max(counts) + 1
        n = width  # one accepted chain root -> ... -> node count-1
        accepted = torch.full((b, width), -1, dtype=torch.long)
        accepted[:, :count] = torch.arange(count)
        probs = torch.zeros(b, n, V)
        for j in range(n):
            probs[:, j, (index + 1 + j) % V] = 1.0
        emitted = torch.tensor([[(index + 1 + j) % V for j in range(width)]] * b)
        tree = DraftTree(torch.full((b, n), index % V), torch.zeros((b, n), dtype=torch.long),
                         torch.full((b, n), -1), torch.ones((b, n, n), dtype=torch.bool), torch.zeros((b, n, H + 1)))
        z = z_of(index) if z_of else torch.randn(b, H, D)
        if offer_of:
            reflex._offered = offer_of(index)
        reflex.feedback(StepFeedback(rows=rows, root_index=torch.full((b,), index), z=z,
                                     candidates=torch.zeros((b, H, candidates), dtype=torch.long), tree=tree,
                                     probs=probs, accepted=accepted, emitted=emitted,
                                     count=torch.full((b,), count), finished=torch.zeros(b, dtype=torch.bool)))
        index += count


def test_delayed_feedback_pairs_each_proposal_with_its_committed_index():
    """Head d proposes index root + d; whatever the step sizes, it must be scored against that index's target."""
    reflex, _ = started(HiddenStateReflex(), batch=2)
    seen = []

    def record(rows, heads, z, candidates, p):
        seen.append((heads, z[:, 0].long(), p.argmax(-1)))

    reflex._learn = record
    counts = [1, 3, 1, 2, 2, 1, 3]
    proposed = lambda i: i + torch.arange(1, H + 1)[None].expand(2, H)  # noqa: E731 (root + d, d = 1..H)
    # z encodes the index each head proposed for
    feed_steps(reflex, torch.arange(2), counts, z_of=lambda i: proposed(i).float()[..., None].expand(2, H, D).clone())
    for _, index, target in seen:
        assert torch.equal(index % V, target)
    # roots 0, 1, 4, 5, 7, 9, 10; committed through index 13: every head's proposal (root + d <= 12) resolves
    assert sum(len(h) for h, *_ in seen) == 2 * 7 * H
    # the lookup's feedback pairs the same way with the token sampled there: offering it is always a hit
    lookup, _ = started(TokenLookup(), batch=2)
    feed_steps(lookup, torch.arange(2), counts, offer_of=lambda i: proposed(i) % V)
    assert lookup.metrics() == {"reflex_lookup_hit": 1.0, "reflex_feedback": 2 * 7 * H}
    assert (lookup.rate > lookup.config.prior).all()


def test_lookup_offers_the_continuation_of_the_latest_match():
    prompt = torch.tensor([[0, 0, 10, 11, 12, 13, 14, 15]])
    reflex, lm_head = started(TokenLookup(cyclic=False), batch=1, input_ids=prompt,
                              attention_mask=(torch.arange(8) >= 2).long()[None])
    # the completion so far: root (index 0) is 11 after ... nothing; make the history end in "10, 11"
    reflex.history[0, 8:10] = torch.tensor([10, 11])
    reflex.known[0] = 10
    offer = reflex.offers(torch.tensor([0]))
    assert offer.tolist() == [[12, 13]]  # bigram (10, 11) matched at prompt positions 2-3
    logp = torch.log_softmax(torch.randn(1, H, V), -1)
    out = reflex.adjust_logprobs(torch.tensor([0]), logp, ALL)
    w = reflex.config.prior
    for d, token in enumerate([12, 13]):
        expected = torch.log((1 - w) * logp[0, d, token].exp() + w)
        assert torch.allclose(out[0, d, token], expected)
        assert torch.allclose(out[0, d].exp().sum(), torch.tensor(1.0), atol=1e-5)
    assert (out <= 0).all()


@pytest.mark.parametrize("kind", ["independent", "path"])
def test_lookup_raises_acceptance_on_a_persistent_pattern_the_heads_miss(kind):
    """Greedy decoding of a random model falls into short cycles; poor heads miss them, Reflex's lookup learns
    them from the verified tokens (and the output stays generate's), on both head kinds."""
    model = make_model(vocab=40, scale=4.0, seed=3)
    heads = noisy_heads(model, std=0.3, kind=kind)
    ids, mask = left_padded([[5, 6, 7, 8], [3, 4], [9], [11, 12, 13]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=60, eos_token_id=1, pad_token_id=0)
    static = SpeculativeGenerator(model, heads, gc, capacity=64).generate(ids, mask)
    out = {}
    for name, hooks in (("baseline", reflex_hooks("baseline")), ("acyclic", reflex_hooks("lookup", cyclic=False)),
                        ("lookup", reflex_hooks("lookup"))):
        out[name] = SpeculativeGenerator(model, heads, gc, capacity=64, hooks=hooks).generate(ids, mask)
        assert out[name].completion_ids == static.completion_ids
    assert out["acyclic"].stats["tau"] > 1.5 * static.stats["tau"]
    assert out["lookup"].stats["tau"] > 1.1 * out["acyclic"].stats["tau"]  # short cycles: wrap around
    assert out["acyclic"].stats["reflex_lookup_hit"] > 0.8
    assert out["baseline"].stats["tau"] < 1.2 * static.stats["tau"]  # the hidden-state memory cannot see it


def test_group_lookup_reads_sibling_rows_with_the_same_prompt_only():
    prompts = torch.tensor([[4, 5], [4, 5], [6, 5]])
    reflex, _ = started(GroupTokenLookup(), batch=3, input_ids=prompts)
    reflex.history[:, 2:6] = torch.tensor([[9, -1, -1, -1], [9, 20, 21, 22], [9, 30, 31, 32]])
    reflex.known[:] = torch.tensor([3, 6, 6])
    offer = reflex.offers(torch.tensor([0]))
    assert offer.tolist() == [[20, 21]]  # row 1 shares the prompt and continued "5, 9" with 20, 21; row 2 does not
    solo, _ = started(TokenLookup(), batch=3, input_ids=prompts)
    solo.history.copy_(reflex.history)
    solo.known.copy_(reflex.known)
    assert solo.offers(torch.tensor([0])).tolist() == [[-1, -1]]


def test_lookup_on_path_heads_with_shallow_trees():
    """A tree of width 4 and depth 1 commits at most 2 tokens a step, fewer than the 4 heads: the lookup's feedback
    must still line its offers up with the heads (a regression: it once mis-shaped them)."""
    model = make_model(vocab=40, scale=0.5, seed=3)  # flat next-token distributions: every node sits at depth 1
    heads = noisy_heads(model, num_heads=4, std=0.0, kind="path")
    ids, mask = left_padded([[5, 6, 7, 8], [3, 4]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=1, pad_token_id=0)
    engine = SpeculativeGenerator(model, heads, gc, capacity=10**6, max_nodes=4, topk_per_head=4,
                                  hooks=reflex_hooks("lookup"))
    out = engine.generate(ids, mask)
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
    assert out.completion_ids == [r[: next((i + 1 for i, t in enumerate(r) if t == 1), len(r))] for r in ref]
    assert out.stats["reflex_feedback"] > 0
