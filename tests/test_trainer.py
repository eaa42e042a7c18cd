"""SpecGRPOTrainer as a drop-in GRPOTrainer: short offline GRPO runs on the nano policy."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from specroll_trl import SpecGRPOConfig, SpecGRPOTrainer, SpeculativeHeads
from specroll_trl.adapt import distill_cache
from specroll_trl.engine import StepHook
from specroll_trl.experiments import zoo
from specroll_trl.experiments.rewards import REWARD_FUNCS
from specroll_trl.experiments.tasks import make_arithmetic_task

from .conftest import make_model

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


def new_trainer(args, dataset, trainer_cls=SpecGRPOTrainer, **kwargs):
    return trainer_cls(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS, args=args,
                       train_dataset=dataset, **kwargs)


def run(trainer_cls, args, dataset, **kwargs):
    trainer = new_trainer(args, dataset, trainer_cls, **kwargs)
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
            "spec/active_rows", "spec/accept_head_1", "spec/drawn_share"} <= spec_keys
    assert all(r["spec/tau"] >= 1.0 for r in rows)

    vanilla = run(GRPOTrainer, small_args(tmp_path / "v", cls=GRPOConfig), dataset)
    assert logged_keys(vanilla) == logged_keys(spec) - spec_keys
    # heads stay outside the policy: the optimizer never sees them
    head_params = {id(p) for p in spec.spec_heads.parameters()}
    assert not head_params & {id(p) for group in spec.optimizer.param_groups for p in group["params"]}
    assert not head_params & {id(p) for p in spec.model.parameters()}


@pytest.mark.slow  # self-distils heads before the first step
def test_plain_grpo_config_works_with_defaults(nano, tmp_path, dataset):
    args = small_args(tmp_path, cls=GRPOConfig, max_steps=1)
    with pytest.warns(UserWarning, match="zero-initialised heads|self-distilling"):
        trainer = SpecGRPOTrainer(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS, args=args,
                                  train_dataset=dataset)
    assert trainer.spec.spec_enabled and trainer.spec_heads is not None
    trainer.train()
    assert any("spec/tau" in r for r in trainer.state.log_history)


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
    assert 0.0 <= row["spec/reflex/reflex_gate"] <= 1.0 and row["spec/reflex/reflex_norm"] >= 0.0


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


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(spec_num_heads=0), ValueError, "spec_num_heads must be an int >= 1, got 0"),
        (dict(spec_topk_per_head=0), ValueError, "spec_topk_per_head must be >= 1"),
        (dict(spec_distill_samples=-5), ValueError, "spec_distill_samples must be an int >= 1, got -5"),
        (dict(spec_distill_steps=0), ValueError, "spec_distill_steps must be an int >= 1, got 0"),
        (dict(spec_max_nodes=-1), ValueError, "spec_max_nodes"),
        (dict(spec_capacity=0), ValueError, "spec_capacity"),
        (dict(spec_capacity=-3), ValueError, r"spec_capacity \(C_hw\) must be >= 1 or None \(online budget\), got -3"),
        (dict(spec_max_nodes=2.5), TypeError, "spec_max_nodes must be an int"),
        (dict(spec_num_heads=None), TypeError, "spec_num_heads must be an int"),
        (dict(spec_capacity=True), TypeError, "spec_capacity must be an int"),
        (dict(spec_init_heads="random"), ValueError, "spec_init_heads"),
        (dict(spec_reflex="baseline", spec_reflex_kwargs={"lam": 2.0}), ValueError, "spec_reflex_kwargs: .*lam"),
        (dict(spec_reflex="baseline", spec_reflex_kwargs={"rho_decay": 1.0}), ValueError,
         "spec_reflex_kwargs: .*rho_decay"),
        (dict(spec_reflex="baseline", spec_reflex_kwargs={"eta": -1.0}), ValueError, "spec_reflex_kwargs: .*eta"),
        (dict(spec_reflex="baseline", spec_reflex_kwargs={"support_k": 0}), ValueError,
         "spec_reflex_kwargs: .*support_k"),
        (dict(spec_reflex="baseline", spec_reflex_kwargs={"rho_min": 1.5}), ValueError,
         "spec_reflex_kwargs: .*rho_min"),
        (dict(spec_reflex="no-such-preset"), ValueError, "spec_reflex must be one of"),
        (dict(spec_consolidation=True, spec_consolidation_kwargs={"delta": -1}), ValueError,
         "spec_consolidation_kwargs: "),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None,
)
def test_invalid_spec_config_values(overrides, error, match):
    """Refused when the config is built (Reflex settings included), before any trainer or model exists."""
    with pytest.raises(error, match=match):
        SpecGRPOConfig(output_dir="x", bf16=False, **overrides)


# --------------------------------------------------------------------------- bad trainer paths and heads


@pytest.mark.parametrize("kind,match", [("missing", "does not exist"), ("file", "is a file"),
                                        ("no_config", "has no config.json"), ("empty", "has no config.json")])
def test_bad_spec_heads_path_fails_before_the_policy_is_loaded(nano, tmp_path, dataset, monkeypatch, kind, match):
    path = tmp_path / "heads"
    if kind == "file":
        path.write_text("not a folder")
    elif kind == "no_config":
        shutil.copytree(zoo.heads_dir("nano"), path)
        (path / "config.json").unlink()
    elif kind == "empty":
        path.mkdir()

    def loaded(*args, **kwargs):
        pytest.fail("GRPOTrainer.__init__ (policy loading) ran before spec_heads_path was checked")

    monkeypatch.setattr(GRPOTrainer, "__init__", loaded)
    with pytest.raises(FileNotFoundError, match=match):
        new_trainer(small_args(tmp_path, spec_heads_path=str(path)), dataset)


def test_incompatible_heads_and_topk_fail_at_trainer_init(nano, tmp_path, dataset):
    wrong = SpeculativeHeads.from_model(make_model(vocab=512, hidden=32), 2)
    with pytest.raises(ValueError, match="hidden size 32"):
        new_trainer(small_args(tmp_path), dataset, heads=wrong)
    with pytest.raises(ValueError, match=r"spec_topk_per_head \(600\) exceeds the model's vocab size \(512\)"):
        new_trainer(small_args(tmp_path, spec_topk_per_head=600), dataset)


# --------------------------------------------------------------------------- checkpoints: faults lose nothing


class CrashAfterSave(TrainerCallback):
    """Simulates a killed run: raises right after the checkpoint of step ``at`` is on disk."""

    def __init__(self, at: int):
        self.at = at

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt(f"simulated crash after checkpoint {self.at}")


class Snapshot(TrainerCallback):
    """Heads and policy weights as training (re)starts, i.e. right after the checkpoint was loaded."""

    def __init__(self, trainer):
        self.trainer, self.heads, self.policy = trainer, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.heads = {k: v.clone() for k, v in self.trainer.spec_heads.state_dict().items()}
        self.policy = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def interrupted(nano, tmp_path_factory, dataset):
    """A 3-step run with a checkpoint every step, killed right after checkpoint-2 was written; also the heads
    the run had when it was killed."""
    tmp = tmp_path_factory.mktemp("interrupted")
    args = small_args(tmp, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = new_trainer(args, dataset)
    trainer.add_callback(CrashAfterSave(2))
    with pytest.raises(KeyboardInterrupt, match="simulated crash"):
        trainer.train()
    ckpt = Path(args.output_dir) / "checkpoint-2"
    assert (ckpt / "spec_heads" / "model.safetensors").is_file() and not (ckpt.parent / "checkpoint-3").exists()
    return tmp, ckpt, {k: v.clone() for k, v in trainer.spec_heads.state_dict().items()}


def perturbed(trainer):
    with torch.no_grad():
        for p in trainer.spec_heads.parameters():
            p.add_(0.5)
    return {k: v.clone() for k, v in trainer.spec_heads.state_dict().items()}


def test_interrupted_run_resumes_with_heads_and_trainer_state_intact(interrupted, dataset):
    tmp, ckpt, heads_at_crash = interrupted
    # the checkpoint holds the heads the run had, readable through the public loader
    saved = SpeculativeHeads.from_pretrained(ckpt / "spec_heads")
    assert saved.state_dict().keys() == heads_at_crash.keys()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, heads_at_crash[name]), name
    saved_heads_state = load_file(str(ckpt / "spec_heads" / "model.safetensors"))
    saved_policy = load_file(str(ckpt / "model.safetensors"))
    saved_state = json.loads((ckpt / "trainer_state.json").read_text())
    args = small_args(tmp / "resume", max_steps=3, save_strategy="steps", save_steps=1)
    trainer = new_trainer(args, dataset)
    perturbed(trainer)  # a fresh run's heads differ from the checkpoint's
    snap = Snapshot(trainer)
    trainer.add_callback(snap)
    trainer.train(resume_from_checkpoint=str(ckpt))

    assert snap.heads.keys() == saved_heads_state.keys()
    for name, tensor in saved_heads_state.items():
        assert torch.equal(snap.heads[name], tensor), name  # bit-equal at restart
        assert torch.equal(trainer.spec_heads.state_dict()[name], tensor), name  # rollouts never change them
    for name, tensor in saved_policy.items():
        assert torch.equal(snap.policy[name], tensor), name
    # trainer state: step counter, the interrupted run's log and the finished third step
    assert trainer.state.global_step == 3
    old_rows = [r for r in saved_state["log_history"] if "loss" in r]
    new_rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["step"] for r in old_rows] == [1, 2] and [r["step"] for r in new_rows] == [1, 2, 3]
    assert new_rows[:2] == old_rows
    assert math.isfinite(new_rows[2]["loss"]) and "spec/tau" in new_rows[2]
    final = load_file(str(Path(args.output_dir) / "checkpoint-3" / "spec_heads" / "model.safetensors"))
    assert all(torch.equal(final[k], v) for k, v in saved_heads_state.items())
    trainer.save_model(str(tmp / "final"))
    assert (tmp / "final" / "spec_heads" / "model.safetensors").is_file()


def corrupt(folder: Path, how: str) -> None:
    weights = folder / "spec_heads" / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "pickle":
        weights.write_bytes(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94.")
    elif how == "no_config":
        (folder / "spec_heads" / "config.json").unlink()
    elif how == "wrong_model":
        shutil.rmtree(folder / "spec_heads")
        SpeculativeHeads.from_model(make_model(vocab=512, hidden=32), 4).save_pretrained(folder / "spec_heads")
    elif how == "other_config":  # fits the policy, but not the trainer's heads
        config = SpeculativeHeads.from_pretrained(folder / "spec_heads").config
        shutil.rmtree(folder / "spec_heads")
        other = SpeculativeHeads(dataclasses.replace(config, num_heads=config.num_heads + 1))
        other.save_pretrained(folder / "spec_heads")


@pytest.mark.parametrize("how,match", [("truncated", "not a readable safetensors file"),
                                       ("pickle", "not a readable safetensors file"),
                                       ("no_config", "has no config.json"), ("wrong_model", "hidden size 32"),
                                       ("other_config", "its heads have config .*pass spec_heads_path=")])
def test_corrupted_heads_checkpoint_is_refused_on_resume(interrupted, dataset, tmp_path, how, match):
    _, ckpt, _ = interrupted
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt, broken)
    corrupt(broken, how)
    trainer = new_trainer(small_args(tmp_path, max_steps=3), dataset)
    before = perturbed(trainer)
    with pytest.raises(ValueError, match=rf"refusing to resume from .*speculative heads \(spec_heads/\).*{match}"):
        trainer.train(resume_from_checkpoint=str(broken))
    assert trainer.state.global_step == 0  # no step was taken
    for name, tensor in trainer.spec_heads.state_dict().items():
        assert torch.equal(tensor, before[name]), "heads were (partly) loaded from a corrupted checkpoint"


def test_checkpoint_without_heads_warns_and_keeps_current_heads(interrupted, dataset, tmp_path):
    _, ckpt, _ = interrupted
    plain = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt, plain)
    shutil.rmtree(plain / "spec_heads")  # e.g. a checkpoint written by a plain GRPOTrainer
    trainer = new_trainer(small_args(tmp_path, max_steps=3), dataset)
    before = perturbed(trainer)
    with pytest.warns(UserWarning, match="has no spec_heads/ folder"):
        trainer.train(resume_from_checkpoint=str(plain))
    assert trainer.state.global_step == 3
    assert all(torch.equal(v, before[k]) for k, v in trainer.spec_heads.state_dict().items())


# --------------------------------------------------------------------------- multi-process and tools


@pytest.mark.slow
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


# --------------------------------------------------------------------------- initial distillation: data, bounds, cache


def distill_args(tmp_path, **overrides):
    return small_args(tmp_path, **{"spec_heads_path": None, "spec_distill_samples": 6, "spec_distill_steps": 5,
                                   "max_completion_length": 16, **overrides})


def test_iterable_dataset_distils_from_its_stream_and_the_second_run_reuses_the_heads(nano, tmp_path, dataset,
                                                                                        monkeypatch):
    monkeypatch.setattr(distill_cache, "default_cache_dir", lambda: tmp_path / "home" / "heads")
    stream = dataset.to_iterable_dataset()
    first = new_trainer(distill_args(tmp_path, max_steps=1), stream)
    assert first.spec_distill_report["cache"] == "miss" and first.spec_distill_report["samples"] == 6
    first.train()
    assert any("spec/tau" in r for r in first.state.log_history)
    second = new_trainer(distill_args(tmp_path / "2", max_steps=1), dataset.to_iterable_dataset())
    assert second.spec_distill_report["cache"] == "hit"
    state = second.spec_heads.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in first.spec_heads.state_dict().items())
    assert len(list((tmp_path / "home" / "heads").iterdir())) == 1
    other = new_trainer(distill_args(tmp_path / "3", max_steps=1, temperature=0.7), dataset)  # other settings
    assert other.spec_distill_report["cache"] == "miss"


def test_distillation_prompts_are_the_first_ones_the_trainer_generates_for(nano, tmp_path, dataset, monkeypatch):
    monkeypatch.setattr(distill_cache, "default_cache_dir", lambda: tmp_path / "home" / "heads")
    trainer = new_trainer(distill_args(tmp_path, spec_distill_cache=False, max_steps=1), dataset)
    assert trainer.spec_distill_report["cache"] == "off"
    seen = []
    original = trainer._generate_single_turn

    def record(prompt_ids, *args, **kwargs):
        seen.extend(list(p) for p in prompt_ids)
        return original(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(trainer, "_generate_single_turn", record)
    trainer.train()
    first = list(dict.fromkeys(map(tuple, seen)))
    distilled = [tuple(p) for p in trainer._distill_prompts()]
    assert len(first) >= 2 and distilled[: len(first)] == first
    assert not (tmp_path / "home" / "heads").exists()


def test_distillation_time_bound_is_kept_and_the_cut_short_heads_are_reused(nano, tmp_path, dataset, monkeypatch):
    monkeypatch.setattr(distill_cache, "default_cache_dir", lambda: tmp_path / "home" / "heads")
    trainer = new_trainer(distill_args(tmp_path, spec_distill_samples=32, spec_distill_steps=10_000,
                                       spec_distill_max_seconds=0.5), dataset)
    report = trainer.spec_distill_report
    assert report["truncated"] and report["steps"] < 10_000
    assert report["seconds"] < 5 and report["cache"] == "miss"
    again = new_trainer(distill_args(tmp_path / "2", spec_distill_samples=32, spec_distill_steps=10_000,
                                     spec_distill_max_seconds=0.5), dataset)
    assert again.spec_distill_report["cache"] == "hit" and again.spec_distill_report["truncated"]


def test_heads_shipped_for_this_exact_policy_are_used_instead_of_distilling(nano, tmp_path, dataset, monkeypatch):
    model, _, heads = nano
    shipped = tmp_path / "shipped" / "nano" / "independent"
    heads.save_pretrained(shipped)
    report = {"policy_sha256": distill_cache.policy_fingerprint(model)}
    (shipped / "distill_report.json").write_text(json.dumps(report))
    monkeypatch.setattr(distill_cache, "SHIPPED_HEADS_DIR", tmp_path / "shipped")
    monkeypatch.setattr(distill_cache, "default_cache_dir", lambda: tmp_path / "home" / "heads")
    trainer = new_trainer(distill_args(tmp_path, max_steps=1, spec_heads_kind="independent"), dataset)
    assert trainer.spec_distill_report is None  # nothing was distilled
    assert all(torch.equal(v, trainer.spec_heads.state_dict()[k]) for k, v in heads.state_dict().items())
    # shipped independent heads only: an "auto" run wants path heads, and distils them (Reflex on changes nothing)
    other = new_trainer(distill_args(tmp_path / "2", max_steps=1, spec_reflex="lookup"), dataset)
    assert other.spec_distill_report is not None and other.spec_heads.config.kind == "path"
    # another policy's key: the run distils its own heads of the kind it asks for
    (shipped / "distill_report.json").write_text(json.dumps({"policy_sha256": "0" * 64}))
    own = new_trainer(distill_args(tmp_path / "3", max_steps=1, spec_heads_kind="independent"), dataset)
    assert own.spec_distill_report is not None and own.spec_heads.config.kind == "independent"


def test_spec_heads_kind_is_validated_and_resolved_once(nano, tmp_path, dataset):
    model = nano[0]
    with pytest.raises(ValueError, match="spec_heads_kind must be one of"):
        small_args(tmp_path, spec_heads_kind="medusa")
    path_heads = SpeculativeHeads.from_model(model, num_heads=2, kind="path")
    with pytest.raises(ValueError, match="spec_heads_kind='independent' but the heads given are 'path'"):
        new_trainer(small_args(tmp_path, spec_heads_kind="independent"), dataset, heads=path_heads)
    # "auto" keeps the given heads' kind, and Reflex and the slow path run on path heads
    trainer = new_trainer(small_args(tmp_path, spec_reflex="lookup", spec_consolidation=True), dataset,
                          heads=path_heads)
    assert trainer.spec_heads_kind == "path" and trainer.spec_consolidation.embed is not None
    zeros = new_trainer(small_args(tmp_path, spec_heads_path=None, spec_init_heads="zeros", spec_heads_kind="path"),
                        dataset)
    assert zeros.spec_heads.config.kind == "path" and zeros.spec_heads_kind == "path"


class FlippedProposals(StepHook):
    """A user's hook: proposes the heads' least likely tokens (deterministically) and counts what it sees."""

    name = "mine"

    def __init__(self):
        self.starts, self.row_steps = 0, 0

    def start(self, context):
        self.starts += 1

    def adjust_logprobs(self, rows, logp, slots):
        return torch.log_softmax(logp.flip(-1), dim=-1)

    def feedback(self, step):
        self.row_steps += len(step.rows)

    def metrics(self):
        return {"row_steps": float(self.row_steps), "not_a_number": [1, 2]}


class RecordingTrainer(SpecGRPOTrainer):
    def _generate_single_turn(self, *args, **kwargs):
        out = super()._generate_single_turn(*args, **kwargs)
        self.rollouts = [*getattr(self, "rollouts", []), out[0]]
        return out


def test_your_step_hooks_run_every_round_log_their_metrics_and_keep_rollouts_exact(nano, tmp_path, dataset):
    hook = FlippedProposals()
    mine = run(RecordingTrainer, small_args(tmp_path, max_steps=2, spec_candidates="top-k"), dataset, step_hooks=[hook])
    plain = run(RecordingTrainer, small_args(tmp_path / "2", max_steps=2, spec_candidates="top-k"), dataset)
    assert hook.starts == len(mine.rollouts) == 2  # one generation round per step here
    # top-k candidates: one uniform per completion position decides each token, whatever the tree: same seed, same
    # rollouts
    assert mine.rollouts == plain.rollouts
    rows = [r for r in mine.state.log_history if "loss" in r]
    assert len(rows) == 2 and all(r["spec/mine/row_steps"] > 0 and r["spec/mine/seconds"] > 0 for r in rows)
    assert not any("not_a_number" in key for r in rows for key in r)
    plain_tau = [r["spec/tau"] for r in plain.state.log_history if "loss" in r]
    assert max(r["spec/tau"] for r in rows) < min(plain_tau)  # its proposals really were the ones verified


def test_step_hooks_must_be_hooks(nano, tmp_path, dataset):
    with pytest.raises(TypeError, match="step_hooks takes StepHook instances"):
        new_trainer(small_args(tmp_path), dataset, step_hooks=[lambda step: None])
