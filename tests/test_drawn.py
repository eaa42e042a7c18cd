"""Drafts drawn from the heads' q and verified by recursive rejection sampling: the rule's contract by exact
enumeration, its acceptance formulas, tree shapes drawn before the tokens, and a biased variant the chi-square
test catches."""

import pytest
import torch
from transformers import GenerationConfig

from specroll_trl.engine import drawn as drawn_mod
from specroll_trl.engine import generator as generator_mod
from specroll_trl.engine import walk_kernel
from specroll_trl.engine.drawn import AcceptanceByRank, TreeShape, rank_acceptance
from specroll_trl.engine.generator import SpeculativeGenerator
from specroll_trl.engine.heads import SpeculativeHeads

from .conftest import cut_after_eos, make_model
from .test_engine import PROMPTS, chi_square_pvalue, engine_samples, exact_completion_distribution, noisy_heads


def draws_without_replacement(q: torch.Tensor, fixed: int, width: int):
    """Every ordered child list a node can get, with its probability: the ``fixed`` top tokens of ``q``, then
    ``width - fixed`` tokens drawn from ``q`` one by one without replacement (what Gumbel-top-k samples). A list
    stops early where ``q`` has no mass left (``draw_tree`` would pad it with tokens of mass 0)."""
    top = q.argsort(descending=True)[:fixed].tolist()
    results = []

    def extend(children, prob):
        left = q.clone()
        left[children] = 0
        if len(children) == width or left.sum() <= 0:
            results.append((children, prob))
            return
        for token in (left > 0).nonzero().squeeze(1).tolist():
            extend(children + [token], prob * float(left[token] / left.sum()))

    extend(top, 1.0)
    return results


def emitted_distribution(p, q, fixed, width):
    """P(emitted token) under the rule, summed over every child list and every accept/reject outcome."""
    out = torch.zeros_like(p)
    for children, prob in draws_without_replacement(q, fixed, width):
        kids = torch.tensor(children + [-1] * (width - len(children)))
        alpha, residual = rank_acceptance(p, q, kids, fixed)
        reach = 1.0
        for r, token in enumerate(children):
            out[token] += prob * reach * alpha[r]
            reach *= 1 - alpha[r]
        out += prob * reach * residual
    return out


CASES = {
    "dense": (torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10]), torch.tensor([0.05, 0.10, 0.40, 0.25, 0.20])),
    "p truncated (top-k / top-p)": (torch.tensor([0.6, 0.0, 0.4, 0.0, 0.0]), torch.tensor([0.1, 0.5, 0.1, 0.2, 0.1])),
    "q on a draft vocabulary": (torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15]), torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])),
    "q = p": (torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0]), torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])),
    "q one-hot off p": (torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])),
}


