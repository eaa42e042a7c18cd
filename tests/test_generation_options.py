"""Generation options whose logits processors read the order or length of the sequence (``min_new_tokens``,
``no_repeat_ngram_size``, ``bad_words_ids``, ``sequence_bias``): exact in the engine (greedy identity with
``generate``, chi-square against exact enumeration), and options the engine cannot reproduce fall back to
``generate`` for that call with one warning naming them."""

import warnings

import pytest
import torch
from transformers import GenerationConfig

from specroll_trl.engine.generator import SpeculativeGenerator
from specroll_trl.engine.verify import UnsupportedOptionsError, UnsupportedProcessorsError
from specroll_trl.experiments.zoo import task_prompt_ids

from .conftest import left_padded, make_model
from .test_engine import (
    LENGTH,
    PROMPTS,
    chi_square_pvalue,
    count_forwards,
    exact_completion_distribution,
    generate_reference,
    noisy_heads,
)
from .test_llama import make_llama, noisy

# vocab 6: 0 pad, 1 eos, 2-5 words. Each option changes the distribution of 3-token completions of PROMPTS.
SEQUENCE_OPTIONS = {
    "min_new_tokens": dict(min_new_tokens=2),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[3], [2, 4]]),
    "sequence_bias": dict(sequence_bias=[[[4], -1.5], [[2, 5], 2.0], [[5, 5, 5], 3.0]]),
    "all-with-rep-topp": dict(min_new_tokens=1, no_repeat_ngram_size=2, bad_words_ids=[[2, 2]],
                              sequence_bias=[[[3, 4], 1.0]], repetition_penalty=1.3, top_p=0.9),
}


@pytest.mark.parametrize("name", [n if n.startswith("all") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(SEQUENCE_OPTIONS)])  # the fast lane: all of them at once
def test_sequence_options_sample_exactly(name):
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    gc = GenerationConfig(do_sample=True, max_new_tokens=LENGTH, eos_token_id=1, pad_token_id=0, temperature=1.0,
                          top_k=0, **SEQUENCE_OPTIONS[name])
    n = 6000
    ids, mask = left_padded([p for p in PROMPTS for _ in range(n)])
    torch.manual_seed(5)
    engine = SpeculativeGenerator(model, noisy_heads(model, std=0.4, seed=1), gc, capacity=10**9, max_nodes=7,
                                  topk_per_head=2, track_expected_acceptance=True)
    out = engine.generate(ids, mask)
    assert not out.stats.fallback
    assert out.stats["accepted"] > 0.1 * out.stats["row_forwards"]  # drafts were really accepted
    for i in range(len(PROMPTS)):
        exact = exact_completion_distribution(model, ids[i * n].tolist(), gc, mask[i * n].tolist())
        assert abs(sum(exact.values()) - 1) < 1e-9
        assert chi_square_pvalue(out.completion_ids[i * n : (i + 1) * n], exact) > 1e-3


def test_the_enumeration_sees_each_option():
    """Each option really changes the exact distribution, so the chi-square above tests it."""
    model = make_model(vocab=6, hidden=32, scale=6.0, seed=11, eos=1, pad=0)
    base = GenerationConfig(do_sample=True, max_new_tokens=LENGTH, eos_token_id=1, pad_token_id=0, top_k=0)
    ids, mask = left_padded(PROMPTS)
    for i in range(len(PROMPTS)):
        plain = exact_completion_distribution(model, ids[i].tolist(), base, mask[i].tolist())
        for name, options in SEQUENCE_OPTIONS.items():
            other = exact_completion_distribution(model, ids[i].tolist(),
                                                  GenerationConfig(**{**base.to_dict(), **options}), mask[i].tolist())
            gap = sum(abs(plain.get(k, 0) - other.get(k, 0)) for k in set(plain) | set(other))
            assert gap > 0.01, f"{name} does not change the distribution after prompt {i}"


GREEDY_OPTIONS = {
    "no_repeat_ngram_size": lambda tok: dict(no_repeat_ngram_size=2),
    "bad_words_ids": lambda tok: dict(bad_words_ids=[[tok("0")], [tok("1"), tok("2")]]),
    "sequence_bias": lambda tok: dict(sequence_bias=[[[tok("1")], -3.0], [[tok("2"), tok("3")], 4.0]]),
}


@pytest.mark.parametrize("name", sorted(GREEDY_OPTIONS))
def test_sequence_options_greedy_equal_generate_with_trained_heads(nano, name):
    model, tokenizer, heads = nano
    options = GREEDY_OPTIONS[name](tokenizer.convert_tokens_to_ids)
    prompts = task_prompt_ids(tokenizer, "arithmetic", 24, seed=901)
    gc = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=model.generation_config.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, **options)
    plain = GenerationConfig(**{k: v for k, v in gc.to_dict().items() if k not in options})
    engine = SpeculativeGenerator(model, heads, gc, capacity=256, max_nodes=8)
    changed, taus = 0, []
    for i in range(0, len(prompts), 8):
        ids, mask = left_padded(prompts[i : i + 8], tokenizer.pad_token_id)
        out = engine.generate(ids, mask)
        assert out.completion_ids == generate_reference(model, ids, mask, gc)
        changed += out.completion_ids != generate_reference(model, ids, mask, plain)
        taus.append(out.stats.tau)
    assert changed, f"{name} never changed the greedy output: the test would not see a wrong implementation"
    assert max(taus) > 1.3  # the trees were really accepted


