"""Slow path: the drift monitor, the captured buffer, head-only consolidation, and its trainer callback."""

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GenerationConfig

from specroll_trl import (
    ConsolidationCallback,
    DriftMonitor,
    SpecGRPOTrainer,
    SpeculativeGenerator,
    SpeculativeHeads,
)
from specroll_trl.adapt.buffer import BufferCapture, HeadBuffer
from specroll_trl.adapt.consolidation import ConsolidationConfig, consolidate_heads, refresh_draft_vocab
from specroll_trl.adapt.records import HeadRecords
from specroll_trl.experiments import zoo
from specroll_trl.experiments.shift import perturbed_policy

from .conftest import left_padded, make_model
from .test_engine import nano_sampling_inputs, noisy_heads
from .test_trainer import dataset, run, small_args  # noqa: F401  (dataset is a fixture)

# --------------------------------------------------------------------------- monitor


def feed(monitor, series):
    return [monitor.update([a, a]) for a in series]


def test_monitor_fires_on_a_sustained_drop_and_not_on_isolated_dips():
    monitor = DriftMonitor(2, delta=0.05, patience=2, cooldown=4, window=3)
    steady_with_dips = [0.6, 0.6, 0.6, 0.5, 0.6, 0.6, 0.6, 0.5, 0.6, 0.6, 0.5, 0.6, 0.6]  # tau 2.2, dips to 2.0
    assert not any(feed(monitor, steady_with_dips))
    fired = feed(monitor, [0.5] * 10)  # tau 2.0: 9% down
    # the block mean crosses 5% at the second low window; two drifted windows in a row fire; the cooldown keeps it
    # quiet for 4 windows, then (no re-fit happened in between) the still-drifted heads fire again
    assert [i for i, f in enumerate(fired) if f] == [2, 7]
    assert monitor.drop() == pytest.approx(1 - 2.0 / 2.2)
    monitor.reset_reference()
    assert not any(feed(monitor, [0.5] * 6))  # the new level is the new reference


def replayed_rounds(seed: int, rounds: int, tau_drop: float, at: int = 10, drafted: int = 300):
    """Per-round acceptance per depth as ``BufferCapture`` reports it: SmolLM2's measured full-tree acceptance
    (``benchmarks/shift_smollm2.json``, base policy: 51 / 20 / 6 / 1%), each round a binomial draw over ``drafted``
    row-steps, scaled down from round ``at`` on so that tau falls by ``tau_drop`` (relative)."""
    gen = torch.Generator().manual_seed(seed)
    rates = torch.tensor([0.51, 0.20, 0.06, 0.01])
    low = rates * (1 - tau_drop * (1 + rates.sum()) / rates.sum())
    return [(torch.binomial(torch.full((4,), float(drafted)), rates if i < at else low, generator=gen)
             / drafted).tolist() for i in range(rounds)]


def first_fire(config: ConsolidationConfig, rounds) -> int | None:
    monitor = DriftMonitor(4, config.delta, config.delta_r, config.patience, config.cooldown, config.window)
    return next((i for i, accept in enumerate(rounds) if monitor.update(accept)), None)


def test_default_trigger_fires_on_a_real_tau_drop_and_stays_quiet_on_noise():
    config = ConsolidationConfig()
    steady = [first_fire(config, replayed_rounds(seed, 40, 0.0)) for seed in range(10)]
    assert steady == [None] * 10
    eight = [first_fire(config, replayed_rounds(seed, 40, 0.08)) for seed in range(10)]
    assert all(f is not None and 10 <= f <= 16 for f in eight), eight
    five = [first_fire(config, replayed_rounds(seed, 40, 0.05)) for seed in range(10)]
    assert sum(f is not None and 10 <= f <= 22 for f in five) >= 9, five
    assert first_fire(config, replayed_rounds(0, 40, 0.5, drafted=50)) <= 13  # a collapse is caught at any noise


