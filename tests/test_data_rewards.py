import builtins
import math
import os
import re
import subprocess
import time

import pytest

from specroll_trl.experiments.rewards import (
    REWARD_FUNCS,
    ExpressionError,
    calculator_reward,
    correctness_reward,
    format_reward,
    safe_eval,
)
from specroll_trl.experiments.tasks import (
    PROMPT_TEMPLATE,
    arithmetic_examples,
    extract_final_answer,
    format_prompt,
    load_gsm8k,
    make_arithmetic_task,
)


@pytest.fixture(scope="module")
def gsm8k_train():
    return load_gsm8k("train")


@pytest.fixture(scope="module")
def procedural():
    return arithmetic_examples(500, seed=0)


def test_gsm8k_sizes_and_first_row(gsm8k_train):
    assert len(gsm8k_train) == 7473
    assert len(load_gsm8k("test")) == 1319
    assert gsm8k_train.column_names == ["prompt", "answer", "solution"]
    first = gsm8k_train[0]
    assert first["answer"] == "72"
    assert first["prompt"].startswith("Question: Natalia sold clips")
    assert first["prompt"].endswith("\nAnswer:")
    assert first["solution"].endswith("#### 72")


def test_gsm8k_answers_have_no_commas(gsm8k_train):
    assert all(re.fullmatch(r"-?\d+", a) for a in gsm8k_train["answer"])
    assert "1080" in gsm8k_train["answer"]


def test_gsm8k_conversational_and_limit():
    ds = load_gsm8k("test", conversational=True, limit=5)
    assert len(ds) == 5
    prompt = ds[0]["prompt"]
    assert isinstance(prompt, list) and len(prompt) == 1
    assert prompt[0]["role"] == "user"
    assert "Question:" not in prompt[0]["content"] and prompt[0]["content"].endswith("?")


def test_gsm8k_unknown_split():
    with pytest.raises(ValueError, match="validation"):
        load_gsm8k("validation")


