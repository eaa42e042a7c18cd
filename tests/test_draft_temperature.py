"""Heads draft at the run's temperature: fitted at ``T_fit`` (``SpeculativeHeadsConfig.temperature``), their logits
are rescaled by ``T_fit / T`` for a run sampling at ``T``; that changes which nodes a tree holds, never what is
emitted."""

import copy

import pytest
import torch
from torch import nn

from specroll_trl.adapt.distill import HeadDistillConfig, distill_on_streams
from specroll_trl.engine.generator import SpeculativeGenerator
from specroll_trl.engine.heads import SpeculativeHeads, SpeculativeHeadsConfig

from .test_engine import nano_sampling_inputs


def test_heads_config_refuses_a_non_positive_temperature():
    with pytest.raises(ValueError, match="temperature"):
        SpeculativeHeadsConfig(num_heads=2, hidden_size=8, vocab_size=16, temperature=0.0)


def test_projection_rescales_logits_from_the_heads_temperature_to_the_runs(tmp_path):
    lm_head = nn.Linear(8, 16, bias=False)
    heads = SpeculativeHeads(SpeculativeHeadsConfig(num_heads=2, hidden_size=8, vocab_size=16, temperature=0.7))
    heads.save_pretrained(tmp_path)
    loaded = SpeculativeHeads.from_pretrained(tmp_path)
    assert loaded.config.temperature == 0.7
    z = torch.randn(3, 8)
    plain = loaded.projection(lm_head)(z)
    torch.testing.assert_close(loaded.projection(lm_head, temperature=1.0)(z), 0.7 * plain)
    torch.testing.assert_close(loaded.projection(lm_head, temperature=0.7)(z), plain)
    unknown = SpeculativeHeads(SpeculativeHeadsConfig(num_heads=2, hidden_size=8, vocab_size=16))
    torch.testing.assert_close(unknown.projection(lm_head, temperature=1.0)(z), unknown.projection(lm_head)(z))


def test_the_heads_temperature_changes_the_trees_not_the_samples(nano):
    model, _, heads = nano
    _, ids, mask, gc = nano_sampling_inputs(nano, 8, seed=911, temperature=1.0, max_new_tokens=48)
    outputs = []
    for fitted_at in (None, 0.3, 3.0):
        labelled = copy.deepcopy(heads)
        labelled.config.temperature = fitted_at
        torch.manual_seed(5)
        outputs.append(SpeculativeGenerator(model, labelled, gc, capacity=10**6, max_nodes=8,
                                            candidates="top-k").generate(ids, mask))
    assert outputs[1].completion_ids == outputs[0].completion_ids == outputs[2].completion_ids
    assert len({round(out.stats["tau"], 6) for out in outputs}) > 1  # the trees did differ


def test_distillation_records_the_temperature_its_targets_were_at(nano):
    from specroll_trl.adapt.distill import build_stream

    model, tokenizer, _ = nano
    prompts, _, _, _ = nano_sampling_inputs(nano, 4, seed=912)
    pairs = [(p, p[-3:] * 3) for p in prompts]
    stream = build_stream(model, pairs, temperature=0.5, topk=8)
    config = HeadDistillConfig(kind="path", temperature=0.5, steps=2, batch_size=16, target_topk=8)
    heads, _ = distill_on_streams(model, stream, stream, config, progress=False)
    assert heads.config.temperature == 0.5
