"""SpecGRPOTrainer as a drop-in GRPOTrainer: short offline GRPO runs on the nano policy."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from specroll_trl import SpecGRPOConfig, SpecGRPOTrainer, SpeculativeHeads
from specroll_trl.experiments import zoo
from specroll_trl.experiments.tasks import make_arithmetic_task
from specroll_trl.experiments.rewards import REWARD_FUNCS

ROOT = Path(__file__).resolve().parents[1]


def small_args(tmp_path, cls=SpecGRPOConfig, **overrides):
    base = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=32, learning_rate=1e-4, logging_steps=1, report_to="none", bf16=False,
        save_strategy="no", seed=0, disable_tqdm=True,
    )
    if cls is SpecGRPOConfig:
        base.update(spec_heads_path=str(zoo.heads_dir("nano")), spec_capacity=256)
    base.update(overrides)
    return cls(**base)


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_task(32, seed=3)


def run(trainer_cls, args, dataset, **kwargs):
    trainer = trainer_cls(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS, args=args,
                          train_dataset=dataset, **kwargs)
    trainer.train()
    return trainer


def logged_keys(trainer):
    return {k for row in trainer.state.log_history if "loss" in row for k in row}


def test_spec_run_logs_spec_metrics_and_matches_grpo_keys(nano, tmp_path, dataset):
    spec = run(SpecGRPOTrainer, small_args(tmp_path), dataset)
    rows = [r for r in spec.state.log_history if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all("reward" in r and math.isfinite(r["reward"]) for r in rows)
    spec_keys = {k for k in logged_keys(spec) if k.startswith("spec/")}
    assert {"spec/tau", "spec/generation_seconds", "spec/tokens_per_s", "spec/tree_nodes_per_row",
            "spec/active_rows", "spec/accept_head_1"} <= spec_keys
    assert all(r["spec/tau"] >= 1.0 for r in rows)

    vanilla = run(GRPOTrainer, small_args(tmp_path / "v", cls=GRPOConfig), dataset)
    assert logged_keys(vanilla) == logged_keys(spec) - spec_keys
    # heads stay outside the policy: the optimizer never sees them
    head_params = {id(p) for p in spec.spec_heads.parameters()}
    assert not head_params & {id(p) for group in spec.optimizer.param_groups for p in group["params"]}
    assert not head_params & {id(p) for p in spec.model.parameters()}


def test_plain_grpo_config_works_with_defaults(nano, tmp_path, dataset):
    args = small_args(tmp_path, cls=GRPOConfig, max_steps=1)
    with pytest.warns(UserWarning, match="zero-initialised heads|self-distilling"):
        trainer = SpecGRPOTrainer(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS, args=args,
                                  train_dataset=dataset)
    assert trainer.spec.enabled and trainer.spec_heads is not None
    trainer.train()
    assert any("spec/tau" in r for r in trainer.state.log_history)


def test_checkpoint_and_resume_restore_heads_bit_exactly(nano, tmp_path, dataset):
    args = small_args(tmp_path, save_strategy="steps", save_steps=1)
    trainer = run(SpecGRPOTrainer, args, dataset)
    ckpt = Path(args.output_dir) / "checkpoint-2"
    saved = SpeculativeHeads.from_pretrained(ckpt / "spec_heads")
    for a, b in zip(saved.state_dict().values(), trainer.spec_heads.state_dict().values()):
        assert torch.equal(a, b)
    # a new trainer whose heads differ gets the checkpoint's heads back on resume
    args2 = small_args(tmp_path, save_strategy="steps", save_steps=1, max_steps=3)
    resumed = SpecGRPOTrainer(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS, args=args2,
                              train_dataset=dataset)
    with torch.no_grad():
        for p in resumed.spec_heads.parameters():
            p.add_(1.0)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 3
    for a, b in zip(saved.state_dict().values(), resumed.spec_heads.state_dict().values()):
        assert torch.equal(a, b)
    resumed.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "spec_heads" / "model.safetensors").is_file()


def test_peft_policy(nano, tmp_path, dataset):
    trainer = run(SpecGRPOTrainer, small_args(tmp_path), dataset,
                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2 and all("spec/tau" in r for r in rows)
    assert not any("lora" in n for n, _ in trainer.spec_heads.named_parameters())  # PEFT never wraps the heads
    head_params = {id(p) for p in trainer.spec_heads.parameters()}
    assert not head_params & {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}


def test_reflex_metrics_are_logged(nano, tmp_path, dataset):
    trainer = run(SpecGRPOTrainer, small_args(tmp_path, spec_reflex="baseline", max_steps=1), dataset)
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert 0.0 <= row["spec/reflex_gate"] <= 1.0 and row["spec/reflex_norm"] >= 0.0


def test_a_patched_generate_is_honoured(nano, tmp_path, dataset):
    """Tests that mock `model.generate` (as TRL's own do) keep testing what they mean with the subclass."""
    calls = []
    trainer = SpecGRPOTrainer(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS,
                              args=small_args(tmp_path, max_steps=1), train_dataset=dataset)
    model = trainer.model
    original = model.generate

    def mocked(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.generate = mocked
    trainer.train()
    assert calls
    assert not any(k.startswith("spec/") for k in logged_keys(trainer))


def test_multiple_iterations_steps_per_generation_and_gradient_checkpointing(nano, tmp_path, dataset):
    args = small_args(tmp_path, num_iterations=2, steps_per_generation=2, gradient_checkpointing=True,
                      max_steps=2)
    trainer = run(SpecGRPOTrainer, args, dataset)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert sum("spec/tau" in r for r in rows) >= 1  # one generation round serves several optimizer steps


def test_a_class_level_patched_generate_is_honoured(nano, tmp_path, dataset, monkeypatch):
    from transformers.generation.utils import GenerationMixin

    calls = []
    original = GenerationMixin.generate

    def mocked(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", mocked)
    trainer = run(SpecGRPOTrainer, small_args(tmp_path, max_steps=1), dataset)
    assert calls and not any(k.startswith("spec/") for k in logged_keys(trainer))


def test_spec_disabled_uses_trl_generate(nano, tmp_path, dataset):
    trainer = run(SpecGRPOTrainer, small_args(tmp_path, spec_enabled=False, max_steps=1), dataset)
    assert not any(k.startswith("spec/") for k in logged_keys(trainer))


def test_invalid_spec_config_values():
    with pytest.raises(ValueError, match="spec_max_nodes"):
        SpecGRPOConfig(output_dir="x", spec_max_nodes=-1, bf16=False)
    with pytest.raises(ValueError, match="spec_init_heads"):
        SpecGRPOConfig(output_dir="x", spec_init_heads="random", bf16=False)
    with pytest.raises(ValueError, match="spec_capacity"):
        SpecGRPOConfig(output_dir="x", spec_capacity=0, bf16=False)
    with pytest.raises(ValueError, match="lam"):
        SpecGRPOConfig(output_dir="x", spec_reflex="baseline", spec_reflex_kwargs={"lam": 2.0}, bf16=False)
    with pytest.raises(ValueError, match="unknown Reflex preset|preset"):
        SpecGRPOConfig(output_dir="x", spec_reflex="no-such-preset", bf16=False)


def test_two_process_accelerate_launch(nano, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), str(ROOT / "examples" / "grpo_gsm8k.py"),
           "--model", "nano", "--max-steps", "2", "--num-generations", "4", "--prompts-per-step", "1",
           "--max-completion-length", "24", "--output-dir", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'step': 2" in proc.stdout and "spec/tau" in proc.stdout


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def test_tool_calling_loop_goes_through_the_engine_again(nano, tmp_path, monkeypatch):
    """TRL's tool loop re-enters the generation hook with prompt + completion + tool result; the engine serves it.

    The nano policy never writes tool calls, so the first rollout's completions are replaced by one; every
    generation (first turn and after the tool result) is the engine's."""
    import shutil

    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    from specroll_trl.engine.generator import SpeculativeGenerator

    folder = tmp_path / "nano_chat"
    shutil.copytree(zoo.policy_dir("nano"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.save_pretrained(folder)
    call = tokenizer('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
                     add_special_tokens=False)["input_ids"]
    seen = []
    real_generate = SpeculativeGenerator.generate

    def generate(self, input_ids, attention_mask=None, max_new_tokens=None):
        out = real_generate(self, input_ids, attention_mask, max_new_tokens)
        seen.append([tokenizer.decode(row[mask.bool()]) for row, mask in zip(input_ids, attention_mask)])
        if len(seen) == 1:
            out.completion_ids = [list(call) for _ in out.completion_ids]
        return out

    monkeypatch.setattr(SpeculativeGenerator, "generate", generate)
    dataset = make_arithmetic_task(8, seed=4, conversational=True)
    trainer = SpecGRPOTrainer(model=str(folder), reward_funcs=REWARD_FUNCS, train_dataset=dataset, tools=[multiply],
                              args=small_args(tmp_path, max_steps=1, max_completion_length=192,
                                              max_tool_calling_iterations=1))
    trainer.train()
    assert len(seen) >= 2  # the tool loop called the speculative hook again
    assert all("12" in text for text in seen[1])  # ... with the tool's result in the new prompt
    row = next(r for r in trainer.state.log_history if "loss" in r)
    assert math.isfinite(row["loss"]) and row["spec/tau"] >= 1.0
