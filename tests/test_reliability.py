"""Reliability and security checks that belong to no one component (issue #8): memory under load stays near
vanilla generate's, exactness holds under random stress, and nothing in the package ever unpickles or evaluates.

The bad-input and fault cases of docs/reliability.md live with their components: tests/test_engine.py (engine
options, prompts, non-finite logits, unsupported models), tests/test_heads_zoo.py (heads folders),
tests/test_trainer.py (SpecGRPOConfig, trainer heads paths, checkpoints and resume) and tests/test_data_rewards.py
(reward functions on hostile model text)."""

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from specroll_trl.engine.generator import SpeculativeGenerator

from .conftest import cut_after_eos, left_padded, make_model
from .test_engine import noisy_heads

ROOT = Path(__file__).resolve().parents[1]


# =========================================================================== load


@pytest.mark.slow
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
        candidates=draw(st.sampled_from(["drawn", "top-k"])), fixed=draw(st.integers(0, 2)),
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
    options = dict(capacity=case["capacity"], max_nodes=case["max_nodes"], topk_per_head=case["topk"],
                   candidates=case["candidates"], fixed_children=min(case["fixed"], case["topk"]))
    torch.manual_seed(case["run_seed"])
    out = SpeculativeGenerator(model, heads, gc, **options).generate(ids, mask)
    rows = out.completion_ids
    assert len(rows) == len(case["prompts"])
    for row in rows:
        assert 1 <= len(row) <= case["max_new"]
        assert all(isinstance(t, int) and 0 <= t < case["vocab"] for t in row)
        assert not any(t in eos for t in row[:-1]), "a completion runs past its first eos"
        assert len(row) == case["max_new"] or row[-1] in eos, "a completion stopped early without eos"
    torch.manual_seed(case["run_seed"])  # a fresh engine (drawn trees follow what an engine has verified before)
    assert SpeculativeGenerator(model, heads, gc, **options).generate(ids, mask).completion_ids == rows, \
        "same seed, different completions"
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
