"""The lean loop's guard: what a decoding step does outside the model's forward (tensor operations, host reads,
engine Python lines) must not grow with the rows in the batch nor with the nodes of a tree of the same depth.
An operation, a ``.item()`` or a Python loop per row or per node that creeps back in fails here."""

from unittest.mock import patch

import pytest
import torch
from transformers import GenerationConfig

from specroll_trl.engine import SpeculativeGenerator
from specroll_trl.engine import generator as generator_module
from specroll_trl.engine.drawn import AcceptanceByRank, TreeShape, draw_tree, rejection_walk
from specroll_trl.experiments.step_counts import count_engine, count_generate, counting

from .conftest import make_model
from .test_engine import noisy_heads
from .test_kernels import Always

HEADS = 3


def counts(rows: int, **options):
    """Per-step counts of an engine over ``rows`` rows. Every step's commit gathers the cache's slots here, as a step
    where some row's accepted node moved does: how often none moves (and the gather is skipped) depends on the rows
    and the tree, not on the per-row or per-node work these guards look for."""
    model = make_model(vocab=64, hidden=32, seed=4)
    heads = noisy_heads(model, num_heads=HEADS, std=0.2, kind="path")
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=20, eos_token_id=None,
                          pad_token_id=0)
    engine = SpeculativeGenerator(model, heads, gc, capacity=10**9, **options)
    engine.acceptance.observe = lambda *args: None  # drawn trees keep one shape: same depth at every batch size
    torch.manual_seed(0)
    engine.kernels.choice = Always(False)  # settled: measuring the kernels is once per bucket of rows, not per step
    ids = torch.randint(2, 64, (rows, 6))
    with patch.object(generator_module, "displaced", lambda accepted: torch.ones_like(accepted, dtype=torch.bool)):
        engine.generate(ids, torch.ones_like(ids))
        return count_engine(engine, ids, torch.ones_like(ids))


@pytest.mark.parametrize("options", [dict(max_nodes=0), dict(max_nodes=4, candidates="top-k"),
                                     dict(max_nodes=4, candidates="drawn")], ids=["no-draft", "top-k", "drawn"])
def test_a_step_does_not_grow_with_rows(options):
    one, many = counts(1, **options), counts(8, **options)
    assert many.ops <= 1.05 * one.ops + 2
    # rows that finish at different steps each cost a read or two when they leave (once per row per call): a read
    # per row per step would add 7 here
    assert many.syncs <= one.syncs + 2
    assert many.lines <= 1.05 * one.lines + 5


def test_a_step_does_not_grow_with_nodes_at_the_same_depth():
    few, many = counts(4, max_nodes=HEADS, candidates="top-k"), counts(4, max_nodes=12, candidates="top-k")
    assert many.ops <= 1.05 * few.ops + 2
    assert many.syncs <= few.syncs + 1
    assert many.lines <= 1.05 * few.lines + 5


def test_a_drawn_step_works_once_per_depth_and_rank_of_its_shape():
    """The rejection chain runs one step per rank the shape has: more nodes over the same depths and ranks cost
    nothing more, and ranks the branching factor allows but the shape does not use cost nothing (the chain used to
    run every allowed rank at every depth: +~90 kernels a step here)."""
    few, many = AcceptanceByRank(HEADS, 2).shape(7), AcceptanceByRank(HEADS, 2).shape(14)
    assert [level[1] for level in few.levels] == [level[1] for level in many.levels] == [2, 2, 2]
    few, many = (counts(4, max_nodes=n, topk_per_head=2, candidates="drawn") for n in (7, 14))
    assert many.kernels <= 1.05 * few.kernels + 2
    assert many.syncs <= few.syncs + 1
    narrow, wide = (counts(4, max_nodes=HEADS, topk_per_head=k, candidates="drawn") for k in (1, 4))
    assert wide.kernels <= 1.05 * narrow.kernels + 2


