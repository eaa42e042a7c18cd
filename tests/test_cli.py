"""The `specroll-trl` command line on the nano policy (offline)."""

import json

from specroll_trl.cli import main
from specroll_trl.heads import SpeculativeHeads


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


def test_demo_cli_on_nano(nano, capsys):
    assert main(["demo", "--model", "nano", "--eval-prompts", "16"]) == 0
    printed = capsys.readouterr().out
    assert "entropy" in printed and "correct" in printed and "top-1" in printed


def test_bench_generation_quick_writes_spec_records(nano, tmp_path):
    out = tmp_path / "gen.json"
    assert main(["bench", "generation", "--model", "nano", "--batch-sizes", "1", "4", "--repeats", "1",
                 "--max-new-tokens", "24", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert {(r["batch_size"], r["mode"]) for r in records} == {
        (1, "spec"), (1, "compaction_only"), (1, "assisted_prompt_lookup"), (4, "spec"), (4, "compaction_only")}
    for r in records:
        assert {"batch_size", "mode", "vanilla_s", "spec_s", "speedup", "tau", "accept_per_head",
                "tokens_per_s"} <= set(r)
        assert r["speedup"] > 0 and r["tokens_per_s"] > 0
    assert out.with_suffix(".png").is_file()
