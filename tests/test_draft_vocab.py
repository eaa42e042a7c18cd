"""Heads over a draft vocabulary: candidates map back to target ids, the engine stays exact, losses and hit rates
read only that vocabulary, and the heads save, load and export with it."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig

from specroll_trl.adapt.distill import HeadDistillConfig, build_stream, distill_heads, draft_vocabulary
from specroll_trl.engine.generator import SpeculativeGenerator
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.export import export_vllm

from .conftest import cut_after_eos, left_padded, make_model

VOCAB = 40


def draft_heads(model, ids, seed=0):
    heads = SpeculativeHeads.from_model(model, num_heads=3, draft_ids=ids)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return heads


def test_projection_maps_draft_indices_to_target_ids():
    model = make_model(vocab=VOCAB, hidden=32)
    ids = torch.tensor([1, 5, 7, 30, 39])
    heads = draft_heads(model, ids)
    proj = heads.projection(model.lm_head)
    h = torch.randn(4, 32)
    logits = heads.logits(h, model.lm_head)
    assert logits.shape == (4, 3, 5)
    with torch.no_grad():
        full = model.lm_head(heads(h))
    assert torch.allclose(logits, full[..., ids], atol=1e-6)
    assert proj.target_ids(torch.tensor([0, 4])).tolist() == [1, 39]
    assert proj.index_of(torch.tensor([5, 6, -1, 39])).tolist() == [1, -1, -1, 4]


def test_bad_draft_ids_are_refused(tmp_path):
    model = make_model(vocab=VOCAB, hidden=32)
    with pytest.raises(ValueError, match="distinct"):
        SpeculativeHeads.from_model(model, draft_ids=[1, 1, 2])
    with pytest.raises(ValueError, match=r"\[0, 40\)"):
        SpeculativeHeads.from_model(model, draft_ids=[1, 40])


def test_save_load_round_trip_keeps_the_draft_vocabulary(tmp_path):
    model = make_model(vocab=VOCAB, hidden=32)
    heads = draft_heads(model, torch.tensor([0, 1, 2, 9, 17]))
    heads.save_pretrained(tmp_path / "h")
    loaded = SpeculativeHeads.from_pretrained(tmp_path / "h")
    assert loaded.config.draft_vocab_size == 5 and loaded.draft_ids.tolist() == [0, 1, 2, 9, 17]
    h = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(loaded.logits(h, model.lm_head), heads.logits(h, model.lm_head))


@pytest.mark.parametrize("do_sample", [False, True])
def test_engine_with_draft_vocabulary_is_exact(do_sample):
    model = make_model(vocab=VOCAB, hidden=32, scale=4.0, seed=3, eos=1, pad=0)
    heads = draft_heads(model, torch.arange(0, VOCAB, 2))  # half the vocabulary: many targets are not proposable
    prompts = [[3, 4, 5], [7, 8], [9, 10, 11, 12]]
    ids, mask = left_padded(prompts)
    gc = GenerationConfig(do_sample=do_sample, max_new_tokens=24, eos_token_id=1, pad_token_id=0, top_k=0)
    torch.manual_seed(0)
    out = SpeculativeGenerator(model, heads, gc, capacity=64, max_nodes=8, candidates="top-k").generate(ids, mask)
    if not do_sample:
        ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
        assert out.completion_ids == cut_after_eos(ref, {1})
    torch.manual_seed(0)
    no_draft = SpeculativeGenerator(model, heads, gc, capacity=3, max_nodes=0).generate(ids, mask)
    assert out.completion_ids == no_draft.completion_ids  # top-k: same uniforms, same tokens, whatever the drafts
    assert out.stats["drafted_row_steps"] > 0


@pytest.mark.slow
def test_distillation_with_a_draft_vocabulary_reports_hits_against_the_target_mass():
    model = make_model(vocab=VOCAB, hidden=32, scale=3.0, seed=4, eos=1, pad=0)
    prompts = [[2 + i % 20, 3 + i % 17] for i in range(24)]
    config = HeadDistillConfig(num_heads=2, num_samples=24, max_new_tokens=16, steps=30, batch_size=64,
                               sample_batch_size=12, target_topk=8, draft_vocab_size=12)
    heads, report = distill_heads(model, prompts, 0, config, progress=False)
    assert heads.config.draft_vocab_size <= 12 and 1 in heads.draft_ids.tolist()  # eos always proposable
    for hits, mass in zip(report["hit_rates"], report["target_mass"]):
        assert 0 <= hits[1] <= 1 and 0 < mass[1] <= mass[3] <= mass[5] <= 1 + 1e-6


def test_draft_vocabulary_takes_the_most_frequent_tokens():
    model = make_model(vocab=VOCAB, hidden=32)
    stream = build_stream(model, [([2], [5, 5, 5, 6, 6, 7])], temperature=1.0, topk=4)
    vocab = draft_vocabulary(stream, size=3, always=[1])
    assert 1 in vocab.tolist() and 5 in vocab.tolist() and len(vocab) == 3


def test_export_writes_the_truncated_vocabulary_and_its_token_map(tmp_path):
    model = make_model(vocab=VOCAB, hidden=32)
    ids = torch.tensor([0, 3, 8, 21])
    heads = draft_heads(model, ids)
    out = export_vllm(heads, model, tmp_path / "medusa")
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["truncated_vocab_size"]) == (VOCAB, 4)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["token_map"].tolist() == ids.tolist()
    assert torch.equal(tensors["lm_heads.0.weight"], model.lm_head.weight[ids].detach())