def test_monitor_fires_on_regret_and_skips_empty_windows():
    monitor = DriftMonitor(1, delta_r=0.1, patience=2, cooldown=0, window=1)
    assert not monitor.update(None, [0.2])
    assert not monitor.update([math.nan], None)  # a round that drafted nothing is no evidence
    assert not monitor.update(None, [0.35])
    assert monitor.update(None, [0.35])


def test_monitor_state_round_trips_and_rejects_bad_values():
    monitor = DriftMonitor(2, patience=2)
    feed(monitor, [0.7, 0.5, 0.5])
    clone = DriftMonitor(2, patience=2)
    clone.load_state_dict(json.loads(json.dumps(monitor.state_dict())))
    assert clone.state_dict() == monitor.state_dict()
    assert clone.update([0.5, 0.5]) == monitor.update([0.5, 0.5])
    with pytest.raises(ValueError, match="heads"):
        clone.load_state_dict({"regrets": [[0.1]]})
    for bad in (dict(num_heads=0), dict(num_heads=1, delta=0), dict(num_heads=1, patience=0),
                dict(num_heads=1, window=0)):
        with pytest.raises(ValueError):
            DriftMonitor(**bad)
    with pytest.raises(ValueError, match="trigger"):
        ConsolidationConfig(trigger="sometimes")
    with pytest.raises(ValueError, match="lr"):
        ConsolidationConfig(lr=0)


# --------------------------------------------------------------------------- buffer capture


def captured(model, heads, ids, mask, gc, capacity=4096, topk=8, seed=0):
    buffer = HeadBuffer(capacity, heads.num_heads, model.config.hidden_size, topk)
    engine = SpeculativeGenerator(model, heads, gc, capacity=10**6, max_nodes=8, hooks=[BufferCapture(buffer)])
    torch.manual_seed(seed)
    out = engine.generate(ids, mask)
    return buffer, out


def test_capture_pairs_each_head_with_the_token_it_should_have_predicted():
    model = make_model(vocab=48, scale=4.0, seed=2)
    heads = noisy_heads(model, num_heads=3, std=0.3)
    ids, mask = left_padded([[5, 6, 7], [9, 3], [4, 4, 4, 8], [11]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=1, pad_token_id=0)
    buffer, out = captured(model, heads, ids, mask, gc)
    rows = [list(r) for r in out.completion_ids]
    steps = out.stats["forwards"] - 1
    assert 0 < len(buffer) <= steps * len(rows)
    data = buffer.take(torch.arange(len(buffer)))
    hidden, tok_ids, probs, tokens, valid = data.hidden, data.target_ids, data.target_probs, data.tokens, data.valid
    root = model.lm_head(hidden).argmax(-1)  # greedy: h_t's own next token is the step's root
    full = valid.all(1)
    assert full.sum() > 10
    assert torch.equal(data.path[:, 0], root)  # the path starts at the root, then follows the realised tokens
    assert torch.equal(data.path[:, 1:][full], tokens[:, :-1][full])
    for r, toks in zip(root[full].tolist(), tokens[full].tolist()):
        window = [r, *toks]
        assert any(row[i : i + len(window)] == window for row in rows for i in range(len(row))), window
    # greedy targets are one-hot on the realised token
    assert torch.equal(tok_ids[..., 0][valid], tokens[valid])
    assert torch.allclose(probs[..., 0][valid], torch.ones(int(valid.sum())))
    # tokens past a row's end are marked invalid, never invented
    assert not valid.all()


def test_buffer_is_a_bounded_ring_keeping_the_newest():
    buffer = HeadBuffer(5, 2, 3, 2)
    for start in (0, 4):
        n = 4
        hidden = torch.arange(start, start + n).float()[:, None].expand(-1, 3)
        buffer.add(records(hidden, torch.zeros((n, 2, 2), dtype=torch.long), torch.ones((n, 2, 2)),
                           torch.zeros((n, 2), dtype=torch.long), torch.ones((n, 2), dtype=torch.bool)))
    assert len(buffer) == 5 and buffer.added == 8
    assert sorted(buffer.data.hidden[:, 0].tolist()) == [3, 4, 5, 6, 7]


def test_capture_measures_candidate_regret_per_head(nano):
    model, _, heads = nano
    _, ids, mask, gc = nano_sampling_inputs(nano, 24, seed=5, temperature=1.0, max_new_tokens=48)
    _, out = captured(model, heads, ids, mask, gc)
    regret = out.stats["candidate_regret"]
    assert len(regret) == heads.num_heads and all(0 <= r <= 1 for r in regret)
    untrained = SpeculativeHeads.from_model(model, heads.num_heads)  # predicts x_{t+1}, not x_{t+1+k}
    _, out = captured(model, untrained, ids, mask, gc)
    assert out.stats["candidate_regret"][0] > regret[0] + 0.2


# --------------------------------------------------------------------------- consolidation


def records(hidden, ids, probs, tokens, valid, path=None):
    """``HeadRecords`` (path tokens: the realised tokens shifted right, root 0, unless given)."""
    if path is None:
        path = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], 1)
    return HeadRecords(hidden=hidden, path=path, target_ids=ids, target_probs=probs, tokens=tokens, valid=valid)


