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
        (1, "spec"), (1, "spec_fixed"), (1, "compaction_only"), (1, "assisted_prompt_lookup"), (4, "spec"),
        (4, "spec_fixed"), (4, "compaction_only")}
    for r in records:
        assert {"batch_size", "mode", "vanilla_s", "spec_s", "speedup", "per_token_speedup", "tau",
                "accept_per_head", "tokens_per_s", "temperature"} <= set(r)
        assert r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["temperature"] == 1.0
    assert {r["capacity"] for r in records if r["mode"] == "spec_fixed"} == {64}  # the fixed formula's C_hw
    assert all(r["capacity"] is None for r in records if r["mode"] == "spec")  # the online budget
    assert out.with_suffix(".png").is_file()
