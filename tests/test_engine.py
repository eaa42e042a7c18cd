"""The speculative engine: greedy identity with `generate`, exact sampling distribution, tree forward,
ragged cache, node budget, and clear errors."""

import logging
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from transformers import DynamicCache, GenerationConfig

from specroll_trl.engine import verify as verify_mod
from specroll_trl.engine.budget import node_budget
from specroll_trl.engine.compat import check_model_supported
from specroll_trl.engine.generator import SpeculativeConfig, SpeculativeGenerator
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.engine.kvcache import RaggedCache, RoomyLayer, displaced, roomy_cache
from specroll_trl.engine.tree import DraftTree, PathTable, grow_tree, select_tree
from specroll_trl.experiments.zoo import task_prompt_ids

from .conftest import cut_after_eos, left_padded, make_model

HEAD_KINDS = ["independent", "path"]


def noisy_heads(model, num_heads=4, std=0.5, seed=0, kind="independent"):
    heads = SpeculativeHeads.from_model(model, num_heads, kind=kind)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, std)
    return heads


def generate_reference(model, ids, mask, gc):
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    return cut_after_eos(out, set(eos))


def small_engine(model=None, **options):
    """A 2-head engine with 5 new tokens, eos 1, pad 0 and ``C_hw`` 8 unless ``options`` say otherwise."""
    model = model or make_model()
    gc = GenerationConfig(max_new_tokens=5, eos_token_id=1, pad_token_id=0)
    return SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2), gc, **{"capacity": 8, **options})


def count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


# --------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("batch_size,num_prompts",
                         [pytest.param(1, 50, marks=pytest.mark.slow), pytest.param(3, 60, marks=pytest.mark.slow),
                          (16, 64)])
def test_greedy_equals_generate_with_trained_heads(nano, batch_size, num_prompts):
    model, tokenizer, heads = nano
    prompts = task_prompt_ids(tokenizer, "arithmetic", num_prompts, seed=777)
    gc = GenerationConfig(do_sample=False, max_new_tokens=48, eos_token_id=model.generation_config.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    eng = SpeculativeGenerator(model, heads, gc, capacity=256, max_nodes=8)
    taus = []
    for i in range(0, num_prompts, batch_size):
        ids, mask = left_padded(prompts[i : i + batch_size], tokenizer.pad_token_id)
        out = eng.generate(ids, mask)
        assert out.completion_ids == generate_reference(model, ids, mask, gc)
        taus.append(out.stats["tau"])
    assert sum(taus) / len(taus) > 1.8  # the distilled heads really do get accepted


def test_greedy_equals_generate_with_useless_heads(nano):
    model, tokenizer, _ = nano
    heads = noisy_heads(model, std=3.0)
    prompts = task_prompt_ids(tokenizer, "arithmetic", 48, seed=778)
    gc = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=model.generation_config.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)
    eng = SpeculativeGenerator(model, heads, gc, capacity=256, max_nodes=8)
    for i in range(0, 48, 16):
        ids, mask = left_padded(prompts[i : i + 16], tokenizer.pad_token_id)
        out = eng.generate(ids, mask)
        assert out.completion_ids == generate_reference(model, ids, mask, gc)
        assert out.stats["tau"] < 1.3


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_greedy_random_model_eos_list_and_pad_equals_eos(kind):
    model = make_model(vocab=40, scale=4.0, seed=3, eos=1, pad=1)
    heads = noisy_heads(model, std=0.3, kind=kind)
    prompts = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [2], [7, 7, 7, 7, 7, 7, 7]]
    ids, mask = left_padded(prompts, pad=1)
    gc = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=[1, 2], pad_token_id=1,
                          repetition_penalty=1.3)
    out = SpeculativeGenerator(model, heads, gc, capacity=64, max_nodes=6).generate(ids, mask)
    assert out.completion_ids == generate_reference(model, ids, mask, gc)
    for row in out.completion_ids:
        assert all(t not in (1, 2) for t in row[:-1])


# --------------------------------------------------------------------------- exact sampling distribution

PROMPTS = [[2, 3, 4], [5, 2]]
LENGTH = 3


def exact_completion_distribution(model, prompt, gc, mask=None):
    """P(completion) for every completion of up to LENGTH tokens, from generate's own processed scores: one
    ``generate`` step per prefix on the same (optionally left-padded, ``mask``) input, ``min_new_tokens`` shifted
    by the prefix length (each call counts new tokens from its own input)."""
    eos = set(gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id])
    mask = mask or [1] * len(prompt)
    dist = {(): 1.0}
    frontier = [()]
    result = {}
    for j in range(LENGTH):
        ids = torch.tensor([prompt + list(p) for p in frontier])
        options = {**gc.to_dict(), "max_new_tokens": 1}
        if gc.min_new_tokens:
            options["min_new_tokens"] = max(0, gc.min_new_tokens - j) or None
        out = model.generate(input_ids=ids, attention_mask=torch.tensor([mask + [1] * j] * len(frontier)),
                             generation_config=GenerationConfig(**options), output_scores=True,
                             return_dict_in_generate=True)
        probs = torch.softmax(out.scores[0].double(), -1)
        nxt = []
        for prefix, p in zip(frontier, probs):
            for tok in range(p.shape[0]):
                if p[tok] == 0:
                    continue
                seq = prefix + (tok,)
                dist[seq] = dist[prefix] * float(p[tok])
                if tok in eos or len(seq) == LENGTH:
                    result[seq] = dist[seq]
                else:
                    nxt.append(seq)
        frontier = nxt
    return result


