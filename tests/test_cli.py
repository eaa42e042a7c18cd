"""The `specroll-trl` command line on the nano policy (offline)."""

import json

import pytest

from specroll_trl.cli import main
from specroll_trl.engine.heads import SpeculativeHeads


def test_train_heads_cli_writes_heads_and_prints_hit_table(nano, tmp_path, capsys):
    out = tmp_path / "heads"
    assert main(["train-heads", "--model", "nano", "--out", str(out), "--num-samples", "24", "--steps", "10",
                 "--max-new-tokens", "48", "--num-heads", "3"]) == 0
    printed = capsys.readouterr().out
    assert "top-1" in printed and "top-5" in printed and printed.count("%") >= 9
    heads = SpeculativeHeads.from_pretrained(out)
    assert heads.num_heads == 3
    report = json.loads((out / "distill_report.json").read_text())
    assert len(report["hit_rates"]) == 3


def test_train_heads_on_a_chat_model_folder_distils_on_chat_prompts_over_a_draft_vocab(nano, tmp_path, monkeypatch):
    """A model folder whose tokenizer has a chat template is distilled on the prompts as its GRPO run renders them
    (the task's chat messages through the template), not on the bare question text."""
    from specroll_trl.adapt import distill

    model, tokenizer, _ = nano
    tokenizer.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    seen = {}

    def fake_distill(model, prompts, pad_token_id, config):
        seen["prompts"], seen["config"] = prompts, config
        raise RuntimeError("stop after the prompts")

    monkeypatch.setattr(distill, "distill_heads", fake_distill)
    with pytest.raises(RuntimeError, match="stop after the prompts"):
        main(["train-heads", "--model", str(folder), "--out", str(tmp_path / "heads"), "--num-samples", "3"])
    texts = [tokenizer.decode(ids) for ids in seen["prompts"]]
    assert len(texts) == 3 and all(t.startswith("<<") and t.endswith(">>") for t in texts)
    assert seen["config"].draft_vocab_size == 4096  # a real vocabulary (49k for SmolLM2) is not projected whole