@pytest.mark.parametrize("fixed,width", [(0, 1), (0, 3), (1, 3), (2, 3), (3, 3), (1, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_chain_emits_exactly_p(case, fixed, width):
    p, q = (t.double() / t.double().sum() for t in CASES[case])
    torch.testing.assert_close(emitted_distribution(p, q, fixed, width), p, atol=1e-12, rtol=0)


def test_one_drawn_child_is_accepted_with_one_minus_tv_and_fixed_children_with_their_mass():
    p, q = (t.double() / t.double().sum() for t in CASES["dense"])
    accepted = sum(prob * float(rank_acceptance(p, q, torch.tensor(kids), 0)[0][0])
                   for kids, prob in draws_without_replacement(q, 0, 1))
    assert accepted == pytest.approx(1 - 0.5 * float((p - q).abs().sum()), abs=1e-12)
    kids = torch.tensor([2, 3, 4])  # q's top 3: as fixed children, accepted with p's mass on them
    alpha, _ = rank_acceptance(p, q, kids, 3)
    reach, total = 1.0, 0.0
    for a in alpha.tolist():
        total += reach * a
        reach *= 1 - a
    assert total == pytest.approx(float(p[kids].sum()), abs=1e-12)


def test_deterministic_top_k_checked_with_p_over_q_is_biased():
    """What stays forbidden: children fixed as q's top-k but accepted with min(1, p/q)."""
    p, q = (t.double() for t in CASES["dense"])
    top = q.argsort(descending=True)[:2]
    alpha, residual = rank_acceptance(p, q, top, 0)  # as if drawn
    out = residual * (1 - alpha[0]) * (1 - alpha[1])
    out[top[0]] += alpha[0]
    out[top[1]] += (1 - alpha[0]) * alpha[1]
    assert (out - p).abs().max() > 0.05


def test_tree_shape_is_closed_under_parent_and_earlier_siblings_and_grows_by_prefix():
    rates = AcceptanceByRank(4, 3, prior=(0.5, 0.3))
    edge = rates.edge()
    assert edge[0].tolist() == pytest.approx([0.5, 0.5 * 0.3, 0.5 * 0.7 * 0.3])
    shape = TreeShape.best_first(edge, 12)
    assert shape.size == 13
    for v in range(1, shape.size):
        parent, rank = int(shape.parent[v]), int(shape.rank[v])
        assert 0 <= parent < v and int(shape.depth[v]) == int(shape.depth[parent]) + 1
        assert int(shape.children[parent, rank]) == v
        assert rank == 0 or int(shape.children[parent, rank - 1]) > 0  # earlier siblings are in the tree
        expected = float(shape.log_reach[parent]) + float(edge[shape.depth[parent], rank].log())
        assert float(shape.log_reach[v]) == pytest.approx(expected)
    small = shape.prefix(5)
    assert torch.equal(small.parent, TreeShape.best_first(edge, 5).parent)
    assert int(small.children.max()) < 6
    # with a sure first child the best tree is a chain
    chain = TreeShape.best_first(torch.tensor([[0.99, 0.005]] * 4), 4)
    assert chain.depth.tolist() == [0, 1, 2, 3, 4]


def test_acceptance_by_rank_follows_what_the_verifier_measures():
    rates = AcceptanceByRank(2, 2, prior=(0.4, 0.25), prior_weight=1.0, forget=1.0, refresh=1)
    for _ in range(200):
        rates.observe(torch.tensor([[0.9, 0.05], [0.2, 0.1]]), torch.ones(2, 2))
    assert rates.alpha[0, 0] == pytest.approx(0.9, abs=0.01)
    assert rates.alpha[1, 0] == pytest.approx(0.2, abs=0.01)
    # depth 0 accepts almost surely, depth 1 rarely: the best 3-node tree is wide at depth 1 (rank 1 at depth 1
    # reaches 0.9 * 0.8 * 0.1 = 0.072 > a third level's 0.9 * 0.2 * 0.2)
    shape = rates.shape(3)
    assert shape.depth.tolist() == [0, 1, 2, 2]


def walk_by_hand(draft, alpha, uniforms):
    """One row at a time, depth by depth: at the node it stands on, try its children in rank order, each accepted
    when the uniform of its depth and rank falls under its chance; enter the first accepted, else stop. Returns the
    accepted path per row and the chances summed and the children counted per (depth, rank) of every child tried."""
    shape = draft.shape
    paths = []
    alpha_sum = torch.zeros(shape.max_depth, shape.children.shape[1], dtype=torch.float64)
    tried = torch.zeros_like(alpha_sum)
    for row in range(uniforms.shape[0]):
        node, path = 0, [0]
        for depth in range(shape.max_depth):
            entered = None
            for rank, child in enumerate(shape.children[node].tolist()):
                if child < 0:
                    break
                chance = float(alpha[row, draft.slot[node], rank])
                alpha_sum[depth, rank] += chance
                tried[depth, rank] += 1
                if float(uniforms[row, depth, rank]) < chance:
                    entered = child
                    break
            if entered is None:
                break
            node = entered
            path.append(node)
        paths.append(path + [-1] * (shape.max_depth + 1 - len(path)))
    return torch.tensor(paths), alpha_sum, tried


def test_the_walk_makes_the_decisions_a_walk_depth_by_depth_makes():
    """``rejection_walk`` decides every child at once; each decision is the one a row walking its tree depth by depth
    makes, on trees of every shape (deep paths included: the target near the heads' ``q``), over a draft vocabulary
    and the whole one."""
    gen = torch.Generator().manual_seed(0)
    depths = set()
    for trial in range(60):
        heads, width = 1 + trial % 4, 1 + trial % 3
        fixed, batch, vocab_size = trial % (width + 1), 1 + trial % 4, 12
        vocab = None if trial % 2 else torch.tensor([1, 3, 4, 7, 8, 10])
        drafted = vocab_size if vocab is None else len(vocab)
        shape = TreeShape.best_first(torch.rand(heads, width, generator=gen), 1 + trial % 13)

        def propose(d, frontier, path, path_tokens, batch=batch, drafted=drafted):
            logits = 2 * torch.randn(batch, frontier.numel(), drafted, generator=gen)
            return torch.zeros(batch, frontier.numel(), 2), logits.log_softmax(-1)

        draft = drawn_mod.draw_tree(torch.zeros(batch, dtype=torch.long), shape, propose, vocab, fixed)
        q = torch.zeros(batch, shape.size, vocab_size)
        q[..., torch.arange(vocab_size) if vocab is None else vocab] = draft.q[:, draft.slot]
        probs = 0.9 * q + 0.1 * torch.randn(batch, shape.size, vocab_size, generator=gen).softmax(-1)
        uniforms = torch.rand(batch, shape.max_depth + 2, width, dtype=torch.float64, generator=gen)
        outcome = drawn_mod.rejection_walk(draft, probs, fixed, uniforms)
        alpha, _ = rank_acceptance(*draft.chain_inputs(probs, drawn_mod.parents_of(shape, batch), width), fixed)
        path, alpha_sum, tried = walk_by_hand(draft, alpha, uniforms)
        assert torch.equal(outcome.accepted, path)
        assert torch.equal(outcome.tried, tried)
        assert torch.allclose(outcome.alpha_sum, alpha_sum, rtol=0, atol=1e-9)
        depths.update((path >= 0).sum(1).tolist())
    assert max(depths) >= 4 and min(depths) == 1  # rows stopping at the root and rows reaching deep


def test_chi_square_detects_top_k_candidates_checked_with_p_over_q(monkeypatch):
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    heads = noisy_heads(model, std=0.4, seed=1, kind="path")
    gc = GenerationConfig(do_sample=True, max_new_tokens=3, eos_token_id=1, pad_token_id=0, temperature=1.0, top_k=0)
    original = drawn_mod.rank_acceptance
    monkeypatch.setattr(drawn_mod, "rank_acceptance", lambda p, q, children, fixed: original(p, q, children, 0))
    monkeypatch.setattr(walk_kernel, "walk_kernel_available", lambda: False)  # the biased chain is the reference's
    samples, _ = engine_samples(model, heads, gc, n_per_prompt=12000, seed=5, candidates="drawn", fixed_children=2)
    exact = exact_completion_distribution(model, PROMPTS[0], gc)
    assert chi_square_pvalue(samples[0], exact) < 1e-6


@pytest.mark.parametrize("kind", [pytest.param("independent", marks=pytest.mark.slow), "path"])
def test_drawn_candidates_over_a_draft_vocabulary_are_exact(kind):
    """q is zero outside the draft vocabulary (tokens 0, 1 and 4 here): the residual covers them."""
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    heads = SpeculativeHeads.from_model(model, num_heads=3, draft_ids=torch.tensor([2, 3, 5]), kind=kind)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.4)
    gc = GenerationConfig(do_sample=True, max_new_tokens=3, eos_token_id=1, pad_token_id=0, temperature=1.0, top_k=0)
    samples, stats = engine_samples(model, heads, gc, n_per_prompt=12000, seed=3, candidates="drawn")
    assert stats["accepted"] > 0.1 * stats["row_forwards"]
    for prompt, rows in zip(PROMPTS, samples):
        assert chi_square_pvalue(rows, exact_completion_distribution(model, prompt, gc)) > 1e-3


def test_drawn_candidates_accept_more_than_top_k_at_temperature_one_on_diffuse_heads():
    """Heads close to the target in distribution but with an uncertain argmax: drawing from q pays."""
    model = make_model(vocab=12, hidden=32, scale=2.0, seed=3, eos=1, pad=0)
    heads = noisy_heads(model, std=0.05, seed=2, kind="path")
    gc = GenerationConfig(do_sample=True, max_new_tokens=12, eos_token_id=1, pad_token_id=0, temperature=1.0, top_k=0)
    taus = {}
    rules = {"top-k": dict(candidates="top-k"), "drawn": dict(candidates="drawn", fixed_children=0)}
    for rule, options in rules.items():
        torch.manual_seed(0)
        engine = SpeculativeGenerator(model, heads, gc, capacity=10**9, max_nodes=1, topk_per_head=1,
                                      **options)
        ids = torch.tensor([[2, 3, 4]] * 400)
        taus[rule] = engine.generate(ids, torch.ones_like(ids)).stats.tau
    assert taus["drawn"] > taus["top-k"] + 0.05, taus


def test_greedy_never_draws(monkeypatch):
    model = make_model(vocab=40, scale=4.0, seed=3)
    heads = noisy_heads(model, std=0.3, kind="path")
    gc = GenerationConfig(do_sample=False, max_new_tokens=10, eos_token_id=1, pad_token_id=0)
    ids = torch.tensor([[5, 6, 7, 8]] * 3)
    walks = []
    counted = lambda *args: walks.append(1) or walk_kernel.walk(*args)  # noqa: E731
    monkeypatch.setattr(generator_mod, "walk", counted)
    out = SpeculativeGenerator(model, heads, gc, capacity=10**9, max_nodes=4, candidates="drawn").generate(
        ids, torch.ones_like(ids))
    reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    assert out.completion_ids == cut_after_eos(reference[:, 4:].tolist(), {1}) and not walks
    assert out.stats.drafted_row_steps > 0


@pytest.mark.parametrize("options,match", [
    (dict(candidates="sampled"), "candidates must be one of"),
    (dict(fixed_children=5, topk_per_head=4), "fixed_children must be in"),
    (dict(fixed_children=-1), "fixed_children must be in"),
])
def test_invalid_rule_options_are_refused(options, match):
    model = make_model()
    with pytest.raises(ValueError, match=match):
        SpeculativeGenerator(model, noisy_heads(model, 2), GenerationConfig(max_new_tokens=3), **options)


def test_bench_rule_names():
    from specroll_trl.experiments.heads_bench import rule_options

    assert rule_options("top-k") == dict(candidates="top-k")
    assert rule_options("drawn") == dict(candidates="drawn", fixed_children=0)
    assert rule_options("drawn+2") == dict(candidates="drawn", fixed_children=2)
    with pytest.raises(ValueError, match="unknown rule"):
        rule_options("drawn+x")