# the verification rules: top-k candidates matched against the target's samples; drawn candidates, with 0 or 1 fixed
# (top-of-q) children per node, verified by recursive rejection sampling
RULES = {"top-k": dict(candidates="top-k"), "drawn": dict(candidates="drawn", fixed_children=0),
         "drawn+1-fixed": dict(candidates="drawn", fixed_children=1)}


def engine_samples(model, heads, gc, n_per_prompt, seed, **options):
    prompts = [p for p in PROMPTS for _ in range(n_per_prompt)]
    ids, mask = left_padded(prompts)
    torch.manual_seed(seed)
    eng = SpeculativeGenerator(model, heads, gc, **{"capacity": 10**9, "max_nodes": 7, "topk_per_head": 2,
                                                    "track_expected_acceptance": True, **options})
    out = eng.generate(ids, mask)
    return [out.completion_ids[i * n_per_prompt : (i + 1) * n_per_prompt] for i in range(len(PROMPTS))], out.stats


def chi_square_pvalue(samples, exact):
    counts = {}
    for s in samples:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    assert set(counts) <= set(exact), "engine produced a completion the target gives zero probability"
    n = len(samples)
    keys = sorted(exact, key=lambda k: -exact[k])
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for k in keys:
        e = exact[k] * n
        if e >= 5:
            observed.append(counts.get(k, 0))
            expected.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


SAMPLING_SETTINGS = {
    "t1.0": dict(temperature=1.0, top_k=0),
    "t0.7-topk3": dict(temperature=0.7, top_k=3),
    "t1.0-topp0.8": dict(temperature=1.0, top_k=0, top_p=0.8),
    "t0.7-minp-rep": dict(temperature=0.7, top_k=0, min_p=0.15, repetition_penalty=1.5),
    "t1.0-rep-topk-topp": dict(temperature=1.0, repetition_penalty=1.3, top_k=4, top_p=0.9),
}


FAST_RULE_CASES = {("t1.0-rep-topk-topp", "path", "top-k"), ("t1.0-rep-topk-topp", "independent", "drawn"),
                   ("t1.0", "path", "drawn+1-fixed"), ("t1.0", "independent", "top-k")}


def rule_cases():
    """Every (setting, head kind, rule); the fast lane keeps ``FAST_RULE_CASES``: each rule, each head kind and the
    plain and the most processed setting at least once."""
    return [pytest.param(name, kind, rule, marks=() if (name, kind, rule) in FAST_RULE_CASES else pytest.mark.slow)
            for name in sorted(SAMPLING_SETTINGS) for kind in HEAD_KINDS for rule in RULES]


@pytest.mark.parametrize("name,kind,rule", rule_cases())
def test_sampling_distribution_is_exact(name, kind, rule):
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    heads = noisy_heads(model, std=0.4, seed=1, kind=kind)
    gc = GenerationConfig(do_sample=True, max_new_tokens=LENGTH, eos_token_id=1, pad_token_id=0,
                          **SAMPLING_SETTINGS[name])
    samples, stats = engine_samples(model, heads, gc, n_per_prompt=12000, seed=5, **RULES[rule])
    assert stats["accepted"] > 0.2 * stats["row_forwards"]  # drafts were really accepted
    for prompt, rows in zip(PROMPTS, samples):
        exact = exact_completion_distribution(model, prompt, gc)
        assert abs(sum(exact.values()) - 1) < 1e-9
        assert chi_square_pvalue(rows, exact) > 1e-3


def lossy_match(tree, sampled):
    """A biased verifier: always accepts the first child of the root, whatever the target sampled."""
    path = engine_mod_match(tree, sampled)
    first_child = (tree.parent == 0).int().argmax(1)
    has_child = (tree.parent == 0).any(1)
    forced = torch.where(has_child, first_child, path[:, 1])
    path[:, 1] = forced
    path[:, 2:] = torch.where(has_child[:, None], -1, path[:, 2:])
    return path


engine_mod_match = verify_mod.match_tree


def test_chi_square_detects_a_biased_verifier(monkeypatch):
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    heads = noisy_heads(model, std=0.4, seed=1)
    gc = GenerationConfig(do_sample=True, max_new_tokens=LENGTH, eos_token_id=1, pad_token_id=0, temperature=1.0,
                          top_k=0)
    monkeypatch.setattr(verify_mod, "match_tree", lossy_match)
    samples, stats = engine_samples(model, heads, gc, n_per_prompt=12000, seed=5, candidates="top-k")
    exact = exact_completion_distribution(model, PROMPTS[0], gc)
    counts_ok = all(tuple(s) in exact for s in samples[0])
    assert not counts_ok or chi_square_pvalue(samples[0], exact) < 1e-6
    assert stats["accepted"] > 1.2 * stats["expected_accepted"]


def nano_sampling_inputs(nano, num_prompts, seed, **generation):
    """Left-padded task prompts for the nano policy and a sampling GenerationConfig with its eos/pad."""
    model, tokenizer, _ = nano
    prompts = task_prompt_ids(tokenizer, "arithmetic", num_prompts, seed=seed)
    ids, mask = left_padded(prompts, tokenizer.pad_token_id)
    gc = GenerationConfig(do_sample=True, top_k=0, eos_token_id=model.generation_config.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, **generation)
    return prompts, ids, mask, gc


@pytest.mark.parametrize("rule", [r if r == "drawn" else pytest.param(r, marks=pytest.mark.slow)
                                  for r in sorted(RULES)])
