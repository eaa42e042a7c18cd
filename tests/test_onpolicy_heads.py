"""The on-policy head recipe: resumable samples, path-conditioned heads that read their path, early stopping,
hit-rate intervals, and shipped heads keyed to the policy's weights."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specroll_trl.adapt.consolidation import ConsolidationCallback, consolidate_heads
from specroll_trl.adapt.distill import (
    HeadDistillConfig,
    build_stream,
    distill_on_streams,
    head_hit_rates,
    hit_rate_intervals,
    sequence_hits,
    train_heads_on_stream,
)
from specroll_trl.adapt.distill_cache import policy_fingerprint
from specroll_trl.adapt.samples import pack_samples, read_folder, read_samples, sample_to_folder
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.experiments import onpolicy_heads

from .conftest import make_model

PROMPTS = [[2, 3], [4, 5, 6], [7], [8, 9], [3, 3, 3]]


def test_samples_resume_where_they_stopped_and_reproduce(tmp_path):
    model = make_model(vocab=24, eos=1)
    first = sample_to_folder(model, PROMPTS, tmp_path / "a", 0, 1.0, 12, batch_size=2, seed=3, progress=False)
    assert [p for p, _ in first] == PROMPTS and all(0 < len(c) <= 12 for _, c in first)
    (tmp_path / "a" / "shard_00001.json").unlink()  # a run killed before its second shard
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    again = sample_to_folder(model, PROMPTS, tmp_path / "a", 0, 1.0, 12, batch_size=2, seed=3, progress=False)
    assert again == first  # the missing shard is redrawn with its own seed, the others are read back
    assert 0 < len(calls) <= 13  # only one shard was sampled again
    assert read_folder(tmp_path / "a", 3) == first
    with pytest.raises(FileNotFoundError, match="lacks shards"):
        read_folder(tmp_path / "a", 4)
    pack_samples({"train": first[:3], "heldout": first[3:]}, tmp_path / "s.safetensors")
    assert read_samples(tmp_path / "s.safetensors") == {"train": first[:3], "heldout": first[3:]}


def test_packed_samples_keep_every_id_in_half_the_bytes_when_the_vocabulary_allows(tmp_path):
    small = [([0, 5, 65_535], [7, 65_534]), ([3], [])]
    large = [([0, 65_536], [100_000, 2])]  # ids of a vocabulary over 65,536 tokens (Llama 3: 128k) stay int32
    pack_samples({"small": small, "large": large}, tmp_path / "s.safetensors")
    assert read_samples(tmp_path / "s.safetensors") == {"small": small, "large": large}
    tensors = load_file(str(tmp_path / "s.safetensors"))
    assert tensors["small.prompt_ids"].dtype == torch.uint16 and tensors["small.completion_ids"].dtype == torch.uint16
    assert tensors["large.completion_ids"].dtype == torch.int32


def pair_stream(model, vocab, n=400, seed=0):
    """Random tokens each followed by a fixed function of it: x_{t+2} is known from x_{t+1}, not from h_t."""
    rng = torch.Generator().manual_seed(seed)
    firsts = torch.randint(2, vocab // 2, (n,), generator=rng).tolist()
    seq = [t for a in firsts for t in (a, a + vocab // 2)]
    return build_stream(model, [(seq[:1], seq[1:])], temperature=1.0, topk=8)


@pytest.mark.parametrize("kind", ["independent", "path"])
def test_path_heads_read_the_tokens_on_their_path(kind):
    vocab = 24
    model = make_model(vocab=vocab, hidden=32, seed=2)
    stream = pair_stream(model, vocab)
    heads = SpeculativeHeads.from_model(model, num_heads=2, kind=kind)
    config = HeadDistillConfig(steps=400, batch_size=64, lr=1e-2, kl_weight=0.0, nll_weight=1.0)
    train_heads_on_stream(heads, model.lm_head, stream, config, progress=False, embed=model.get_input_embeddings())
    held = pair_stream(model, vocab, n=100, seed=1)
    rates, _ = head_hit_rates(heads, heads.projection(model.lm_head), held, ks=(1,), embed=model.get_input_embeddings())
    # Half the anchors come before a random token x_{t+1} whose partner x_{t+2} only a head that reads the root can
    # know; at the other half x_{t+2} is random: at most ~55% for a path head, ~10% for an independent one.
    head1 = rates[0][1]
    assert head1 > 0.45 if kind == "path" else head1 < 0.2


def test_path_heads_need_the_embedding_to_train():
    model = make_model(vocab=24)
    heads = SpeculativeHeads.from_model(model, num_heads=2, kind="path")
    with pytest.raises(ValueError, match="input embedding"):
        train_heads_on_stream(heads, model.lm_head, pair_stream(model, 24, n=20), HeadDistillConfig(steps=2),
                              progress=False)


def test_a_linear_schedule_shrinks_the_steps_to_zero():
    """Adam moves each weight by about the learning rate per step, so 4 steps at a linearly decaying rate (1, 3/4,
    2/4, 1/4 of it) end nearer the start than 4 at a constant rate, on the same batches; an unknown schedule is
    refused by name."""
    model = make_model(vocab=24, hidden=32, seed=2)
    stream = pair_stream(model, 24, n=20)

    def params(heads):
        return torch.cat([p.detach().flatten() for p in heads.parameters()])

    start = params(SpeculativeHeads.from_model(model, num_heads=2))
    moved = {}
    for schedule in ("constant", "linear"):
        heads = SpeculativeHeads.from_model(model, num_heads=2)
        train_heads_on_stream(heads, model.lm_head, stream, HeadDistillConfig(
            steps=4, batch_size=16, lr=1e-2, lr_scheduler_type=schedule), progress=False)
        moved[schedule] = float((params(heads) - start).norm())
    assert moved["linear"] < 0.8 * moved["constant"]
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        HeadDistillConfig(lr_scheduler_type="warmup_forever")


def test_early_stopping_keeps_the_best_heldout_heads_and_reports_intervals():
    vocab = 24
    model = make_model(vocab=vocab, hidden=32, seed=2)
    train, held = pair_stream(model, vocab, n=30), pair_stream(model, vocab, n=60, seed=1)
    config = HeadDistillConfig(num_heads=2, steps=400, batch_size=32, lr=5e-2, eval_every=10, patience=2,
                               kind="path")
    heads, report = distill_on_streams(model, train, held, config, progress=False)
    losses = [v for _, v in report["heldout_losses"]]
    assert report["best_heldout_loss"] == min(losses)
    assert report["steps"] < 400 and report["steps"] == report["heldout_losses"][-1][0]  # stopped early
    assert report["best_step"] == report["heldout_losses"][losses.index(min(losses))][0]
    for rates, intervals in zip(report["hit_rates"], report["hit_rate_ci"]):
        for k, (low, high) in intervals.items():
            assert low <= rates[k] <= high
    # the best heads are the ones kept: their held-out loss is the best one logged
    from specroll_trl.adapt.distill import heldout_loss

    anchors = held.anchor_ok.nonzero().squeeze(-1)
    again = heldout_loss(heads, heads.projection(model.lm_head), held, anchors, config, model.get_input_embeddings())
    assert again == pytest.approx(report["best_heldout_loss"], rel=1e-5)


def test_bootstrap_interval_widens_when_sequences_disagree():
    ks = (1,)
    agree = {"hits": torch.full((40, 1, 1), 5.0), "counts": torch.full((40, 1), 10.0)}
    disagree = {"hits": torch.tensor([10.0, 0.0] * 20).view(40, 1, 1), "counts": torch.full((40, 1), 10.0)}
    (low_a, high_a), (low_d, high_d) = hit_rate_intervals(agree, ks)[0][1], hit_rate_intervals(disagree, ks)[0][1]
    assert low_a == high_a == 0.5
    assert low_d < 0.45 and high_d > 0.55


def test_sequence_hits_split_by_sequence():
    model = make_model(vocab=24, hidden=32)
    stream = build_stream(model, [([2], [3, 4, 5, 6]), ([7, 8], [9, 10, 11])], temperature=1.0, topk=8)
    heads = SpeculativeHeads.from_model(model, num_heads=2)
    per = sequence_hits(heads, heads.projection(model.lm_head), stream, ks=(1, 5))
    assert per["counts"].tolist() == [[3.0, 2.0], [2.0, 1.0]]  # anchors whose x_{t+1+k} exists, per sequence


def test_consolidation_refuses_path_heads_by_name():
    model = make_model()
    heads = SpeculativeHeads.from_model(model, num_heads=2, kind="path")
    with pytest.raises(ValueError, match="path-conditioned"):
        ConsolidationCallback(heads, model.lm_head)
    with pytest.raises(ValueError, match="path-conditioned"):
        consolidate_heads(heads, model.lm_head, None)


def test_shipped_heads_load_only_for_the_policy_they_were_fitted_to(tmp_path, monkeypatch):
    model, other = make_model(vocab=24, seed=0), make_model(vocab=24, seed=1)
    samples = {"heldout": [([2, 3], [4, 5, 6, 1])], "train": [([3], [5, 6, 7, 8, 9, 1]), ([4, 4], [6, 7, 1])]}
    config = HeadDistillConfig(num_heads=2, steps=5, batch_size=8, target_topk=8, kind="path", eval_every=2)
    monkeypatch.setattr(onpolicy_heads, "SHIPPED_DIR", tmp_path / "shipped")
    shipped = onpolicy_heads.shipped_folder("toy", "path")
    onpolicy_heads.distill_preset_heads(model, None, shipped, tmp_path / "cache", samples=samples, config=config)
    onpolicy_heads.ship_samples(samples, "toy", policy_fingerprint(model))
    report = json.loads((shipped / "distill_report.json").read_text())
    assert report["policy_sha256"] == policy_fingerprint(model) and report["sampled_tokens"]["train"] == 9
    assert report["heldout_slice"]["sequences"] == 1
    assert onpolicy_heads.shipped_samples("toy", policy_fingerprint(model)) == samples
    assert onpolicy_heads.shipped_samples("toy", policy_fingerprint(other)) is None

    out = onpolicy_heads.install_heads("toy", model, None, tmp_path / "installed", tmp_path / "cache")
    assert (out / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    assert SpeculativeHeads.from_pretrained(out).config.kind == "path"
    assert load_file(str(out / "model.safetensors"))["heads.0.inner.weight"].dtype == torch.float16  # half the size

    distilled = []
    monkeypatch.setattr(onpolicy_heads, "distill_preset_heads", lambda *a, **k: distilled.append((a, k)) or a[2])
    onpolicy_heads.install_heads("toy", other, None, tmp_path / "other", tmp_path / "cache")
    assert distilled[0][0][0] is other and distilled[0][1]["samples"] is None  # another policy: its own samples
    onpolicy_heads.install_heads("toy", model, None, tmp_path / "ind", tmp_path / "cache", kind="independent")
    assert distilled[1][1]["samples"] == samples and distilled[1][1]["config"].kind == "independent"


def test_heads_bench_measures_tau_per_tree_size_and_the_step_cost(nano, tmp_path):
    from specroll_trl.experiments import zoo
    from specroll_trl.experiments.heads_bench import plot_heads, step_cost, tau_sweep

    model, tokenizer, _ = nano
    folder = str(zoo.heads_dir("nano"))
    taus = tau_sweep(model, tokenizer, {"nano": folder}, node_counts=(1, 8), temperatures=(1.0,), num_prompts=3,
                     max_new_tokens=24, progress=False)
    assert [(r["nodes"], r["temperature"]) for r in taus] == [(1, 1.0), (8, 1.0)]
    assert all(1.0 <= r["tau"] <= 1 + len(r["accept_per_head"]) and r["tokens"] > 0 for r in taus)
    assert len(taus[0]["accept_per_head"]) == 4 and taus[0]["accept_per_head"][1] == 0.0  # one node: depth 1 only
    costs = step_cost(model, tokenizer, folder, batch_sizes=(2,), node_counts=(0, 4), max_new_tokens=8, repeats=2,
                      progress=False, rules=("drawn", "top-k"))
    # one plain step shared by the rules, then each rule's own engine
    assert [(r["rule"], r["nodes"]) for r in costs] == [(None, 0), ("drawn", 4), ("top-k", 4)]
    assert costs[0]["relative"] == 1.0 and all(r["step_s"] > 0 for r in costs)
    assert [r["drawn_share"] for r in costs] == [None, 1.0, 0.0]  # every drafted step by its engine's rule
    # each repeat against its own plain call
    assert costs[0]["relative_by_repeat"] == [1.0, 1.0]
    assert len(costs[1]["relative_by_repeat"]) == 2 and all(r > 0 for r in costs[1]["relative_by_repeat"])
    # the weights packed once per call are reported apart, and spread over the call's steps beside
    assert all(r["pack_s"] >= 0 and r["step_with_packing_s"] >= r["step_s"] for r in costs)
    assert costs[0]["relative_with_packing"] == 1.0
    plot_heads(taus + costs, tmp_path / "heads.png")
    assert (tmp_path / "heads.png").stat().st_size > 10_000


def test_a_cached_copy_of_shipped_heads_is_installed_again_when_the_package_ships_others(tmp_path, monkeypatch):
    from specroll_trl.adapt.distill import REPORT_FILE
    from specroll_trl.experiments import zoo

    monkeypatch.setattr(onpolicy_heads, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setitem(zoo.PRETRAINED, "toy", zoo.PRETRAINED["smollm2-135m"])
    shipped, cached = onpolicy_heads.shipped_folder("toy", "path"), tmp_path / "cached"
    shipped.mkdir(parents=True)
    cached.mkdir()
    report = {"policy_sha256": "abc", "steps": 10}
    (shipped / REPORT_FILE).write_text(json.dumps(report))
    (cached / REPORT_FILE).write_text(json.dumps(report))
    assert not zoo._replaced_since("toy", cached, "path")
    (shipped / REPORT_FILE).write_text(json.dumps({**report, "steps": 20}))  # a newer package's heads
    assert zoo._replaced_since("toy", cached, "path")
    (cached / REPORT_FILE).write_text(json.dumps({"policy_sha256": "other"}))  # distilled for another policy
    assert not zoo._replaced_since("toy", cached, "path")
    assert not zoo._replaced_since("nano", cached, "path")  # a toy preset's heads are its own


def test_drawn_acceptance_metric_and_tv_loss_are_one_minus_total_variation():
    """With the target's whole distribution stored (top-K = V), ``accept`` and the TV loss term equal
    ``1 - TV(p, q) = 1 - sum |p - q| / 2`` and ``TV(p, q)`` per anchor and head."""
    from specroll_trl.adapt.records import head_fit_loss

    model = make_model(vocab=24, hidden=32, scale=3.0)
    stream = build_stream(model, [([2], [3, 4, 5, 6, 7]), ([7, 8], [9, 10, 11, 12])], temperature=1.0, topk=24)
    heads = SpeculativeHeads.from_model(model, num_heads=2)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    projection = heads.projection(model.lm_head)
    anchors = stream.anchor_ok.nonzero().squeeze(-1)
    records = stream.records(anchors, 2)
    with torch.no_grad():
        q = torch.softmax(heads.logits(records.hidden, model.lm_head).float(), -1)  # [N, H, V]
        p = torch.zeros_like(q).scatter_(-1, records.target_ids, records.target_probs.float())
        tv = 0.5 * (p - q).abs().sum(-1)  # [N, H]
        valid = records.valid.float()
        per = sequence_hits(heads, projection, stream, ks=(1,))
        torch.testing.assert_close(per["accept"].sum(0), ((1 - tv) * valid).sum(0), atol=1e-4, rtol=0)
        plain = head_fit_loss(heads, projection, records, None, 1.0, 1.0)
        with_tv = head_fit_loss(heads, projection, records, None, 1.0, 1.0, tv_weight=2.0)
    torch.testing.assert_close(with_tv - plain, 2 * (tv * valid).sum(0) / valid.sum(0), atol=1e-4, rtol=0)
    assert 0 < float(tv.mean()) < 1


def test_drawn_acceptance_is_measured_with_q_at_the_streams_temperature():
    """At a temperature other than the heads' own, the engine drafts from their logits rescaled to it
    (``logits * T_fit / T``), so ``measure_heads(..., temperature=T)`` measures ``1 - TV`` against that ``q``."""
    from specroll_trl.adapt.distill import measure_heads

    model = make_model(vocab=24, hidden=32, scale=3.0)
    stream = build_stream(model, [([2], [3, 4, 5, 6, 7]), ([7, 8], [9, 10, 11, 12])], temperature=0.5, topk=24)
    heads = SpeculativeHeads.from_model(model, num_heads=2)
    heads.config.temperature = 1.0
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    records = stream.records(stream.anchor_ok.nonzero().squeeze(-1), 2)
    with torch.no_grad():
        logits = heads.logits(records.hidden, model.lm_head).float()
        p = torch.zeros_like(logits).scatter_(-1, records.target_ids, records.target_probs.float())
        valid = records.valid.float()
        expected = {t: (((1 - 0.5 * (p - torch.softmax(logits * 1.0 / t, -1)).abs().sum(-1)) * valid).sum(0)
                        / valid.sum(0)) for t in (0.5, 1.0)}
    at_stream = measure_heads(heads, model, stream, ks=(1,), temperature=0.5)
    as_fitted = measure_heads(heads, model, stream, ks=(1,))
    torch.testing.assert_close(torch.tensor(at_stream["drawn_accept"]), expected[0.5], atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(as_fitted["drawn_accept"]), expected[1.0], atol=1e-4, rtol=0)
    assert at_stream["hit_rates"] == as_fitted["hit_rates"]
    assert abs(at_stream["drawn_accept"][0] - as_fitted["drawn_accept"][0]) > 1e-3