def filled_buffer(model, seed=0, n=600, heads=2, topk=4):
    """Tuples whose targets a teacher set of heads produced from the hidden states: learnable structure."""
    gen = torch.Generator().manual_seed(seed)
    teacher = noisy_heads(model, num_heads=heads, std=0.3, seed=seed + 100)
    buffer = HeadBuffer(1024, heads, model.config.hidden_size, topk)
    hidden = torch.randn((n, model.config.hidden_size), generator=gen)
    with torch.no_grad():
        top = torch.softmax(model.lm_head(teacher(hidden)), -1).topk(topk, dim=-1)
    buffer.add(records(hidden, top.indices, top.values, top.indices[..., 0], torch.ones((n, heads), dtype=torch.bool)))
    return buffer


def test_consolidation_changes_only_the_heads():
    model = make_model(vocab=32, hidden=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    policy_before = copy.deepcopy(model.state_dict())
    opt_before = copy.deepcopy(opt.state_dict())
    heads = noisy_heads(model, num_heads=2, std=0.1)
    heads_before = copy.deepcopy(heads.state_dict())
    report = consolidate_heads(heads, model.lm_head, filled_buffer(model), ConsolidationConfig(steps=30, lr=1e-2,
                                                                                          min_buffer=1))
    assert report.ok and report.steps == 30 and report.heldout_after < report.heldout_before
    assert any(not torch.equal(heads_before[k], v) for k, v in heads.state_dict().items())
    assert all(torch.equal(policy_before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    after = opt.state_dict()
    for pid, state in opt_before["state"].items():
        assert all(torch.equal(state[k], after["state"][pid][k]) for k in state)


def test_the_proximal_term_bounds_the_parameter_step():
    model = make_model(vocab=32, hidden=32)
    steps = {}
    for mu in (0.0, 1.0, 100.0):
        heads = noisy_heads(model, num_heads=2, std=0.1)
        report = consolidate_heads(heads, model.lm_head, filled_buffer(model),
                                   ConsolidationConfig(steps=100, mu=mu, lr=3e-3, min_buffer=1, holdout_fraction=0))
        assert report.ok
        steps[mu] = report.param_step
    assert steps[100.0] < steps[1.0] < 0.1 * steps[0.0]


def test_nan_or_an_exception_restores_the_heads(monkeypatch):
    model = make_model(vocab=32, hidden=32)
    heads = noisy_heads(model, num_heads=2, std=0.1)
    before = copy.deepcopy(heads.state_dict())
    buffer = filled_buffer(model)
    buffer.data.hidden[: len(buffer)] = float("nan")
    report = consolidate_heads(heads, model.lm_head, buffer, ConsolidationConfig(steps=5, min_buffer=1))
    assert not report.ok and "nan" in report.reason.lower()
    assert all(torch.equal(before[k], v) for k, v in heads.state_dict().items())

    buffer = filled_buffer(model)
    calls = {"n": 0}
    real_sample = buffer.sample

    def failing_sample(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("injected out of memory")
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(buffer, "sample", failing_sample)
    report = consolidate_heads(heads, model.lm_head, buffer, ConsolidationConfig(steps=5, min_buffer=1))
    assert not report.ok and report.steps == 2 and "out of memory" in report.reason
    assert all(torch.equal(before[k], v) for k, v in heads.state_dict().items())
    assert not consolidate_heads(heads, model.lm_head, HeadBuffer(8, 2, 32, 4)).ok  # empty buffer: skipped


def test_vocab_refresh_swaps_unused_draft_tokens_for_frequent_missing_ones():
    model = make_model(vocab=32, hidden=32)
    heads = SpeculativeHeads.from_model(model, num_heads=2, draft_ids=list(range(10)))
    tokens = torch.tensor([*range(8)] * 3 + [20] * 5 + [21] * 3 + [25])  # 8, 9 unused; 25 seen once
    assert refresh_draft_vocab(heads, model.lm_head, tokens, max_share=0.5) == 2
    assert sorted(heads.draft_ids.tolist()) == [*range(8), 20, 21]
    assert refresh_draft_vocab(heads, model.lm_head, tokens, max_share=0.5) == 0  # nothing left worth swapping
    assert refresh_draft_vocab(heads, model.lm_head, torch.tensor([30] * 9), max_share=0.1) == 1  # the cap: 1 of 10
    assert 30 in heads.draft_ids.tolist() and len(set(heads.draft_ids.tolist())) == 10
    assert refresh_draft_vocab(SpeculativeHeads.from_model(model, 2), model.lm_head, tokens, 0.5) == 0  # no draft vocab


def test_consolidation_brings_tokens_the_policy_now_emits_into_the_draft_vocabulary():
    model = make_model(vocab=32, hidden=32)
    buffer = filled_buffer(model)
    n = len(buffer)
    buffer.data.tokens[:n, 0] = torch.tensor([20, 21, 22, 23, 24, 25, 26, 27, 0, 1])[torch.arange(n) % 10]
    ids = list(range(10))  # 2..9 never realised; 20..27 realised but not proposable
    heads = SpeculativeHeads.from_model(model, num_heads=2, draft_ids=ids)
    report = consolidate_heads(heads, model.lm_head, buffer, ConsolidationConfig(steps=30, lr=1e-2, min_buffer=1,
                                                                                 vocab_refresh=0.5))
    assert report.ok and report.vocab_swapped == 5  # the cap: half of 10 ids
    kept = set(heads.draft_ids.tolist())
    assert {0, 1} <= kept and len(kept & set(range(20, 28))) == 5 and len(kept) == 10
    fixed = SpeculativeHeads.from_model(model, num_heads=2, draft_ids=ids)
    report = consolidate_heads(fixed, model.lm_head, buffer, ConsolidationConfig(steps=5, min_buffer=1,
                                                                                 vocab_refresh=0.0))
    assert report.vocab_swapped == 0 and fixed.draft_ids.tolist() == ids
    kept = heads.draft_ids.clone()
    buffer.data.hidden[: len(buffer)] = float("nan")  # a failed re-fit puts the old vocabulary back too
    report = consolidate_heads(heads, model.lm_head, buffer, ConsolidationConfig(steps=5, min_buffer=1,
                                                                                 vocab_refresh=1.0))
    assert not report.ok and torch.equal(heads.draft_ids, kept)


def test_peft_heads_checkpoint_keeps_a_refreshed_draft_vocabulary(tmp_path):
    from specroll_trl.engine.heads import apply_adapter_state, read_adapter_state, save_heads

    model = make_model(vocab=32, hidden=32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["linear"])
    heads = get_peft_model(SpeculativeHeads.from_model(model, num_heads=2, draft_ids=list(range(10))), config)
    assert refresh_draft_vocab(heads, model.lm_head, torch.tensor([20] * 5), max_share=0.5) == 1
    save_heads(heads, tmp_path / "ckpt")
    fresh = get_peft_model(SpeculativeHeads.from_model(model, num_heads=2, draft_ids=list(range(10))), config)
    apply_adapter_state(fresh, read_adapter_state(tmp_path / "ckpt"),
                        SpeculativeHeads.from_pretrained(tmp_path / "ckpt").draft_ids)
    assert torch.equal(fresh.draft_ids, heads.draft_ids) and 20 in fresh.draft_ids.tolist()
    with pytest.raises(ValueError, match="draft vocabulary"):
        apply_adapter_state(fresh, read_adapter_state(tmp_path / "ckpt"), torch.arange(5))


def random_target_buffer(seed=0, n=600, vocab=32, hidden=32, heads=2, topk=4):
    """Tuples whose targets have nothing to do with their hidden states: only memorisable."""
    gen = torch.Generator().manual_seed(seed)
    buffer = HeadBuffer(1024, heads, hidden, topk)
    probs = torch.softmax(torch.randn((n, heads, topk), generator=gen), -1)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:topk] for _ in range(n * heads)]).view(n, heads, topk)
    buffer.add(records(torch.randn((n, hidden), generator=gen), ids, probs, ids[..., 0],
                       torch.ones((n, heads), dtype=bool)))
    return buffer


def test_a_refit_that_only_memorises_is_undone():
    model = make_model(vocab=32, hidden=32)
    heads = noisy_heads(model, num_heads=2, std=0.1)
    good = consolidate_heads(heads, model.lm_head, filled_buffer(model),
                             ConsolidationConfig(steps=30, lr=1e-2, min_buffer=1))
    assert good.ok and good.heldout_after < good.heldout_before
    before = copy.deepcopy(heads.state_dict())
    memorised = consolidate_heads(heads, model.lm_head, random_target_buffer(),
                                  ConsolidationConfig(steps=200, lr=3e-2, mu=0, min_buffer=1, holdout_fraction=0.2))
    assert memorised.loss_after < memorised.loss_before - 0.2  # it did fit its training part...
    assert not memorised.ok and memorised.rejected and memorised.heldout_after > memorised.heldout_before
    assert "held-out loss did not improve" in memorised.reason
    assert all(torch.equal(before[k], v) for k, v in heads.state_dict().items())  # ...and was undone


def test_peft_heads_update_only_their_adapters():
    model = make_model(vocab=32, hidden=32)
    base = noisy_heads(model, num_heads=2, std=0.1)
    heads = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["linear"], init_lora_weights=True))
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    report = consolidate_heads(heads, model.lm_head, filled_buffer(model),
                               ConsolidationConfig(steps=10, min_buffer=1, holdout_fraction=0))
    assert report.ok
    changed = {k for k, v in heads.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all("lora_" in k for k in changed)


@pytest.mark.slow
def test_consolidation_raises_acceptance_on_a_drifted_target(nano):
    model, _, heads = nano
    target = perturbed_policy(model, scale=1.0, seed=0)
    heads = copy.deepcopy(heads)
    _, ids, mask, gc = nano_sampling_inputs(nano, 64, seed=11, temperature=1.0, max_new_tokens=64)
    _, held_ids, held_mask, _ = nano_sampling_inputs(nano, 64, seed=12, temperature=1.0, max_new_tokens=64)

    def acceptance():
        engine = SpeculativeGenerator(target, heads, gc, capacity=10**6, max_nodes=8)
        return [engine.generate(held_ids, held_mask).stats["accept_per_head"] for _ in range(2)]

    torch.manual_seed(0)
    before = acceptance()
    buffer, _ = captured(target, heads, ids, mask, gc, capacity=8192, seed=1)
    assert len(buffer) > 500
    report = consolidate_heads(heads, target.lm_head, buffer, ConsolidationConfig(steps=150, lr=3e-3, mu=0.01))
    assert report.ok and report.loss_after < report.loss_before
    torch.manual_seed(0)
    after = acceptance()
    mean = lambda runs, d: sum(r[d] for r in runs) / len(runs)  # noqa: E731
    assert mean(after, 0) > mean(before, 0) + 0.04, (before, after)
    assert sum(mean(after, d) for d in range(4)) > sum(mean(before, d) for d in range(4))


# --------------------------------------------------------------------------- trainer callback


def test_trainer_consolidates_logs_and_resumes_monitor_state(nano, tmp_path, dataset):  # noqa: F811
    args = small_args(tmp_path, spec_consolidation=True,
                      spec_consolidation_kwargs=dict(trigger="every_round", min_buffer=16, steps=5,
                                                     holdout_fraction=0.0), save_strategy="steps",
                      save_steps=1, max_steps=2)
    initial = copy.deepcopy(zoo.load_heads("nano", progress=False).state_dict())
    trainer = run(SpecGRPOTrainer, args, dataset)
    callback = trainer.spec_consolidation
    assert isinstance(callback, ConsolidationCallback) and callback in trainer.callback_handler.callbacks
    assert callback.count == 2 and callback.failures == 0
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["spec/consolidations"] for r in rows] == [1.0, 2.0]
    assert all(r["spec/consolidation_seconds"] > 0 and "spec/drift" in r and "spec/buffer_size" in r for r in rows)
    assert any(not torch.equal(initial[k], v.cpu()) for k, v in trainer.spec_heads.state_dict().items())

    ckpt = Path(args.output_dir) / "checkpoint-2" / "spec_heads"
    state = json.loads((ckpt / "consolidation_state.json").read_text())
    assert state["count"] == 2 and state["monitor"]["windows"] == 2
    resumed = SpecGRPOTrainer(model=str(zoo.policy_dir("nano")), reward_funcs=trainer.reward_funcs, args=args,
                              train_dataset=dataset)
    resumed._load_from_checkpoint(str(ckpt.parent))
    assert resumed.spec_consolidation.count == 2
    assert resumed.spec_consolidation.monitor.state_dict() == trainer.spec_consolidation.monitor.state_dict()
    for k, v in trainer.spec_heads.state_dict().items():
        assert torch.equal(resumed.spec_heads.state_dict()[k].cpu(), v.cpu())