def test_mean_accepted_length_matches_tree_path_probability(nano, rule):
    model, _, heads = nano
    _, ids, mask, gc = nano_sampling_inputs(nano, 96, seed=779, temperature=1.0, max_new_tokens=96)
    torch.manual_seed(0)
    stats = SpeculativeGenerator(model, heads, gc, capacity=10**6, max_nodes=10, track_expected_acceptance=True,
                                 **RULES[rule]).generate(ids, mask).stats
    accepted, expected = stats["accepted"], stats["expected_accepted"]
    assert expected > 500
    # accepted counts per row-step are bounded by the depth (4): the sum's std is below 2*sqrt(row steps)
    assert abs(accepted - expected) < 4 * 2 * stats["row_forwards"] ** 0.5


# --------------------------------------------------------------------------- tree forward and ragged cache


def test_tree_forward_logits_equal_incremental_decoding():
    model = make_model(vocab=50, seed=4)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    ids, mask = left_padded(prompts)
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    root = out.logits[:, -1].argmax(-1)
    kv = RaggedCache(cache, mask.bool(), mask.sum(1))
    torch.manual_seed(0)
    topk_logp, topk_ids = torch.randn(3, 4, 50).log_softmax(-1).topk(3, dim=-1)
    tree = select_tree(root, topk_ids, topk_logp, PathTable.build(4, 3), num_nodes=12)
    logits = model(input_ids=tree.tokens, position_ids=kv.lengths[:, None] + tree.depth,
                   attention_mask=kv.tree_attention_mask(tree.ancestors, torch.float32), cache=kv.cache,
                   use_cache=True).logits
    for b, prompt in enumerate(prompts):
        for v in range(tree.size):
            path = [int(tree.path_tokens[b, v, d]) for d in range(int(tree.depth[b, v]) + 1)]
            ref = model(input_ids=torch.tensor([prompt + path])).logits[0, -1]
            torch.testing.assert_close(logits[b, v], ref, atol=1e-4, rtol=1e-4)


def test_roomy_layers_append_in_place_and_give_the_same_logits_bitwise():
    """A ``DynamicLayer`` copies its whole cache at every step (``torch.cat``); a ``RoomyLayer`` writes the step's
    slots into room it keeps, and whatever replaced its tensors (rows leaving) is copied once."""
    model = make_model(vocab=50, seed=4)
    ids, mask = left_padded([[3, 4, 5, 6], [7, 8], [9, 10, 11]])
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    caches = {"dynamic": DynamicCache(config=model.config), "roomy": roomy_cache(model.config, room=8)}
    runs = {name: [model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits]
            for name, cache in caches.items()}
    buffer = caches["roomy"].layers[0].buffers[0]
    assert isinstance(caches["roomy"].layers[0], RoomyLayer) and buffer.shape[2] == 4 + 8
    appended = 0
    for query in map(torch.tensor, [[[12], [13], [14]], [[15, 16], [17, 18], [19, 20]], [[21], [22], [23]]]):
        step_mask = torch.cat([mask, torch.ones(3, appended + query.shape[1], dtype=mask.dtype)], 1)
        position = pos[:, -1:] + 1 + appended + torch.arange(query.shape[1])
        for name, cache in caches.items():
            runs[name].append(model(input_ids=query, attention_mask=step_mask, position_ids=position, cache=cache,
                                    use_cache=True).logits)
        appended += query.shape[1]
    assert all(torch.equal(a, b) for a, b in zip(*runs.values()))
    assert caches["roomy"].layers[0].buffers[0] is buffer  # 4 slots appended into the room of 8: no new buffer
    for cache in caches.values():  # a row leaves, the last takes its place: in place, one row moved
        RaggedCache(cache, torch.ones(3, 9, dtype=torch.bool), torch.full((3,), 9)).keep_rows(torch.tensor([0, 2]))
    assert caches["roomy"].layers[0].keys.shape[0] == 2
    step_pos = torch.tensor([[8], [8]])
    outs = [model(input_ids=torch.tensor([[24], [25]]), attention_mask=torch.ones(2, 9, dtype=torch.long),
                  position_ids=step_pos, cache=cache, use_cache=True).logits for cache in caches.values()]
    assert torch.equal(*outs) and caches["roomy"].layers[0].buffers[0] is buffer
    for cache in caches.values():  # leading slots dropped (a view further into the buffer), then a compaction
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
    outs = [model(input_ids=torch.tensor([[26], [27]]), attention_mask=torch.ones(2, 10, dtype=torch.long),
                  position_ids=step_pos + 1, cache=cache, use_cache=True).logits for cache in caches.values()]
    assert torch.equal(*outs) and caches["roomy"].layers[0].buffers[0] is buffer
    for cache in caches.values():
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.flip(2).contiguous(), layer.values.flip(2).contiguous()
    outs = [model(input_ids=torch.tensor([[28], [29]]), attention_mask=torch.ones(2, 11, dtype=torch.long),
                  position_ids=step_pos + 2, cache=cache, use_cache=True).logits for cache in caches.values()]
    assert torch.equal(*outs) and caches["roomy"].layers[0].buffers[0] is not buffer  # copied once, with room


def test_rows_leaving_move_as_many_rows_as_leave(monkeypatch):
    """When rows finish (``RaggedCache.leave``, through the engine's ``_keep``), the rows that stay keep their places
    and the last ones move into the leavers', in one multi-tensor copy of room-keeping layers' rows: rows finishing
    copy no more rows than they were (kept in order, the whole cache was copied out and again at the next
    append: at 32 rows the step after a row left took ~50 ms more)."""
    model = make_model(vocab=50, seed=4)
    ids, mask = left_padded([[3 + b, 4, 5] for b in range(6)])
    cache = roomy_cache(model.config, room=8)
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    kv = RaggedCache(cache, mask.bool(), mask.sum(1))
    before = [layer.keys.clone() for layer in cache.layers]
    copies = []
    original = torch._foreach_copy_

    def counting(targets, sources):
        copies.append([t.shape for t in targets])
        return original(targets, sources)

    state = SimpleNamespace(rows=torch.arange(10, 16), root=torch.arange(6), hidden=torch.randn(6, 4), kv=kv)
    hidden = state.hidden.clone()
    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    SpeculativeGenerator._keep(state, torch.tensor([True, False, True, True, False, True]))
    monkeypatch.undo()
    keep = torch.tensor([0, 5, 2, 3])  # the last row takes the first leaver's place; the second leaver was last but one
    assert torch.equal(state.rows, 10 + keep) and torch.equal(state.root, keep)
    assert torch.equal(state.hidden, hidden[keep])
    # one multi-tensor copy of one row per keys / values tensor of every layer
    assert len(copies) == 1 and copies[0] == [before[0][0].shape] * (2 * len(cache.layers))
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys, old[keep]) and layer.keys.data_ptr() == layer.buffers[0].data_ptr()