def test_the_rejection_walk_works_once_per_rank_and_never_per_depth():
    """The walk's chain runs over every node with children at once (71 kernels a depth here when it ran at each
    depth), and every child's decision is taken at once too: a deeper tree costs no kernel more (115 at any depth
    here; 32 a depth when the walk looked up, depth by depth, where the rows stood)."""
    def walk_kernels(depth, batch=2, vocab=16):
        torch.manual_seed(0)
        shape = TreeShape.best_first(torch.full((depth, 1), 0.5), depth)  # a chain of `depth` nodes
        assert shape.max_depth == depth

        def propose(d, frontier, path, path_tokens):
            return torch.zeros(batch, frontier.numel(), 4), torch.randn(batch, frontier.numel(), vocab).log_softmax(-1)

        draft = draw_tree(torch.zeros(batch, dtype=torch.long), shape, propose, None, 0)
        probs = torch.randn(batch, shape.size, vocab).softmax(-1)
        uniforms = torch.rand(batch, depth + 2, 1, dtype=torch.float64)
        with counting(torch.nn.Module()) as (_, result):
            rejection_walk(draft, probs, 0, uniforms)
        return result["kernels"]

    assert walk_kernels(8) == walk_kernels(4) == walk_kernels(1)


def test_the_no_draft_loop_reads_the_host_about_once_per_step():
    model = make_model(vocab=64, hidden=32, seed=4)
    gc = GenerationConfig(do_sample=True, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    ids = torch.randint(2, 64, (4, 6))
    plain = counts(4, max_nodes=0)
    reference = count_generate(model, ids, torch.ones_like(ids), gc)
    assert reference.syncs <= 2 and reference.ops > 0
    assert plain.syncs <= reference.syncs + 1  # one read of the step's numbers


@pytest.mark.parametrize("rule", ["top-k", "drawn"])
def test_a_drafted_steps_kernels_do_not_grow_with_the_models_layers(rule):
    """Committing the accepted slots touches every layer's keys and values: one stacked gather and one multi-tensor
    copy, not two kernels per layer (what a GPU launches; four per layer before, a step's commit alone). The cache's
    occasional compaction stays per layer: well under one kernel per layer per step."""
    def kernels(layers):
        model = make_model(vocab=64, hidden=32, layers=layers, seed=4)
        heads = noisy_heads(model, num_heads=HEADS, std=0.2, kind="path")
        gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=20, eos_token_id=None,
                              pad_token_id=0)
        engine = SpeculativeGenerator(model, heads, gc, capacity=10**9, max_nodes=4, candidates=rule)
        engine.acceptance.observe = lambda *args: None
        torch.manual_seed(0)
        ids = torch.randint(2, 64, (4, 6))
        engine.generate(ids, torch.ones_like(ids))
        return count_engine(engine, ids, torch.ones_like(ids)).kernels

    assert kernels(8) - kernels(2) <= 0.5 * (8 - 2)


def test_a_drawn_step_reads_the_host_once_outside_its_planning():
    """The drawn trees' shape is planning kept on the host, like the node budget's estimates: rebuilt every
    ``refresh`` steps from one copy of the acceptance rates, its reads are counted with the budget's. The step itself
    reads the host once, as a plain step does (it read 1.6 more per step here when the shape's reads counted as
    the step's, and one more when ``draw_tree`` compared the heads' indices with the target's ids, ``torch.equal``,
    to find out that these heads draft over the whole vocabulary)."""
    def engine_counts(**options):
        model = make_model(vocab=64, hidden=32, seed=4)
        heads = noisy_heads(model, num_heads=HEADS, std=0.2, kind="path")
        gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=64, eos_token_id=None,
                              pad_token_id=0)
        engine = SpeculativeGenerator(model, heads, gc, capacity=10**9, **options)
        torch.manual_seed(0)
        ids = torch.randint(2, 64, (1, 6))
        engine.generate(ids, torch.ones_like(ids))
        return count_engine(engine, ids, torch.ones_like(ids))

    plain, drawn = engine_counts(max_nodes=0), engine_counts(max_nodes=4, candidates="drawn")
    assert drawn.steps < 40 and drawn.budget_syncs > plain.budget_syncs  # the shape was rebuilt and counted apart
    # per call: one read per step, and the few a row's end costs (as many as the plain loop's)
    extra = [c.syncs * c.steps - c.steps for c in (plain, drawn)]
    assert extra[1] <= extra[0] + 1
