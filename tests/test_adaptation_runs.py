"""The long GRPO arms of ``experiments.adaptation_runs``: one JSON line per step, resumable from checkpoints."""

import json

import pytest

from specroll_trl.experiments import zoo
from specroll_trl.experiments.adaptation_runs import block_means, read_steps, run_arm, speed_at_end


@pytest.mark.slow
def test_an_arm_logs_every_step_once_and_resumes_from_its_checkpoint(nano, tmp_path):
    kwargs = dict(model_name="nano", steps=2, num_generations=4, max_completion_length=16, save_steps=1,
                  heads_path=str(zoo.heads_dir("nano")), progress=False)
    records = run_arm("both", tmp_path, **kwargs)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["spec/tree_nodes_per_row"] == 4.0 and "kl" in r and r["step_seconds"] > 0 for r in records)
    log = tmp_path / "both_t1" / "steps.jsonl"
    lines = log.read_text().splitlines()
    again = run_arm("both", tmp_path, **{**kwargs, "steps": 3})  # resumes from checkpoint-2: one more step
    assert [r["step"] for r in again] == [1, 2, 3]
    assert log.read_text().splitlines()[:2] == lines and len(read_steps(log)) == 3
    assert block_means(again, "spec/tau", block=2) == pytest.approx(
        [sum(r["spec/tau"] for r in again[:2]) / 2, again[2]["spec/tau"]])
    assert json.loads(lines[0])["step"] == 1
    with pytest.raises(ValueError, match="unknown arm"):
        run_arm("sometimes", tmp_path, **kwargs)
    speed = speed_at_end(tmp_path / "both_t1", batch_size=2, repeats=1, max_new_tokens=8, progress=False)
    assert [r["mode"] for r in speed] == ["spec", "spec_fixed", "compaction_only"]
    assert all(r["checkpoint"] == "checkpoint-3" and r["temperature"] == 1.0 and r["per_token_speedup"] > 0
               for r in speed)
    assert speed[1]["nodes_per_row"] == 4.0 and speed[2]["nodes_per_row"] == 0.0