def test_tree_is_closed_under_parent_and_best_first():
    torch.manual_seed(1)
    topk_logp, topk_ids = torch.randn(5, 4, 30).log_softmax(-1).topk(4, dim=-1)
    table = PathTable.build(4, 4)
    tree = select_tree(torch.arange(5), topk_ids, topk_logp, table, num_nodes=20)
    for b in range(5):
        for v in range(1, tree.size):
            parent = int(tree.parent[b, v])
            assert 0 <= parent < v and int(tree.depth[b, parent]) == int(tree.depth[b, v]) - 1
        siblings = {}
        for v in range(1, tree.size):
            siblings.setdefault(int(tree.parent[b, v]), []).append(int(tree.tokens[b, v]))
        assert all(len(s) == len(set(s)) for s in siblings.values())  # children are distinct tokens
    # with one node per row the tree is each head-1 argmax
    single = select_tree(torch.arange(5), topk_ids, topk_logp, table, num_nodes=1)
    assert torch.equal(single.tokens[:, 1], topk_ids[:, 0, 0])


@pytest.mark.parametrize("layers", ["dynamic", "roomy"])
def test_ragged_cache_after_many_steps_equals_fresh_prefill(layers):
    model = make_model(vocab=50, seed=6)
    gen = torch.Generator().manual_seed(0)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12], [13]]
    ids, mask = left_padded(prompts)
    cache = DynamicCache(config=model.config) if layers == "dynamic" else roomy_cache(model.config, room=4)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    kv = RaggedCache(cache, mask.bool(), mask.sum(1), compact_ratio=0.05)
    committed = [list(p) for p in prompts]
    rows = list(range(4))
    table = PathTable.build(3, 3)
    compactions = in_place = 0
    for step in range(40):
        batch = len(rows)
        root = torch.randint(2, 50, (batch,), generator=gen)
        topk_logp, topk_ids = torch.randn(batch, 3, 50, generator=gen).log_softmax(-1).topk(3, dim=-1)
        tree = select_tree(root, topk_ids, topk_logp, table, num_nodes=int(torch.randint(0, 8, (1,), generator=gen)))
        model(input_ids=tree.tokens, position_ids=kv.lengths[:, None] + tree.depth,
              attention_mask=kv.tree_attention_mask(tree.ancestors, torch.float32), cache=kv.cache, use_cache=True)
        # a random accepted path per row: walk random children
        paths = []
        for b in range(batch):
            path, node = [0], 0
            while True:
                children = [v for v in range(tree.size) if int(tree.parent[b, v]) == node]
                if not children or torch.rand(1, generator=gen) < 0.3:
                    break
                node = children[int(torch.randint(len(children), (1,), generator=gen))]
                path.append(node)
            paths.append(path)
            committed[rows[b]] += [int(tree.tokens[b, v]) for v in path]
        width = max(map(len, paths))
        accepted = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
        before = kv.physical_length
        kv.commit(accepted)
        compactions += kv.physical_length < before + width
        in_place += not displaced(accepted).any()
        if step == 25:  # a row finishes and leaves
            keep = torch.tensor([0, 2, 3])
            kv.keep_rows(keep)
            rows = [rows[i] for i in keep.tolist()]
    assert compactions > 0
    assert 0 < in_place < 40  # commits that gather slots and commits that leave every slot where it is, both checked
    assert torch.equal(kv.lengths, torch.tensor([len(committed[r]) for r in rows]))
    probe = torch.tensor([[20]] * len(rows))
    logits = model(input_ids=probe, position_ids=kv.lengths[:, None],
                   attention_mask=kv.tree_attention_mask(torch.ones(len(rows), 1, 1, dtype=torch.bool),
                                                         torch.float32),
                   cache=kv.cache, use_cache=True).logits[:, -1]
    for b, r in enumerate(rows):
        ref = model(input_ids=torch.tensor([committed[r] + [20]])).logits[0, -1]
        torch.testing.assert_close(logits[b], ref, atol=1e-4, rtol=1e-4)


