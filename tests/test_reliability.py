"""Reliability and security (issue #8): bad inputs fail early with clear errors, faults lose nothing, memory under
load stays near vanilla generate's, exactness holds under random stress, and nothing ever unpickles or evaluates.

Complements tests/test_engine.py, tests/test_heads_zoo.py, tests/test_trainer.py and tests/test_data_rewards.py,
which already cover the cases listed in docs_reliability.md as "existing"."""

import builtins
import json
import math
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, TrainerCallback

from specroll_trl import SpecGRPOConfig, SpecGRPOTrainer, SpeculativeHeads
from specroll_trl.experiments import zoo
from specroll_trl.experiments.tasks import make_arithmetic_task
from specroll_trl.engine.compat import check_model_supported
from specroll_trl.engine.generator import SpeculativeConfig, SpeculativeGenerator
from specroll_trl.experiments.rewards import REWARD_FUNCS

from .conftest import cut_after_eos, left_padded, make_model
from .test_engine import noisy_heads
from .test_trainer import small_args

ROOT = Path(__file__).resolve().parents[1]


def count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def small_engine(model=None, **options):
    model = model or make_model()
    gc = GenerationConfig(max_new_tokens=5, eos_token_id=1, pad_token_id=0)
    return SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2), gc, **{"capacity": 8, **options})


# =========================================================================== bad input: engine


@pytest.mark.parametrize(
    "options,error,match",
    [
        (dict(max_nodes=2.5), TypeError, "max_nodes must be an int"),
        (dict(topk_per_head=True), TypeError, "topk_per_head must be an int"),
        (dict(capacity=64.0), TypeError, "capacity must be an int"),
        (dict(compact_ratio=0.0), ValueError, "compact_ratio"),
        (dict(compact_ratio=1.5), ValueError, "compact_ratio"),
    ],
)
def test_invalid_engine_config_values(options, error, match):
    with pytest.raises(error, match=match):
        SpeculativeConfig(**options)


def test_topk_per_head_larger_than_vocab_is_refused_at_construction():
    model = make_model(vocab=32)
    with pytest.raises(ValueError, match=r"topk_per_head \(33\) exceeds the model's vocab size \(32\)"):
        small_engine(model, topk_per_head=33)
    small_engine(model, topk_per_head=32)  # the whole vocabulary is allowed


@pytest.mark.parametrize(
    "ids,mask,max_new,error,match",
    [
        ([[3, 40]], None, 5, ValueError, r"outside the model's vocabulary \[0, 32\): \[40\]"),
        ([[-3, 4]], None, 5, ValueError, r"outside the model's vocabulary \[0, 32\): \[-3\]"),
        ([[3.0, 4.0]], None, 5, TypeError, "integer token ids"),
        ([[0, 3], [0, 0]], [[0, 1], [0, 0]], 5, ValueError, "at least one token"),
        ([[3, 4]], [[1, 1, 1]], 5, ValueError, "attention_mask shape"),
        ([[3, 4]], None, 0, ValueError, "max_new_tokens must be >= 1"),
        ([[3] * 520], None, 1, ValueError, "context of 512 positions"),
        ([[]], None, 5, ValueError, "non-empty"),
    ],
)
def test_bad_prompts_are_refused_before_any_forward(ids, mask, max_new, error, match):
    model = make_model(vocab=32)
    engine = small_engine(model)
    calls = count_forwards(model)
    ids = torch.tensor(ids) if ids != [[]] else torch.zeros((1, 0), dtype=torch.long)
    mask = torch.tensor(mask) if mask is not None else None
    with pytest.raises(error, match=match):
        engine.generate(ids, mask, max_new_tokens=max_new)
    assert not calls, "the model ran before the input was refused"


def test_padding_ids_outside_the_vocab_are_not_an_error():
    """Only attended positions are checked: a pad id is never embedded for a real token."""
    model = make_model(vocab=32)
    out = small_engine(model).generate(torch.tensor([[3, 4], [0, 5]]), torch.tensor([[1, 1], [0, 1]]))
    assert len(out.completion_ids) == 2


