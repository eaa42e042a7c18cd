"""The distilled-heads cache: its key changes with anything that changes the heads, and only with that."""

import dataclasses

import torch

from specroll_trl.adapt.distill import HeadDistillConfig, sample_sequences
from specroll_trl.adapt.distill_cache import cache_key, cached_distill_heads, policy_fingerprint

from .conftest import make_model

PROMPTS = [[2, 3, 4], [5, 6], [7, 8, 9, 10], [3, 3]]
CONFIG = HeadDistillConfig(num_heads=2, num_samples=4, max_new_tokens=6, steps=3, batch_size=16, target_topk=8)


def test_cache_key_follows_weights_prompts_and_settings():
    model = make_model()
    key = cache_key(model, PROMPTS, 0, CONFIG)
    assert key == cache_key(make_model(), PROMPTS, 0, CONFIG)  # same weights, another object
    assert key != cache_key(model, PROMPTS, 0, dataclasses.replace(CONFIG, max_seconds=5.0))
    assert key != cache_key(model, PROMPTS[:3], 0, CONFIG)
    assert key != cache_key(model, PROMPTS, 0, dataclasses.replace(CONFIG, temperature=0.7))
    assert key != cache_key(model, PROMPTS, 1, CONFIG)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1e-3
    assert key != cache_key(model, PROMPTS, 0, CONFIG)
    assert policy_fingerprint(model.to(torch.bfloat16)) != policy_fingerprint(make_model())


def test_cache_hit_returns_the_same_heads_and_an_unreadable_entry_is_rebuilt(tmp_path):
    model = make_model()
    heads, report = cached_distill_heads(model, PROMPTS, 0, CONFIG, tmp_path, progress=False)
    assert report["cache"] == "miss"
    again, hit = cached_distill_heads(make_model(), PROMPTS, 0, CONFIG, tmp_path, progress=False)
    assert hit["cache"] == "hit"
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in heads.state_dict().items())
    folder = next(tmp_path.iterdir())
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    _, rebuilt = cached_distill_heads(make_model(), PROMPTS, 0, CONFIG, tmp_path, progress=False)
    assert rebuilt["cache"] == "miss"
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left behind
    _, off = cached_distill_heads(make_model(), PROMPTS, 0, CONFIG, None, progress=False)
    assert off["cache"] == "off"


def test_sampling_time_bound_stops_between_batches():
    model = make_model()
    model.generation_config.eos_token_id = 1
    config = dataclasses.replace(CONFIG, sample_batch_size=1, sampling_max_seconds=1e-9)
    assert len(sample_sequences(model, PROMPTS, config, 0, progress=False)) == 1  # the first batch always runs
    unbounded = dataclasses.replace(config, sampling_max_seconds=None)
    assert len(sample_sequences(model, PROMPTS, unbounded, 0, progress=False)) == len(PROMPTS)


def test_distilling_or_loading_from_the_cache_leaves_the_callers_random_stream_alone(tmp_path):
    """A trainer that distils its heads must draw the same rollouts afterwards as one that found them cached."""
    draws = {}
    for run in ("miss", "hit"):
        model = make_model()
        torch.manual_seed(1234)
        _, report = cached_distill_heads(model, PROMPTS, 0, CONFIG, tmp_path, progress=False)
        assert report["cache"] == run
        draws[run] = torch.rand(5)
    torch.manual_seed(1234)
    assert torch.equal(draws["miss"], torch.rand(5)) and torch.equal(draws["hit"], draws["miss"])