def test_a_commit_whose_accepted_nodes_sit_in_their_slots_moves_none():
    """Where every row's ``j``-th accepted node is node ``j`` (or none), the commit only moves the cache's end back:
    no gather, and the same cache as the gathering commit leaves."""
    model = make_model(vocab=50, seed=4)
    ids, mask = left_padded([[3, 4, 5, 6], [7, 8]])
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    accepted = torch.tensor([[0, 1, 2], [0, 1, -1]])
    assert not displaced(accepted).any() and displaced(torch.tensor([[0, 2, -1]])).any()
    caches = []
    for moved in (False, True):
        cache = roomy_cache(model.config)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
        kv = RaggedCache(cache, mask.bool(), mask.sum(1))
        chain = torch.tensor([[20, 21, 22, 23], [24, 25, 26, 27]])  # a chain of 3 draft nodes after each root
        model(input_ids=chain, position_ids=kv.lengths[:, None] + torch.arange(4),
              attention_mask=kv.tree_attention_mask(torch.ones(4, 4).tril().bool().expand(2, -1, -1), torch.float32),
              cache=kv.cache, use_cache=True)
        if not moved:
            kv._gather_appended = None  # calling it would fail
        kv.commit(accepted, moved=moved)
        caches.append(kv)
    skipped, gathered = caches
    assert skipped.physical_length == gathered.physical_length == 4 + 3
    assert torch.equal(skipped.valid, gathered.valid) and torch.equal(skipped.lengths, torch.tensor([7, 4]))
    for a, b in zip(skipped.cache.layers, gathered.cache.layers):
        keep = skipped.valid[:, None, :, None]
        assert torch.equal(a.keys * keep, b.keys * keep) and torch.equal(a.values * keep, b.values * keep)


# --------------------------------------------------------------------------- budget, errors, fallback


def test_node_budget_formula():
    assert node_budget(64, 8, 16) == 7
    assert node_budget(64, 64, 16) == 0
    assert node_budget(64, 100, 16) == 0
    assert node_budget(1000, 2, 16) == 16
    assert [node_budget(96, b, 32) for b in (32, 16, 8, 4, 2, 1)] == [2, 5, 11, 23, 32, 32]


def test_node_budget_grows_as_rows_finish_and_respects_capacity():
    model = make_model(vocab=40, scale=3.0, seed=2)
    heads = noisy_heads(model, std=0.2)
    torch.manual_seed(0)
    prompts = [[int(x) for x in torch.randint(2, 40, (int(n),))] for n in torch.randint(1, 8, (16,))]
    ids, mask = left_padded(prompts)
    gc = GenerationConfig(do_sample=True, max_new_tokens=40, eos_token_id=1, pad_token_id=0, top_k=0)
    stats = SpeculativeGenerator(model, heads, gc, capacity=48, max_nodes=12).generate(ids, mask).stats
    active, nodes = stats["active_rows"], stats["nodes_per_row"]
    assert active[0] == 16 and active[-1] < 16
    for a, n in zip(active, nodes):
        assert n == node_budget(48, a, 12)
        assert n == 0 or a * (n + 1) <= 48
    assert all(n1 <= n2 for n1, n2 in zip(nodes, nodes[1:]))


def test_capacity_below_the_batch_size_means_no_drafting_and_stays_exact():
    """N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max); C_hw < B_t is valid and just disables drafting."""
    model = make_model(vocab=40, scale=4.0, seed=3)
    heads = noisy_heads(model, std=0.3)
    prompts = [[5, 6, 7], [3, 4], [10, 11, 12, 13], [2]]
    ids, mask = left_padded(prompts)
    gc = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, heads, gc, capacity=1, max_nodes=8).generate(ids, mask)
    assert out.stats["nodes_per_row"] and set(out.stats["nodes_per_row"]) == {0}
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
    assert out.completion_ids == cut_after_eos(ref, {1})


@pytest.mark.parametrize(
    "kind,match",
    [
        ("flash_attention_2", "flash_attention_2"),
        ("flex_attention", "flex_attention"),
        ("flash_attention_3", "flash_attention_3"),
        ("encoder_decoder", "encoder-decoder"),
        ("mamba", "mamba"),
        ("linear_attention", "linear_attention"),
        ("sliding_attention", "sliding_attention"),
        ("sliding_window", "sliding-window"),
    ],
)
def test_unsupported_attention_and_cache_kinds_fail_at_construction(kind, match):
    model = make_model()
    if kind == "encoder_decoder":
        model.config.is_encoder_decoder = True
    elif kind in ("mamba", "linear_attention", "sliding_attention"):
        model.config.layer_types = [kind, "full_attention"]
    elif kind == "sliding_window":
        model.config.use_sliding_window, model.config.sliding_window = True, 16
    else:
        model.config._attn_implementation = kind
    with pytest.raises(ValueError, match=match):
        check_model_supported(model)
    with pytest.raises(ValueError, match=match):
        small_engine(model)


def test_feed_forward_layer_kinds_are_supported():
    model = make_model()
    model.config.layer_types = ["full_attention", "moe"]  # only attention/cache kinds matter
    check_model_supported(model)
    small_engine(model)


def test_fallback_to_generate_is_logged_and_exact(caplog):
    model = make_model(vocab=40, scale=3.0)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    gc = GenerationConfig(do_sample=False, max_new_tokens=10, eos_token_id=1, pad_token_id=0)
    with caplog.at_level(logging.WARNING):
        eng = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2), gc, fallback_to_generate=True)
    assert "falls back" in caplog.text
    model.config.layer_types = ["full_attention", "full_attention"]
    ids, mask = left_padded([[4, 5, 6], [7]])
    out = eng.generate(ids, mask)
    assert out.stats["fallback"] is True
    assert out.completion_ids == generate_reference(model, ids, mask, gc)


@pytest.mark.parametrize(
    "options,error,match",
    [
        (dict(topk_per_head=0), ValueError, "topk_per_head must be >= 1"),
        (dict(max_nodes=-1), ValueError, "max_nodes must be >= 0"),
        (dict(capacity=0), ValueError, r"capacity \(C_hw\) must be >= 1"),
        (dict(max_nodes=2.5), TypeError, "max_nodes must be an int"),
        (dict(topk_per_head=True), TypeError, "topk_per_head must be an int"),
        (dict(capacity=64.0), TypeError, "capacity must be an int"),
        (dict(compact_ratio=0.0), ValueError, "compact_ratio"),
        (dict(compact_ratio=1.5), ValueError, "compact_ratio"),
    ],
)
def test_invalid_engine_config_values(options, error, match):
    with pytest.raises(error, match=match):
        SpeculativeConfig(**options)
    model = make_model()
    with pytest.raises(error, match=match):
        SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2), model.generation_config, **options)


