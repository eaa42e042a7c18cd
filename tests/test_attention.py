"""Grouped key/value heads read in place (``engine.attention``): bitwise the same logits as transformers' own SDPA
path, no ``repeat_kv`` copy in a drafted step, and the model's attention setting restored after every call.
The exactness proofs (greedy identity, chi-square) run through it in ``test_engine`` and ``test_kernels``."""

from contextlib import nullcontext

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.integrations import sdpa_attention

from specroll_trl.engine import SpeculativeGenerator
from specroll_trl.engine.attention import grouped_attention

from .conftest import left_padded, make_model
from .test_engine import PROMPTS, noisy_heads


def tree_forward(model, grouped: bool, query: int = 5, prefix: int = 11, rows: int = 2) -> torch.Tensor:
    """Logits of a ``query``-token forward with a 4D tree mask (ancestors only, a hole in the cache) after a
    ``prefix``-token prefill, as the engine's verification runs it."""
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(2, vocab, (rows, prefix)), cache=cache, use_cache=True)
        allowed = torch.ones(rows, 1, query, prefix + query, dtype=torch.bool)
        allowed[..., prefix:] = torch.eye(query, dtype=torch.bool)
        allowed[..., prefix:, prefix] = True  # every node sees the root
        allowed[0, ..., 3] = False  # a hole in the first row's past
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        position = prefix + torch.tensor([0] + [1] * (query - 1))[None].expand(rows, -1)
        with grouped_attention(model) if grouped else nullcontext():
            out = model(input_ids=torch.randint(2, vocab, (rows, query)), position_ids=position,
                        attention_mask=mask, cache=cache, use_cache=True)
    return out.logits


def count_repeat_kv(monkeypatch) -> list:
    calls = []
    original = sdpa_attention.repeat_kv

    def counted(hidden, n_rep):
        calls.append(n_rep)
        return original(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counted)
    return calls


def test_grouped_heads_give_bitwise_the_same_logits_and_skip_the_copies(monkeypatch):
    model = make_model(vocab=64, hidden=64, layers=3)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    calls = count_repeat_kv(monkeypatch)
    copied = tree_forward(model, grouped=False)
    assert len(calls) == 2 * 3  # transformers' path copies keys and values in every layer
    calls.clear()
    grouped = tree_forward(model, grouped=True)
    assert calls == []
    assert torch.equal(grouped, copied)
    assert model.config._attn_implementation == "sdpa"


def test_a_drafted_generation_copies_no_keys_and_leaves_the_model_as_it_was(monkeypatch):
    model = make_model(vocab=64, hidden=64)
    heads = noisy_heads(model, num_heads=3, seed=1)
    ids, mask = left_padded(PROMPTS)
    gc = GenerationConfig(do_sample=True, max_new_tokens=12, temperature=1.0, top_k=0, pad_token_id=0,
                          eos_token_id=1)
    calls = count_repeat_kv(monkeypatch)
    stats = SpeculativeGenerator(model, heads, gc, max_nodes=4, capacity=10**9).generate(ids, mask).stats
    assert stats.drafted_row_steps > 0  # so its verification forwards had several query tokens
    assert calls == []
    assert model.config._attn_implementation == "sdpa"


def test_other_attention_implementations_are_left_alone():
    model = make_model(vocab=64, hidden=64, attn="eager")
    with grouped_attention(model):
        assert model.config._attn_implementation == "eager"
    assert torch.equal(tree_forward(model, grouped=True), tree_forward(model, grouped=False))


def test_a_padded_prefill_gives_bitwise_the_same_logits(monkeypatch):
    model = make_model(vocab=64, hidden=64)
    ids, mask = left_padded([[2, 3, 4, 5, 6], [7, 8]])
    calls = count_repeat_kv(monkeypatch)
    with torch.no_grad():
        copied = model(input_ids=ids, attention_mask=mask).logits
        with grouped_attention(model):
            grouped = model(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == 2 * 2  # only the first forward copied
    assert torch.equal(grouped, copied)