def test_trainer_with_peft_heads_saves_merged_heads_and_adapter(nano, tmp_path, dataset):  # noqa: F811
    base = zoo.load_heads("nano", progress=False)
    heads = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["linear"]))
    args = small_args(tmp_path, spec_consolidation=True,
                      spec_consolidation_kwargs=dict(trigger="every_round", min_buffer=16, steps=5,
                                                     holdout_fraction=0.0), max_steps=1)
    trainer = run(SpecGRPOTrainer, args, dataset, heads=heads)
    assert trainer.spec_consolidation.count == 1
    trainer.save_model(str(tmp_path / "final"))
    folder = tmp_path / "final" / "spec_heads"
    merged = type(base).from_pretrained(folder)  # a plain heads folder, usable without PEFT
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()
    h = torch.randn(5, base.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(merged(h), trainer.spec_heads(h), atol=1e-5)


def test_every_consolidation_field_is_reachable_from_the_trainer_config(tmp_path):
    from specroll_trl import SpecGRPOConfig
    from specroll_trl.trainer import consolidation_config

    chosen = dict(trigger="every_round", delta=0.1, delta_r=0.2, patience=2, cooldown=1, window=3,
                  buffer_size=1000, buffer_topk=4, min_buffer=10, steps=3, max_seconds=5.0, batch_size=32, lr=1e-3,
                  lambda_nll=0.1, mu=0.5, vocab_refresh=0.3, holdout_fraction=0.2, learn_min_new=100,
                  learn_min_gain=0.05)
    assert set(chosen) | {"seed"} == {f.name for f in dataclasses.fields(ConsolidationConfig)}
    args = SpecGRPOConfig(output_dir=str(tmp_path), bf16=False, seed=7, spec_consolidation=True,
                          spec_consolidation_kwargs=chosen)
    assert consolidation_config(args, seed=7) == ConsolidationConfig(**chosen, seed=7)
    with pytest.raises(TypeError, match="unknown_field"):
        SpecGRPOConfig(output_dir=str(tmp_path), bf16=False, spec_consolidation=True,
                       spec_consolidation_kwargs={"unknown_field": 1})
    with pytest.raises(ValueError, match="lr must be > 0"):
        SpecGRPOConfig(output_dir=str(tmp_path), bf16=False, spec_consolidation=True,
                       spec_consolidation_kwargs='{"lr": 0}')  # a JSON string, as from the command line


# --------------------------------------------------------------------------- path heads and learning re-fits


def captured_path_buffer(model, heads, n_rounds=6, topk=8):
    """Records the capture hook takes from greedy rounds of a teacher set of path heads' policy."""
    buffer = HeadBuffer(4096, heads.num_heads, model.config.hidden_size, topk)
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=24, eos_token_id=1, pad_token_id=0)
    for r in range(n_rounds):
        ids, mask = left_padded([[5 + r, 6, 7], [9, 3 + r], [4, 4, 8 + r], [11 + r]])
        engine = SpeculativeGenerator(model, heads, gc, capacity=10**6, max_nodes=4, hooks=[BufferCapture(buffer)],
                                      candidates="top-k")
        torch.manual_seed(r)
        engine.generate(ids, mask)
    return buffer