def test_topk_per_head_larger_than_vocab_is_refused_at_construction():
    model = make_model(vocab=32)
    with pytest.raises(ValueError, match=r"topk_per_head \(33\) exceeds the model's vocab size \(32\)"):
        small_engine(model, topk_per_head=33)
    small_engine(model, topk_per_head=32)  # the whole vocabulary is allowed


def test_incompatible_heads_are_refused():
    model = make_model()
    other = make_model(vocab=64)
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeGenerator(model, SpeculativeHeads.from_model(other, 2))


@pytest.mark.parametrize(
    "ids,mask,max_new,error,match",
    [
        ([[3, 40]], None, 5, ValueError, r"outside the model's vocabulary \[0, 32\): \[40\]"),
        ([[-3, 4]], None, 5, ValueError, r"outside the model's vocabulary \[0, 32\): \[-3\]"),
        ([[3.0, 4.0]], None, 5, TypeError, "integer token ids"),
        ([[0, 3], [0, 0]], [[0, 1], [0, 0]], 5, ValueError, "at least one token"),
        ([[3, 4]], [[1, 1, 1]], 5, ValueError, "attention_mask shape"),
        ([[3, 4, 0]], [[1, 1, 0]], 5, ValueError, "left-padded"),
        ([[3, 4]], None, 0, ValueError, "max_new_tokens must be >= 1"),
        ([[3] * 520], None, 1, ValueError, "context of 512 positions"),
        ([[3] * 10], None, 600, ValueError, "context of 512 positions"),  # the prompt fits, prompt + budget not
        ((1, 0), None, 5, ValueError, "non-empty"),  # a shape: zero-length prompts
        ((0, 3), None, 5, ValueError, "non-empty"),  # a shape: no prompts
    ],
)
def test_bad_prompts_are_refused_before_any_forward(ids, mask, max_new, error, match):
    model = make_model(vocab=32)
    engine = small_engine(model)
    calls = count_forwards(model)
    ids = torch.zeros(ids, dtype=torch.long) if isinstance(ids, tuple) else torch.tensor(ids)
    mask = torch.tensor(mask) if mask is not None else None
    with pytest.raises(error, match=match):
        engine.generate(ids, mask, max_new_tokens=max_new)
    assert not calls, "the model ran before the input was refused"


def test_padding_ids_outside_the_vocab_are_not_an_error():
    """Only attended positions are checked: a pad id is never embedded for a real token."""
    model = make_model(vocab=32)
    out = small_engine(model).generate(torch.tensor([[3, 4], [0, 5]]), torch.tensor([[1, 1], [0, 1]]))
    assert len(out.completion_ids) == 2


@pytest.mark.parametrize("value,step,row", [(float("nan"), 0, None), (float("nan"), 2, 1), (float("inf"), 1, 0),
                                            (-float("inf"), 3, 2)])
def test_non_finite_logits_name_step_and_row(value, step, row):
    """``row`` None: a NaN lm_head weight row poisons every row's logits from the prefill (step 0) on, with
    drafting on; otherwise one logit of one row is poisoned at one step, with drafting off (one forward a step)."""
    model = make_model(vocab=32)
    model.generation_config.eos_token_id = None  # no row finishes, so batch rows keep their indices
    gc = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2), gc,
                                  capacity=8 if row is None else 1)
    calls = []

    def poison(_module, _args, output):
        calls.append(1)
        if row is not None and len(calls) == step + 1:  # call 1 is the prefill (step 0)
            output.logits[row, -1, 5] = value
        return output

    model.register_forward_hook(poison)
    if row is None:
        with torch.no_grad():
            model.lm_head.weight[3] = value
    rows = "0, 1, 2" if row is None else row
    with pytest.raises(FloatingPointError, match=rf"NaN or inf at decoding step {step} for batch rows \[{rows}\]"):
        engine.generate(torch.tensor([[3, 4], [5, 6], [7, 8]]))
    assert len(calls) == step + 1  # stopped at once


def test_finite_logits_whose_sum_overflows_are_not_an_error():
    """The step checks one sum of its logits; a sum that overflows on finite logits goes to the exact check, which
    lets the step on."""
    model = make_model(vocab=32)
    gc = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2), gc, capacity=8)

    def huge(_module, _args, output):
        output.logits[..., 5:] = 3e38  # finite, argmax 5, sum inf
        return output

    model.register_forward_hook(huge)
    assert engine.generate(torch.tensor([[3, 4]])).completion_ids == [[5] * 6]


def test_logprobs_are_target_log_softmax_over_temperature(nano):
    model, _, heads = nano
    prompts, ids, mask, gc = nano_sampling_inputs(nano, 4, seed=780, temperature=0.8, max_new_tokens=24)
    out = SpeculativeGenerator(model, heads, gc, capacity=256, return_logprobs=True).generate(ids, mask)
    for b, (prompt, completion) in enumerate(zip(prompts, out.completion_ids)):
        full = torch.tensor([prompt + completion])
        ref = torch.log_softmax(model(input_ids=full).logits[0, len(prompt) - 1 : -1] / 0.8, -1)
        ref = ref.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs[b]), ref, atol=1e-4, rtol=1e-4)