def test_format_prompt():
    assert format_prompt("What is 2+2?", False) == PROMPT_TEMPLATE.format(question="What is 2+2?")
    assert format_prompt("What is 2+2?", True) == [{"role": "user", "content": "What is 2+2?"}]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a\n#### 72", "72"),
        ("#### $1,080.", "1080"),
        ("#### 3.5 apples", "3.5"),
        ("#### -4", "-4"),
        ("#### 1\nmore\n#### 2", "2"),
        ("no final line 72", None),
        ("#### seven", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_procedural_deterministic_per_seed():
    assert arithmetic_examples(50, seed=3) == arithmetic_examples(50, seed=3)
    assert arithmetic_examples(50, seed=3) != arithmetic_examples(50, seed=4)
    assert len(arithmetic_examples(7, seed=1)) == 7


def test_procedural_solutions_score_full_rewards(procedural):
    solutions = [ex["solution"] for ex in procedural]
    answers = [ex["answer"] for ex in procedural]
    assert calculator_reward(solutions) == [1.0] * len(solutions)
    assert format_reward(solutions) == [1.0] * len(solutions)
    assert correctness_reward(solutions, answers) == [1.0] * len(solutions)


def test_procedural_shape(procedural):
    questions = {ex["question"] for ex in procedural}
    assert len(questions) > 450
    for ex in procedural:
        lines = ex["solution"].splitlines()
        assert lines[-1] == f"#### {ex['answer']}"
        annotations = re.findall(r"<<(\d+)([-+*/])(\d+)=(\d+)>>", ex["solution"])
        step_lines = [line for line in lines if "<<" in line]
        assert 2 <= len(annotations) == len(step_lines) <= 3
        assert len(lines) - 1 - len(step_lines) <= 2  # at most an opening and a closing sentence
        for a, op, b, value in annotations:
            assert 0 <= int(value) <= 999
            if op == "/":
                assert int(a) % int(b) == 0
        assert annotations[-1][3] == ex["answer"]


def test_procedural_mixes_difficulty_and_free_text(procedural):
    values = [int(v) for ex in procedural for v in re.findall(r"=(\d+)>>", ex["solution"])]
    assert max(values) > 200 and sum(v <= 200 for v in values) > 0.5 * len(values)
    openers = sum(ex["solution"].splitlines()[0].count("<<") == 0 for ex in procedural)
    assert 0.2 * len(procedural) < openers < 0.8 * len(procedural)


def test_make_arithmetic_task_columns():
    ds = make_arithmetic_task(20, seed=5)
    assert ds.column_names == ["prompt", "answer", "solution"]
    assert ds[0]["prompt"].startswith("Question: ") and ds[0]["prompt"].endswith("\nAnswer:")
    conv = make_arithmetic_task(20, seed=5, conversational=True)
    assert conv[0]["prompt"] == [{"role": "user", "content": arithmetic_examples(1, seed=5)[0]["question"]}]
    assert conv["answer"] == ds["answer"]


def test_rewards_on_gold_gsm8k_rows(gsm8k_train):
    rows = gsm8k_train.select(range(50))
    solutions, answers = rows["solution"], rows["answer"]
    assert correctness_reward(solutions, answers) == [1.0] * 50
    assert format_reward(solutions) == [1.0] * 50

    changed = [re.sub(r"#### (.*)$", lambda m: f"#### {int(m.group(1)) + 1}", s) for s in solutions]
    assert correctness_reward(changed, answers) == [0.0] * 50
    assert format_reward(changed) == [1.0] * 50

    malformed = [s.rsplit("####", 1)[0] for s in solutions]
    assert correctness_reward(malformed, answers) == [0.0] * 50
    assert format_reward(malformed) == [0.0] * 50


def test_correctness_numeric_normalisation():
    completions = ["x\n#### 72.0", "x\n#### $1,080", "x\n#### 72", "x\n####", "garbage"]
    assert correctness_reward(completions, ["72", "1080", "71", "72", "72"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_format_reward_partial_credit():
    completions = ["#### 7", "step\n#### 7\nmore text", "step\n#### 7 apples", "step\n#### 7  \n", "step"]
    assert format_reward(completions) == [0.5, 0.5, 0.5, 1.0, 0.0]


def test_calculator_reward_wrong_annotation_fraction(gsm8k_train):
    solution = gsm8k_train[2]["solution"]
    assert "<<100/2=50>>" in solution and len(re.findall(r"<<", solution)) == 3
    wrong = solution.replace("<<100/2=50>>", "<<100/2=51>>")
    assert calculator_reward([solution, wrong]) == pytest.approx([1.0, 2 / 3])
    first = gsm8k_train[0]["solution"].replace("<<48/2=24>>", "<<48/2=25>>")
    assert calculator_reward([first]) == [0.5]
    assert calculator_reward(["no annotations\n#### 3"]) == [0.0]


def test_calculator_tolerates_gsm8k_quirks():
    completions = [
        "<<10/3=3.33>>",
        "<<2/3=.67>>",
        "<<1,000+5=1,005>>",
        "<<6/8=3/4>>",
        "<< 2 * (3 + 4) = 14 >>",
    ]
    assert calculator_reward(completions) == [1.0] * 5
    assert calculator_reward(["<<7/2=3>>", "<<10/3=3.4>>", "<<5%*2=10>>", "<<2x3=6>>"]) == [0.0] * 4


def test_conversational_completions(gsm8k_train):
    row = gsm8k_train[0]
    completions = [
        [{"role": "assistant", "content": row["solution"]}],
        [{"role": "assistant", "content": "hm"}],
    ]
    assert correctness_reward(completions, [row["answer"]] * 2) == [1.0, 0.0]
    assert format_reward(completions) == [1.0, 0.0]
    assert calculator_reward(completions) == [1.0, 0.0]


def test_trl_call_signature(gsm8k_train):
    row = gsm8k_train[0]
    kwargs = {
        "prompts": [row["prompt"]],
        "completions": [" " + row["solution"]],
        "completion_ids": [[1, 2, 3]],
        "answer": [row["answer"]],
        "solution": [row["solution"]],
        "trainer_state": None,
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
    }
    assert [f(**kwargs) for f in REWARD_FUNCS] == [[1.0], [1.0], [1.0]]
    assert [f.__name__ for f in REWARD_FUNCS] == ["correctness_reward", "format_reward", "calculator_reward"]


def test_safe_eval_arithmetic():
    assert safe_eval("2+3*4") == 14
    assert safe_eval("(2+3)*4") == 20
    assert safe_eval("-3--2") == -1
    assert safe_eval("7/2") == 3.5
    assert safe_eval("0.1*3") == safe_eval(".3")


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os').system('touch /tmp/specroll_pwned')",
        "__import__('os')",
        "2**100000",
        "9**9**9",
        "x+1",
        "abs(-3)",
        "1e400",
        "1/0",
        "(1+2",
        "1+" * 100 + "1",
        "1234567890123456+1",
        "",
        "[1]",
        "1 if 1 else 2",
    ],
)
def test_safe_eval_rejects(expr, tmp_path):
    start = time.perf_counter()
    with pytest.raises(ExpressionError):
        safe_eval(expr)
    assert time.perf_counter() - start < 0.1
    assert calculator_reward([f"<<{expr}=1>>"]) == [0.0]


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
    assert calculator_reward([f"<<{attack}=0>>"]) == [0.0]
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