def test_path_heads_refit_on_captured_records_reading_their_path():
    model = make_model(vocab=48, scale=4.0, seed=2)
    heads = noisy_heads(model, num_heads=3, std=0.05, kind="path")
    buffer = captured_path_buffer(model, heads)
    assert buffer.rounds == 6 and len(buffer) > 300
    with pytest.raises(ValueError, match="input embedding"):
        consolidate_heads(heads, model.lm_head, buffer, ConsolidationConfig(min_buffer=1))
    before = copy.deepcopy(heads.state_dict())
    report = consolidate_heads(heads, model.lm_head, buffer, ConsolidationConfig(min_buffer=1, steps=100, lr=1e-3,
                                                                                 mu=0.0),
                               embed=model.get_input_embeddings())
    assert report.ok and report.heldout_after < report.heldout_before and report.gain > 0
    assert any(not torch.equal(before[k], v) for k, v in heads.state_dict().items())
    # the policy's embedding (trainable in GRPO) is read, never given a gradient: the policy's update stays TRL's
    assert all(p.grad is None for p in model.parameters())
    # the loss reads the path: the same records with other path tokens score differently
    from specroll_trl.adapt.records import head_fit_loss

    records = buffer.take(torch.arange(len(buffer)))
    path = records.path.clone()
    path[:, 1:] = path[torch.randperm(len(records)), 1:]  # other tokens below the root
    shuffled = dataclasses.replace(records, path=path)
    projection = heads.projection(model.lm_head)
    with torch.no_grad():
        own = head_fit_loss(heads, projection, records, model.get_input_embeddings())
        other = head_fit_loss(heads, projection, shuffled, model.get_input_embeddings())
    assert own[0] == pytest.approx(float(other[0]), rel=1e-5)  # head 1 reads only the root, kept
    assert (own[1:] < other[1:]).all()