def test_all_batch_rows_lengths_and_limits():
    model = make_model(vocab=30, scale=2.0)
    heads = noisy_heads(model, std=0.2)
    prompts = [[int(x) for x in torch.randint(2, 30, (int(n),))] for n in torch.randint(1, 6, (40,))]
    ids, mask = left_padded(prompts)
    gc = GenerationConfig(do_sample=True, max_new_tokens=17, eos_token_id=[1, 5], pad_token_id=0, top_k=0)
    out = SpeculativeGenerator(model, heads, gc, capacity=200).generate(ids, mask)
    assert len(out.completion_ids) == 40
    for row in out.completion_ids:
        assert 1 <= len(row) <= 17
        assert all(0 <= t < 30 for t in row)
        assert all(t not in (1, 5) for t in row[:-1])
        assert len(row) == 17 or row[-1] in (1, 5)
    assert {"tau", "forwards", "seconds", "accept_per_head", "nodes_per_row", "active_rows"} <= set(out.stats)



# --------------------------------------------------------------------------- what a verified step emits


def hand_tree():
    """Two rows, one tree: root (node 0) -> a=5 (1) -> b=6 (2), and root -> c=7 (3)."""
    tokens = torch.tensor([[9, 5, 6, 7]] * 2)
    parent = torch.tensor([[-1, 0, 1, 0]] * 2)
    depth = torch.tensor([[0, 1, 2, 1]] * 2)
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool).expand(2, -1, -1)
    return DraftTree(tokens, depth, parent, anc, torch.zeros((2, 4, 3), dtype=torch.long))


@pytest.mark.parametrize(
    "sampled,eos,room,accepted,tokens,count,finished",
    [
        # both accepted nodes, then the sample at node 2 (4): 3 tokens
        ([[5, 6, 4, 0]], [1], [10], [[0, 1, 2]], [[5, 6, 4]], [3], [False]),
        # the sample at the root matches no child: only that sample is emitted
        ([[8, 6, 4, 0]], [1], [10], [[0, -1, -1]], [[8, 8, 8]], [1], [False]),
        # the second sibling branch: root -> c, then its sample
        ([[7, 0, 0, 3]], [1], [10], [[0, 3, -1]], [[7, 3, 3]], [2], [False]),
        # an eos among the accepted tokens cuts the step there and finishes the row
        ([[5, 6, 4, 0]], [6], [10], [[0, 1, 2]], [[5, 6, 4]], [2], [True]),
        # the row has room for 2 more tokens: cut, finished
        ([[5, 6, 4, 0]], [1], [2], [[0, 1, 2]], [[5, 6, 4]], [2], [True]),
    ],
)
def test_emit_follows_the_samples_and_cuts_at_eos_and_room(sampled, eos, room, accepted, tokens, count, finished):
    from specroll_trl.engine.verify import emit

    tree = hand_tree()
    step = emit(tree, torch.tensor(sampled * 2), torch.tensor(eos), torch.tensor(room * 2))
    assert step.accepted.tolist() == accepted * 2
    assert step.tokens[:, : count[0]].tolist() == [t[: count[0]] for t in tokens] * 2
    assert step.count.tolist() == count * 2 and step.finished.tolist() == finished * 2
    last = [a for a in accepted[0] if a >= 0][-1]
    assert step.last.tolist() == [last] * 2 and step.next_root.tolist() == [sampled[0][last]] * 2


def test_grown_tree_is_the_best_closed_tree_of_its_beam():
    """Path heads' tree: parents first, distinct siblings, ancestors and path tokens that follow the parent links,
    and the kept nodes are the best-scoring candidates of the depth-by-depth beam."""
    torch.manual_seed(2)
    batch, vocab, dim, heads_n, k = 5, 30, 8, 4, 3
    table = torch.randn(heads_n, dim, vocab)
    embed = torch.nn.Embedding(vocab, dim)

    def head_step(depth, hidden, path, path_tokens):  # a stand-in head: logits from the last path token and depth
        assert path_tokens.shape == path.shape[:3] and torch.equal(embed(path_tokens), path)
        logits = path[:, :, -1] @ table[depth - 1] + hidden @ table[depth - 1]
        return hidden + depth, logits.log_softmax(-1), lambda index: index

    root = torch.randint(vocab, (batch,))
    hidden = torch.randn(batch, dim)
    with torch.no_grad():
        grown = grow_tree(root, hidden, head_step, embed, heads_n, k, num_nodes=9)
    tree = grown.tree
    assert tree.size == 10 and int(tree.depth.max()) == heads_n
    for b in range(batch):
        for v in range(1, tree.size):
            parent = int(tree.parent[b, v])
            assert 0 <= parent < v and int(tree.depth[b, parent]) == int(tree.depth[b, v]) - 1
            chain, node = [], v
            while node > 0:
                chain.append(node)
                node = int(tree.parent[b, node])
            assert set(tree.ancestors[b, v].nonzero().squeeze(1).tolist()) == {0, *chain}
            path = [int(root[b])] + [int(tree.tokens[b, n]) for n in reversed(chain)]
            assert tree.path_tokens[b, v].tolist() == path + [int(root[b])] * (heads_n + 1 - len(path))
        siblings = {}
        for v in range(1, tree.size):
            siblings.setdefault(int(tree.parent[b, v]), []).append(int(tree.tokens[b, v]))
        assert all(len(s) == len(set(s)) for s in siblings.values())
    kept = tree.path_scores.topk(9, dim=-1).values
    assert torch.all(tree.path_scores.sort(-1, descending=True).values[:, :9] == kept)
    # the root's candidates are head 1's top-k
    first = (embed(root) @ table[0] + hidden @ table[0]).topk(k, dim=-1).indices
    assert torch.equal(grown.frontier_ids[0][:, 0], first)
    # along any root-to-node path: head d's proposal is the one made at the path's depth-d node, when it was run there
    for b in range(batch):
        for v in range(1, tree.size):
            chain, node = [], v
            while node >= 0:
                chain.append(node)
                node = int(tree.parent[b, node])
            accepted = torch.full((batch, heads_n + 1), -1)
            accepted[:, : len(chain)] = torch.tensor(chain[::-1])
            z, candidates, proposed = grown.along(accepted)
            for d in range(heads_n):
                if d >= len(chain):
                    assert not proposed[b, d]
                    continue
                node = chain[::-1][d]
                in_frontier = d == 0 or int(tree.source[b, node]) in grown.frontier_source[d][b].tolist()
                assert bool(proposed[b, d]) == in_frontier
                if in_frontier:
                    last = embed(tree.tokens[b, node]) if d else embed(root[b])
                    expect = (last @ table[d] + hidden[b] @ table[d]).topk(k).indices
                    assert candidates[b, d].tolist() == expect.tolist()
                    assert torch.allclose(z[b, d], hidden[b] + d + 1)