@pytest.mark.slow
def test_demo_cli_on_nano_runs_grpo_and_specgrpo_side_by_side(nano, tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--model", "nano", "--eval-prompts", "16", "--steps", "2", "--repeats", "1",
                 "--prompts-per-step", "1", "--max-completion-length", "32", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "entropy" in printed and "correct" in printed and "top-1" in printed
    assert "generation s / step" in printed and "whole step s" in printed and "reward vanilla" in printed
    data = json.loads((out / "demo.json").read_text())
    summary, runs = data["summary"], data["runs"]
    assert len(runs["vanilla"]) == len(runs["spec_static"]) == len(runs["spec"]) == 1
    assert summary["spec_static"]["consolidations"] == 0 and summary["spec_static"]["reflex_overhead_share"] == 0
    assert summary["spec"]["reflex_overhead_share"] > 0
    assert summary["steps"] == 2 and len(summary["spec_reward_per_step"]) == 2
    assert summary["tau"] > 1.0 and summary["generation_speedup"] > 0 and summary["speedup"] > 0
    assert summary["per_token_generation_speedup"] > 0 and "generation ms / token" in printed
    assert runs["vanilla"][0]["tau_per_round"] == [1.0, 1.0]  # TRL's own generate, not the engine
    assert (out / "demo.png").stat().st_size > 10_000


@pytest.mark.slow
def test_bench_ablation_quick_writes_the_five_variants(nano, tmp_path):
    from specroll_trl.experiments.ablation import bench_ablation

    records = bench_ablation("nano", steps=2, max_completion_length=32, output_dir=str(tmp_path), progress=False,
                             consolidation={"min_buffer": 16, "steps": 3, "holdout_fraction": 0.0})
    by_name = {r["variant"]: r for r in records}
    assert set(by_name) == {"static", "reflex", "slow", "both", "every_round", "vanilla"}
    for r in records:
        assert {"tau", "generation_s", "total_s", "speedup_vs_static", "reflex_overhead_share"} <= set(r)
    assert by_name["every_round"]["consolidations"] == 2 and by_name["static"]["consolidations"] == 0
    assert by_name["static"]["reflex_overhead_share"] == 0 < by_name["reflex"]["reflex_overhead_share"]
    assert by_name["static"]["speedup_vs_static"] == 1.0


def test_bench_generation_quick_writes_spec_records(nano, tmp_path):
    out = tmp_path / "gen.json"
    assert main(["bench", "generation", "--model", "nano", "--batch-sizes", "1", "4", "--repeats", "1",
                 "--max-new-tokens", "24", "--temperatures", "1.0", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert {(r["batch_size"], r["mode"]) for r in records} == {
        (1, "spec"), (1, "fixed_0"), (1, "fixed_2"), (1, "fixed_4"), (1, "fixed_8"), (1, "assisted_prompt_lookup"),
        (4, "spec"), (4, "fixed_0"), (4, "fixed_2"), (4, "fixed_4"), (4, "fixed_8")}
    for r in records:
        assert {"batch_size", "mode", "vanilla_s", "spec_s", "speedup", "per_token_speedup", "tau",
                "accept_per_head", "tokens_per_s", "temperature"} <= set(r)
        assert r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["temperature"] == 1.0
    fixed = {r["mode"]: r["nodes_per_row"] for r in records if r["mode"].startswith("fixed_") and r["batch_size"] == 4}
    assert fixed["fixed_0"] == 0.0 and 0 < fixed["fixed_2"] <= 2 and fixed["fixed_4"] > fixed["fixed_2"]
    assert out.with_suffix(".png").is_file()


def test_generation_bench_without_the_online_arm_needs_another_arm():
    from specroll_trl.experiments.bench import bench_generation

    with pytest.raises(ValueError, match="nothing to compare with generate"):
        bench_generation("nano", online=False, fixed_nodes=(), rules=())


def test_generation_bench_rotates_which_arm_follows_generate(monkeypatch):
    """A fixed order put the same engine right after `generate` in every round: a slow spell spanning the two then
    flattered every other arm. Each round now starts one arm later."""
    from types import SimpleNamespace

    from specroll_trl.experiments import bench

    calls = []
    monkeypatch.setattr(bench, "_vanilla", lambda *a, **k: (calls.append("generate"), (1.0, 10))[1])

    class Engine:
        def __init__(self, name):
            self.name = name

        def generate(self, ids, mask):
            calls.append(self.name)
            stats = SimpleNamespace(seconds=0.5, tokens=10, tau=1.0, accept_per_head=[0.0], nodes_per_row=[0])
            return SimpleNamespace(stats=stats)

    engines = {name: Engine(name) for name in ("spec", "fixed_0")}
    records = bench._alternate(None, engines, [(None, None)] * 3, None)
    assert calls == ["generate", "spec", "fixed_0", "spec", "fixed_0", "generate", "fixed_0", "generate", "spec"]
    assert [r["per_token_speedups"] for r in records] == [[2.0] * 3] * 2


# --------------------------------------------------------------------------- every flag is honoured or refused

SINKS = {  # where the handlers hand their settings: replaced by recorders, so no flag can be dropped unseen
    "specroll_trl.experiments.bench": ["bench_generation", "bench_e2e", "bench_reflex", "write_results",
                                       "format_table"],
    "specroll_trl.experiments.ablation": ["bench_ablation", "format_ablation", "plot_ablation"],
    "specroll_trl.experiments.shift": ["bench_shift"],
    "specroll_trl.experiments.step_counts": ["bench_counts"],
    "specroll_trl.experiments.heads_bench": ["tau_sweep", "step_cost", "plot_heads"],
    "specroll_trl.experiments.demo": ["run_demo", "format_summary"],
    "specroll_trl.experiments.zoo": ["load_policy", "resolve_policy", "build_heads", "task_examples",
                                     "evaluate_policy", "task_prompt_ids"],
    "specroll_trl.adapt.distill": ["distill_heads", "format_hit_table", "save_distilled"],
    "specroll_trl.export": ["export_vllm"],
}


def commands():
    """``(argv prefix, sub-parser)`` of every runnable command, nested ones (``bench generation``) included."""
    import argparse

    from specroll_trl.cli import build_parser

    def walk(parser, prefix):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield prefix, parser
        for action in subs:
            for name, child in action.choices.items():
                yield from walk(child, [*prefix, name])

    return list(walk(build_parser(), []))


def other_values(action, tmp_path):
    """Candidate argv words giving ``action`` a value other than its default (the default may resolve to the same
    value as one of them, so the flag counts as honoured when any candidate changes what runs)."""
    if action.nargs == 0:
        return [[action.option_strings[0]]]
    if action.choices:
        values = [c for c in action.choices if c != action.default]
    elif action.type is int:
        values = [3, 5]
    elif action.type is float:
        values = [0.55, 0.85]
    elif action.dest in ("out", "heads", "adapter"):
        values = [tmp_path / f"flag_{action.dest}"]
    else:
        values = ["nano"] if action.dest == "model" else ["lookup"]
    many = action.nargs in ("+", "*")
    return [[action.option_strings[0], *map(str, [v, v] if many else [v])] for v in values]


@pytest.mark.parametrize("command", [" ".join(prefix) for prefix, _ in commands()])
def test_every_cli_flag_is_honoured_or_refused(command, tmp_path, monkeypatch):
    import importlib
    from unittest import mock

    calls, stub = [], mock.MagicMock()  # one stub: its repr is the same in every run
    policy = tmp_path / "policy"
    (policy / "heads").mkdir(parents=True)
    (policy / "heads" / "distill_report.json").write_text('{"hit_rates": [{"1": 0.5}]}')
    (policy / "heads" / "config.json").write_text('{"num_heads": 2}')
    returns = {"resolve_policy": policy, "build_heads": policy / "heads", "export_vllm": policy / "heads",
               "evaluate_policy": {"heldout_loss": 1.0, "entropy": 1.0, "accuracy": 0.5, "num_prompts": 4},
               "distill_heads": (stub, {"hit_rates": [{1: 0.5}]}), "load_policy": (stub, stub),
               "bench_e2e": [{"speedup": 1.0}]}
    for module, names in SINKS.items():
        for name in names:
            def record(*args, _name=name, **kwargs):
                calls.append((_name, repr(args), repr(sorted(kwargs.items()))))
                return returns.get(_name, stub)
            monkeypatch.setattr(importlib.import_module(module), name, record)

    prefix, parser = next((p, s) for p, s in commands() if " ".join(p) == command)
    required = []
    for action in parser._actions:
        if action.required and action.option_strings:
            required += [action.option_strings[0], str(tmp_path / f"required_{action.dest}")]
    (tmp_path / "required_out").mkdir()

    def run(extra):
        calls.clear()
        try:
            code = main([*prefix, *required, *extra])
        except SystemExit as exit_:
            code = exit_.code
        return code, list(calls)

    code, baseline = run([])
    assert code == 0 and baseline, f"`{command}` with its defaults did not run: {code}"
    optional = [a for a in parser._actions if a.option_strings and not a.required and a.dest != "help"]
    assert optional
    for action in optional:
        tried = [run(extra) for extra in other_values(action, tmp_path)]
        assert any(flagged != baseline or code not in (0, None) for code, flagged in tried), \
            f"`{command} {action.option_strings[0]}` was silently ignored"


def test_bench_heads_refuses_a_step_cost_without_repeats(capsys):
    from specroll_trl.experiments.heads_bench import step_cost

    assert main(["bench", "heads", "--model", "nano", "--cost-repeats", "0"]) == 2
    assert "--cost-repeats must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one repeat"):
        step_cost(None, None, "unused", repeats=0)


def test_train_heads_refuses_toy_flags_for_the_preset_recipe_and_resample_for_a_toy(tmp_path, capsys):
    assert main(["train-heads", "--model", "smollm2-135m", "--out", str(tmp_path), "--steps", "5"]) == 2
    assert "--steps do not apply to 'smollm2-135m'" in capsys.readouterr().err
    assert main(["train-heads", "--model", str(tmp_path), "--out", str(tmp_path), "--resample"]) == 2
    assert "--resample applies to a pretrained preset only" in capsys.readouterr().err