def test_heldout_split_keeps_whole_newest_rounds():
    from specroll_trl.adapt.consolidation import heldout_split

    buffer = HeadBuffer(100, 2, 3, 2)
    for n in (40, 30, 20):  # three rounds
        buffer.add(records(torch.zeros((n, 3)), torch.zeros((n, 2, 2), dtype=torch.long), torch.ones((n, 2, 2)),
                           torch.zeros((n, 2), dtype=torch.long), torch.ones((n, 2), dtype=torch.bool)))
    held, train = heldout_split(buffer, 0.1)
    assert sorted(held.tolist()) == list(range(70, 90)) and len(train) == 70  # the newest round, whole
    two = HeadBuffer(100, 2, 3, 2)
    for n in (60, 10, 10):
        two.add(records(torch.zeros((n, 3)), torch.zeros((n, 2, 2), dtype=torch.long), torch.ones((n, 2, 2)),
                        torch.zeros((n, 2), dtype=torch.long), torch.ones((n, 2), dtype=torch.bool)))
    held, _ = heldout_split(two, 0.15)
    assert sorted(held.tolist()) == list(range(60, 80))  # 12 records reach into the second-newest round: both whole
    single = HeadBuffer(100, 2, 3, 2)
    single.add(records(torch.zeros((50, 3)), torch.zeros((50, 2, 2), dtype=torch.long), torch.ones((50, 2, 2)),
                       torch.zeros((50, 2), dtype=torch.long), torch.ones((50, 2), dtype=torch.bool)))
    held, _ = heldout_split(single, 0.1)
    assert sorted(held.tolist()) == list(range(45, 50))  # one round: the newest records