def test_a_tree_of_fewer_nodes_than_heads_runs_only_the_heads_it_can_reach():
    """``N`` nodes closed under parent are at most ``N`` deep, so growing stops at depth ``N``: the tree is the one
    the full-depth beam picks (deep heads that propose near-certain tokens included), and ``along`` marks the heads
    never run as not proposed."""
    torch.manual_seed(3)
    batch, vocab, dim, heads_n, k = 6, 20, 8, 4, 3
    table = torch.randn(heads_n, dim, vocab)
    embed = torch.nn.Embedding(vocab, dim)

    def recording(calls):
        def head_step(depth, hidden, path, path_tokens):
            calls.append(depth)
            return stand_in(depth, hidden, path)
        return head_step

    def stand_in(depth, hidden, path):
        logits = path[:, :, -1] @ table[depth - 1] + hidden @ table[depth - 1]
        if depth > 2:  # deep heads all but certain: their children score just below their parents
            logits = logits * 50
        return hidden + depth, logits.log_softmax(-1), lambda index: index

    root, hidden = torch.randint(vocab, (batch,)), torch.randn(batch, dim)
    for nodes in (1, 2, 3):
        cut, full = [], []
        with torch.no_grad():
            grown = grow_tree(root, hidden, recording(cut), embed, heads_n, k, nodes)
            wide = grow_tree(root, hidden, recording(full), embed, heads_n, k, 16)
        assert cut == list(range(1, nodes + 1)) and full == list(range(1, heads_n + 1))
        assert int(grown.tree.depth.max()) <= nodes
        # the same nodes as the best `nodes` of every candidate the full beam of that width would score
        with torch.no_grad():
            reference = grow_tree(root, hidden, recording([]), embed, heads_n, k, nodes + heads_n)
        ref_best = reference.tree.path_scores.topk(nodes, dim=-1).values
        assert torch.allclose(grown.tree.path_scores.topk(nodes, dim=-1).values, ref_best)
        accepted = torch.full((batch, heads_n + 1), -1)
        accepted[:, 0] = 0
        z, candidates, proposed = grown.along(accepted)
        assert z.shape[1] == candidates.shape[1] == proposed.shape[1] == heads_n
        assert proposed[:, 0].all() and not proposed[:, nodes:].any()
    assert wide.tree.size == 17


def test_hooks_adjust_path_heads_depth_by_depth_and_get_the_accepted_paths_proposals():
    """On path heads, every draft call is one depth: all its slots are that depth's head, each with its path; the
    feedback's proposals are those made at the accepted path's nodes, marked ``proposed`` only there."""
    from specroll_trl.engine.hooks import StepHook

    class Recorder(StepHook):
        def start(self, context):
            self.calls, self.steps = [], []

        def adjust(self, rows, z, slots):
            self.calls.append((slots.head.tolist(), None if slots.path is None else tuple(slots.path.shape)))
            return z

        def feedback(self, step):
            self.steps.append(step)

    model = make_model()
    heads = noisy_heads(model, num_heads=3, kind="path")
    gc = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=1, pad_token_id=0)
    recorder = Recorder()
    engine = SpeculativeGenerator(model, heads, gc, capacity=10**6, max_nodes=6, topk_per_head=2, hooks=[recorder])
    engine.generate(torch.tensor([[2, 3], [4, 5]]))
    depths = [head for head, _ in recorder.calls]
    assert all(len(set(h)) == 1 for h in depths) and {h[0] for h in depths} == {0, 1, 2}
    assert all(path[2] == head[0] + 1 for head, path in recorder.calls)
    for step in recorder.steps:
        reached = (step.accepted[:, : heads.num_heads] >= 0)
        assert not (step.proposed & ~reached).any() and step.proposed[:, 0].all()
        assert step.z.shape[:2] == step.candidates.shape[:2] == step.proposed.shape


def test_path_heads_need_no_static_path_table_and_refuse_extra_layers():
    """Path heads grow their trees depth by depth: a top-k whose independent-heads path table would be too large
    (4 heads x top-8: 4,680 paths) is fine for them; ``num_layers`` is an independent-heads option."""
    model = make_model()
    with pytest.raises(ValueError, match="lower spec top-k"):
        SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 4), topk_per_head=8)
    gc = GenerationConfig(max_new_tokens=6, eos_token_id=1, pad_token_id=0)
    engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 4, kind="path"), gc, topk_per_head=8,
                                  capacity=10**6, max_nodes=8)
    assert engine.table is None and len(engine.generate(torch.tensor([[2, 3]])).completion_ids[0]) >= 1
    with pytest.raises(ValueError, match="num_layers=2: path-conditioned heads"):
        SpeculativeHeads.from_model(model, 2, num_layers=2, kind="path")