def eos_prone_model():
    """A random Qwen2 whose eos (1) wins wherever its most frequent greedy token (9) would: rows end early and at
    different lengths, so length-reading options change the output."""
    model = make_model(vocab=40, scale=4.0, seed=3, eos=1, pad=0)
    with torch.no_grad():
        model.lm_head.weight[1] = model.lm_head.weight[9] * 1.05
    return model


@pytest.mark.parametrize("options", [dict(min_new_tokens=10), dict(min_length=14),
                                     dict(min_new_tokens=10, no_repeat_ngram_size=2, bad_words_ids=[[5, 6]],
                                          sequence_bias=[[[7], 1.5]], repetition_penalty=1.2)],
                         ids=["min_new_tokens", "min_length", "all"])
def test_length_options_greedy_equal_generate_on_ragged_rows(options):
    model = eos_prone_model()
    ids, mask = left_padded([[5, 6, 7, 8, 9], [3, 4], [10, 11, 12], [2], [7, 7, 7, 7, 7, 7, 7], [20, 21]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=1, pad_token_id=0, **options)
    plain = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, noisy_heads(model, std=0.3), gc, capacity=64, max_nodes=6).generate(ids, mask)
    assert out.completion_ids == generate_reference(model, ids, mask, gc)
    assert out.completion_ids != generate_reference(model, ids, mask, plain)


@pytest.mark.parametrize("name", ["no_repeat_ngram_size", "bad_words_ids", "sequence_bias"])
def test_sequence_options_greedy_equal_generate_on_llama(name):
    model = make_llama(vocab=64, hidden=64, layers=3, seed=2, scale=4.0)
    options = {"no_repeat_ngram_size": dict(no_repeat_ngram_size=3),
               "bad_words_ids": dict(bad_words_ids=[[17], [58, 58]]),  # tokens this model repeats
               "sequence_bias": dict(sequence_bias=[[[28], -4.0], [[39, 39], -4.0]])}[name]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (6,), generator=gen)
    prompts = [torch.randint(2, 64, (int(n),), generator=gen).tolist() for n in lengths]
    ids, mask = left_padded(prompts)
    gc = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=1, pad_token_id=0, **options)
    plain = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, noisy(model, std=0.2), gc, max_nodes=8).generate(ids, mask)
    assert out.completion_ids == generate_reference(model, ids, mask, gc)
    assert out.completion_ids != generate_reference(model, ids, mask, plain)


def test_unreproducible_option_falls_back_to_generate_with_one_warning_naming_it():
    model = make_model(vocab=32, scale=4.0, seed=3)
    gc = GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=1, pad_token_id=0, forced_eos_token_id=1)
    ids, mask = left_padded([[5, 6, 7], [3, 4]])
    engine = SpeculativeGenerator(model, noisy_heads(model, num_heads=2), gc, fallback_to_generate=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [engine.generate(ids, mask) for _ in range(2)]
    named = [w for w in caught if "forced_eos_token_id" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]
    for out in outs:
        assert out.stats.fallback and "forced_eos_token_id" in out.stats.reason
        assert out.completion_ids == generate_reference(model, ids, mask, gc)


def test_unreproducible_option_is_refused_by_name_without_fallback():
    model = make_model()
    gc = GenerationConfig(do_sample=True, max_new_tokens=4, eos_token_id=1, forced_eos_token_id=1)
    engine = SpeculativeGenerator(model, noisy_heads(model, num_heads=2), gc, capacity=8)
    calls = count_forwards(model)
    with pytest.raises(UnsupportedProcessorsError, match="forced_eos_token_id"):
        engine.generate(torch.tensor([[3, 4]]))
    assert not calls, "the model ran before the generation config was refused"


@pytest.mark.parametrize("option,value", [("num_beams", 2), ("num_return_sequences", 2), ("penalty_alpha", 0.6),
                                          ("stop_strings", ["="]), ("max_time", 5.0)])
def test_decoding_options_the_engine_does_not_implement_are_refused_by_name(option, value):
    model = make_model()
    gc = GenerationConfig(do_sample=True, max_new_tokens=4, eos_token_id=1, pad_token_id=0, **{option: value})
    with pytest.raises(UnsupportedOptionsError, match=option):
        SpeculativeGenerator(model, noisy_heads(model, num_heads=2), gc, capacity=8)


def test_beam_search_falls_back_to_generate_with_a_warning_naming_it():
    model = make_model(vocab=32, scale=4.0, seed=3)
    gc = GenerationConfig(do_sample=False, num_beams=2, max_new_tokens=6, eos_token_id=1, pad_token_id=0)
    ids, mask = left_padded([[5, 6, 7], [3, 4]])
    engine = SpeculativeGenerator(model, noisy_heads(model, num_heads=2), gc, fallback_to_generate=True)
    with pytest.warns(UserWarning, match="num_beams"):
        out = engine.generate(ids, mask)
    assert out.stats.fallback and "num_beams" in out.stats.reason
    assert out.completion_ids == generate_reference(model, ids, mask, gc)