def test_learning_refits_fire_on_new_records_without_drafting_and_stop_when_they_stop_paying():
    model = make_model(vocab=48, scale=4.0, seed=2)
    heads = noisy_heads(model, num_heads=3, std=0.05, kind="path")
    callback = ConsolidationCallback(heads, model.lm_head, ConsolidationConfig(
        min_buffer=50, learn_min_new=50, learn_min_gain=0.01, steps=30, lr=1e-2, mu=0.0),
        embed=model.get_input_embeddings())
    for r in range(3):  # the rounds drafted nothing (no drift signal at all), yet records arrive
        ids, mask = left_padded([[5 + r, 6, 7], [9, 3 + r], [4, 4, 8 + r], [11 + r]])
        gc = GenerationConfig(do_sample=True, max_new_tokens=24, eos_token_id=1, pad_token_id=0)
        SpeculativeGenerator(model, heads, gc, capacity=1, max_nodes=0, hooks=[callback.capture]).generate(ids, mask)
    assert all(accept is None for accept, _ in callback.capture.rounds)
    assert callback.learning_due()
    callback.on_step_end(None, None, None)
    assert callback.learning == 1 and callback.last_gain is not None
    assert not callback.learning_due()  # no new records since
    callback.last_gain = 0.001  # a re-fit that no longer pays: new records alone do not fire again
    callback.added_at_refit = -10**6
    assert not callback.learning_due()
    callback.last_gain = 0.5
    assert callback.learning_due()
    off = ConsolidationCallback(heads, model.lm_head, ConsolidationConfig(min_buffer=1, learn_min_gain=None),
                                embed=model.get_input_embeddings())
    off.buffer = callback.buffer
    assert not off.learning_due()
    with pytest.raises(ValueError, match="learn_min_gain"):
        ConsolidationConfig(learn_min_gain=1.5)