def test_capacity_below_the_batch_size_means_no_drafting_and_stays_exact():
    """SPEC 2.2: N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max); C_hw < B_t is valid and just disables drafting."""
    model = make_model(vocab=40, scale=4.0, seed=3)
    heads = noisy_heads(model, std=0.3)
    prompts = [[5, 6, 7], [3, 4], [10, 11, 12, 13], [2]]
    ids, mask = left_padded(prompts)
    gc = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, heads, gc, capacity=1, max_nodes=8).generate(ids, mask)
    assert out.stats["nodes_per_row"] and set(out.stats["nodes_per_row"]) == {0}
    ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
    assert out.completion_ids == cut_after_eos(ref, {1})


@pytest.mark.parametrize("value,step,row", [(float("nan"), 2, 1), (float("inf"), 1, 0), (-float("inf"), 3, 2)])
def test_non_finite_logits_mid_generation_name_step_and_row(value, step, row):
    model = make_model(vocab=32)
    model.generation_config.eos_token_id = None  # no row finishes, so batch rows keep their indices
    gc = GenerationConfig(do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2), gc, capacity=1)
    calls = []

    def poison(_module, _args, output):
        calls.append(1)
        if len(calls) == step + 1:  # call 1 is the prefill (step 0)
            output.logits[row, -1, 5] = value
        return output

    model.register_forward_hook(poison)
    with pytest.raises(FloatingPointError, match=rf"NaN or inf at decoding step {step} for batch rows \[{row}\]"):
        engine.generate(torch.tensor([[3, 4], [5, 6], [7, 8]]))
    assert len(calls) == step + 1  # stopped at once


@pytest.mark.parametrize(
    "attn_or_flag,match",
    [
        ("flex_attention", "flex_attention"),
        ("flash_attention_3", "flash_attention_3"),
        ("encoder_decoder", "encoder-decoder"),
        ("mamba", "mamba"),
        ("sliding_window", "sliding-window"),
    ],
)
def test_unsupported_attention_and_cache_kinds_fail_at_construction(attn_or_flag, match):
    model = make_model()
    if attn_or_flag == "encoder_decoder":
        model.config.is_encoder_decoder = True
    elif attn_or_flag == "mamba":
        model.config.layer_types = ["mamba", "full_attention"]
    elif attn_or_flag == "sliding_window":
        model.config.use_sliding_window, model.config.sliding_window = True, 16
    else:
        model.config._attn_implementation = attn_or_flag
    with pytest.raises(ValueError, match=match):
        check_model_supported(model)
    with pytest.raises(ValueError, match=match):
        small_engine(model)


# =========================================================================== bad input: heads folders


def saved_heads(tmp_path, model=None) -> Path:
    model = model or make_model(vocab=16)
    folder = tmp_path / "heads"
    SpeculativeHeads.from_model(model, 2).save_pretrained(folder)
    return folder


def test_heads_path_that_is_a_file(tmp_path):
    folder = saved_heads(tmp_path)
    with pytest.raises(FileNotFoundError, match="is a file, not a heads folder"):
        SpeculativeHeads.from_pretrained(folder / "model.safetensors")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_heads_folder_missing_a_file(tmp_path, name):
    folder = saved_heads(tmp_path)
    (folder / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"has no {name}"):
        SpeculativeHeads.from_pretrained(folder)


@pytest.mark.parametrize(
    "config_text,match",
    [
        ("{not json", "not a valid heads config"),
        (json.dumps({"num_heads": 2, "hidden_size": 0, "vocab_size": 16}), "hidden_size must be a positive int"),
        (json.dumps({"num_heads": "2", "hidden_size": 32, "vocab_size": 16}), "num_heads must be a positive int"),
        (json.dumps([1, 2]), "not a valid heads config"),
    ],
)
def test_heads_folder_with_a_bad_config(tmp_path, config_text, match):
    folder = saved_heads(tmp_path)
    (folder / "config.json").write_text(config_text)
    with pytest.raises(ValueError, match=match):
        SpeculativeHeads.from_pretrained(folder)