def test_trainer_adapts_path_heads_with_reflex_and_the_slow_path_through_peft(nano, tmp_path, dataset):  # noqa: F811
    """The whole method on the default head kind: Reflex adjusts path heads depth by depth, the slow path re-fits
    them (their LoRA adapters only) on captured records that carry the path, and the run logs both."""
    model = nano[0]
    base = SpeculativeHeads.from_model(model, num_heads=3, kind="path")
    heads = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["inner", "outer"]))
    frozen = {k: v.clone() for k, v in heads.state_dict().items() if "lora" not in k}
    args = small_args(tmp_path, spec_heads_path=None, spec_reflex="lookup", spec_consolidation=True,
                      spec_consolidation_kwargs=dict(trigger="every_round", min_buffer=16, steps=5,
                                                     holdout_fraction=0.0), max_steps=2)
    trainer = run(SpecGRPOTrainer, args, dataset, heads=heads)
    assert trainer.spec_heads_kind == "path" and trainer.spec_consolidation.count == 2
    assert trainer.spec_consolidation.buffer.data.path.abs().sum() > 0  # records carry their path tokens
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert all("spec/reflex/seconds" in r and r["spec/consolidation_seconds"] > 0 for r in rows)
    assert all(torch.equal(frozen[k], v) for k, v in heads.state_dict().items() if k in frozen)  # adapters only