def test_heads_with_non_finite_weights_or_wrong_shapes(tmp_path):
    folder = saved_heads(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    name = sorted(state)[0]
    poisoned = dict(state)
    poisoned[name] = state[name].clone()
    poisoned[name].view(-1)[0] = float("nan")
    save_file(poisoned, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="contains NaN or inf"):
        SpeculativeHeads.from_pretrained(folder)
    reshaped = dict(state)
    reshaped[name] = torch.zeros(3, 3)
    save_file(reshaped, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        SpeculativeHeads.from_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # empty file
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        SpeculativeHeads.from_pretrained(folder)


# =========================================================================== bad input: SpecGRPOConfig


@pytest.mark.parametrize(
    "field,value,error,match",
    [
        ("spec_num_heads", 0, ValueError, "spec_num_heads must be >= 1"),
        ("spec_topk_per_head", 0, ValueError, "spec_topk_per_head must be >= 1"),
        ("spec_distill_samples", -5, ValueError, "spec_distill_samples must be >= 1"),
        ("spec_distill_steps", 0, ValueError, "spec_distill_steps must be >= 1"),
        ("spec_capacity", -3, ValueError, "spec_capacity must be >= 1"),
        ("spec_max_nodes", 2.5, TypeError, "spec_max_nodes must be an int"),
        ("spec_num_heads", None, TypeError, "spec_num_heads must be an int"),
        ("spec_capacity", True, TypeError, "spec_capacity must be an int"),
    ],
)
def test_invalid_spec_config_fields(field, value, error, match):
    with pytest.raises(error, match=match):
        SpecGRPOConfig(output_dir="x", bf16=False, **{field: value})


@pytest.mark.parametrize(
    "field,value,match",
    [("rho_decay", 1.0, "rho_decay"), ("eta", -1.0, "eta"), ("support_k", 0, "support_k"),
     ("rho_min", 1.5, "rho_min")],
)
def test_invalid_reflex_fields_fail_at_config_time(field, value, match):
    with pytest.raises(ValueError, match=match):
        SpecGRPOConfig(output_dir="x", bf16=False, spec_reflex="baseline", spec_reflex_kwargs={field: value})


# =========================================================================== bad input: trainer paths and heads


@pytest.fixture(scope="module")
def dataset():
    return make_arithmetic_task(32, seed=3)


def new_trainer(args, dataset, **kwargs):
    return SpecGRPOTrainer(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS, args=args,
                           train_dataset=dataset, **kwargs)


@pytest.mark.parametrize("kind,match", [("missing", "does not exist"), ("file", "is a file"),
                                        ("no_config", "has no config.json"), ("empty", "has no config.json")])
def test_bad_spec_heads_path_fails_before_the_policy_is_loaded(nano, tmp_path, dataset, monkeypatch, kind, match):
    from trl import GRPOTrainer

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


# =========================================================================== faults lose nothing


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
    """A 3-step run with a checkpoint every step, killed right after checkpoint-2 was written."""
    tmp = tmp_path_factory.mktemp("interrupted")
    args = small_args(tmp, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = new_trainer(args, dataset)
    trainer.add_callback(CrashAfterSave(2))
    with pytest.raises(KeyboardInterrupt, match="simulated crash"):
        trainer.train()
    ckpt = Path(args.output_dir) / "checkpoint-2"
    assert (ckpt / "spec_heads" / "model.safetensors").is_file() and not (ckpt.parent / "checkpoint-3").exists()
    return tmp, ckpt


def perturbed(trainer):
    with torch.no_grad():
        for p in trainer.spec_heads.parameters():
            p.add_(0.5)
    return {k: v.clone() for k, v in trainer.spec_heads.state_dict().items()}


def test_interrupted_run_resumes_with_heads_and_trainer_state_intact(interrupted, dataset):
    tmp, ckpt = interrupted
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


@pytest.mark.parametrize("how,match", [("truncated", "not a readable safetensors file"),
                                       ("pickle", "not a readable safetensors file"),
                                       ("no_config", "has no config.json"), ("wrong_model", "hidden size 32")])
def test_corrupted_heads_checkpoint_is_refused_on_resume(interrupted, dataset, tmp_path, how, match):
    _, ckpt = interrupted
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
    _, ckpt = interrupted
    plain = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt, plain)
    shutil.rmtree(plain / "spec_heads")  # e.g. a checkpoint written by a plain GRPOTrainer
    trainer = new_trainer(small_args(tmp_path, max_steps=3), dataset)
    before = perturbed(trainer)
    with pytest.warns(UserWarning, match="has no spec_heads/ folder"):
        trainer.train(resume_from_checkpoint=str(plain))
    assert trainer.state.global_step == 3
    assert all(torch.equal(v, before[k]) for k, v in trainer.spec_heads.state_dict().items())


# =========================================================================== load


def test_load_script_quick_spec_memory_stays_near_vanilla(nano, tmp_path):
    out = tmp_path / "load.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "load_test.py"), "--quick", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec, vanilla = json.loads(out.read_text())
    assert (spec["method"], vanilla["method"]) == ("spec", "vanilla")
    assert spec["tokens"] == vanilla["tokens"] == spec["batch"] * spec["new_tokens"]  # eos ignored: full length
    assert spec["tau"] > 1.0
    # the engine's own working memory (peak minus the loaded process) against generate's, and the totals
    spec_gen = spec["peak_rss_mb"] - spec["rss_after_load_mb"]
    vanilla_gen = vanilla["peak_rss_mb"] - vanilla["rss_after_load_mb"]
    assert spec_gen <= 1.5 * vanilla_gen + 32, (spec, vanilla)
    assert spec["peak_rss_mb"] <= 1.5 * vanilla["peak_rss_mb"] + 64, (spec, vanilla)


# =========================================================================== stress exactness (hypothesis)


@cache
def stress_model(vocab: int, seed: int):
    return make_model(vocab=vocab, hidden=32, seed=seed, scale=3.0, eos=1, pad=0)


@st.composite
def stress_case(draw):
    vocab = draw(st.sampled_from([8, 16, 48]))
    batch = draw(st.integers(1, 6))
    sampling = {}
    if draw(st.booleans()):
        sampling = dict(do_sample=True, temperature=draw(st.sampled_from([0.6, 1.0, 1.4])),
                        top_k=draw(st.sampled_from([0, 2, 5])), top_p=draw(st.sampled_from([1.0, 0.9, 0.7])))
        if draw(st.booleans()):
            sampling["min_p"] = draw(st.sampled_from([0.05, 0.2]))
    else:
        sampling = dict(do_sample=False)
    if draw(st.booleans()):
        sampling["repetition_penalty"] = draw(st.sampled_from([1.2, 1.6]))
    return dict(
        vocab=vocab, seed=draw(st.integers(0, 2)),
        prompts=[draw(st.lists(st.integers(2, vocab - 1), min_size=1, max_size=7)) for _ in range(batch)],
        max_new=draw(st.integers(1, 14)),
        eos=draw(st.lists(st.integers(1, vocab - 1), max_size=3, unique=True)),
        sampling=sampling,
        num_heads=draw(st.integers(1, 4)), head_std=draw(st.sampled_from([0.0, 0.3, 1.5])),
        capacity=draw(st.sampled_from([1, 6, 32, 10**6])), max_nodes=draw(st.integers(0, 10)),
        topk=draw(st.integers(1, 4)), run_seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=70, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stress_case())
def test_stress_every_completion_is_well_formed_exact_and_reproducible(case):
    model = stress_model(case["vocab"], case["seed"])
    eos = case["eos"]
    model.generation_config.eos_token_id = eos or None  # generate merges the model's own eos into the config
    heads = noisy_heads(model, num_heads=case["num_heads"], std=case["head_std"], seed=case["seed"])
    gc = GenerationConfig(max_new_tokens=case["max_new"], eos_token_id=eos or None, pad_token_id=0,
                          **case["sampling"])
    ids, mask = left_padded(case["prompts"])
    engine = SpeculativeGenerator(model, heads, gc, capacity=case["capacity"], max_nodes=case["max_nodes"],
                                  topk_per_head=case["topk"])
    torch.manual_seed(case["run_seed"])
    out = engine.generate(ids, mask)
    rows = out.completion_ids
    assert len(rows) == len(case["prompts"])
    for row in rows:
        assert 1 <= len(row) <= case["max_new"]
        assert all(isinstance(t, int) and 0 <= t < case["vocab"] for t in row)
        assert not any(t in eos for t in row[:-1]), "a completion runs past its first eos"
        assert len(row) == case["max_new"] or row[-1] in eos, "a completion stopped early without eos"
    torch.manual_seed(case["run_seed"])
    assert engine.generate(ids, mask).completion_ids == rows, "same seed, different completions"
    if not case["sampling"]["do_sample"]:
        ref = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, ids.shape[1]:].tolist()
        assert rows == cut_after_eos(ref, set(eos))


# =========================================================================== security

PACKAGE = ROOT / "specroll_trl"
BANNED = [
    (re.compile(r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|cloudpickle|marshal|shelve|joblib)\b", re.M),
     "pickle-family module"),
    (re.compile(r"(?<![\w.])(eval|exec)\s*\("), "eval/exec"),
    (re.compile(r"\bbuiltins\.(eval|exec)\b"), "eval/exec"),
    (re.compile(r"(?<![\w.])(__import__|compile)\s*\("), "dynamic import/compile"),
    (re.compile(r"\btorch\.save\s*\("), "torch.save (pickle)"),
    (re.compile(r"\bpickle\.(loads?|dumps?)\b"), "pickle"),
    (re.compile(r"\byaml\.load\s*\((?![^)]*SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "trust_remote_code=True"),
]


def call_text(source: str, start: int) -> str:
    """The text of a call from its opening parenthesis to the matching closing one."""
    depth = 0
    for i in range(source.index("(", start), len(source)):
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        if depth == 0:
            return source[start : i + 1]
    return source[start:]


def security_findings(source: str) -> list[str]:
    found = [f"{what}: {m.group(0).strip()!r}" for pattern, what in BANNED for m in pattern.finditer(source)]
    for m in re.finditer(r"\btorch\.load\s*\(", source):
        call = call_text(source, m.start())
        if not re.search(r"weights_only\s*=\s*True", call):
            found.append(f"torch.load without weights_only=True: {call!r}")
    return found


def test_security_scanner_flags_what_it_should():
    bad = ["import pickle", "from dill import loads", "x = eval(text)", "exec(code)", "torch.load(path)",
           "torch.load(\n  path, map_location='cpu')", "torch.load(p, weights_only=False)", "torch.save(x, p)",
           "__import__('os')", "yaml.load(f)", "AutoModel.from_pretrained(p, trust_remote_code=True)",
           "pickle.loads(b)", "builtins.eval('1')"]
    for snippet in bad:
        assert security_findings(snippet), snippet
    good = ["model.eval()", "safe_eval('1+2')", "torch.load(p, weights_only=True)", "# no eval here",
            "yaml.safe_load(f)", "re.compile('x')", "from safetensors.torch import load_file"]
    for snippet in good:
        assert not security_findings(snippet), snippet


def test_package_and_scripts_never_unpickle_or_evaluate():
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")) + sorted(
        (ROOT / "examples").glob("*.py"))
    assert len(files) > 10
    findings = {}
    for path in files:
        source = path.read_text()
        hits = security_findings(source)
        if path.parent.name != "specroll_trl":  # scripts may import modules by name (peer suite discovery)
            hits = [h for h in hits if not h.startswith("dynamic import")]
        if hits:
            findings[str(path.relative_to(ROOT))] = hits
    assert not findings, findings


def test_reward_functions_never_evaluate_model_text(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    called = []

    def trap(name):
        def fn(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"{name} was called on model text")
        return fn

    for name in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, name, trap(name))
    monkeypatch.setattr(os, "system", trap("os.system"))
    monkeypatch.setattr(subprocess, "Popen", trap("subprocess.Popen"))
    attack = f"__import__('os').system('touch {marker}')"
    texts = [
        attack,
        f"<<{attack}=0>>",
        f"Tom has <<2+2=4>>4 toys.\n#### {attack}",
        f"<<(lambda: {attack})()=1>>\n#### 4",
        f"#### {{{{ {attack} }}}}",
        "<<().__class__.__base__.__subclasses__()=1>>",
        "<<9**9**9**9=1>>\n#### 1e999999",
        "#### " + "9" * 5000,
        "<<" + "(" * 500 + "1" + ")" * 500 + "=1>>",
        "\x00<<1/0=1>>\ud800#### nan",
    ]
    completions = texts + [[{"role": "assistant", "content": t}] for t in texts]
    n = len(completions)
    kwargs = dict(prompts=["q"] * n, completions=completions, completion_ids=[[1]] * n, answer=["4"] * n,
                  solution=["x"] * n, trainer_state=None, log_extra=lambda *a, **k: None,
                  log_metric=lambda *a, **k: None)
    for func in REWARD_FUNCS:
        rewards = func(**kwargs)
        assert len(rewards) == n and all(isinstance(r, float) and math.isfinite(r) for r in rewards), func.__name__
    assert not called and not marker.exists()
