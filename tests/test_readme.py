"""The README is a page a TRL user can start from: its quickstart runs, its settings table is the dataclass's."""

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specroll_trl import SpecGRPOConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def quickstart_code() -> str:
    return re.search(r"```python\n(.*?)```", section("Quickstart"), re.S).group(1)


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    commands = [line for line in lines[:30] if line.startswith("python3 -m venv")]
    assert len(commands) == 2 and commands[0].endswith("specroll-trl demo") and commands[1].endswith("pytest -q")
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci  # CI runs exactly the documented test command
    assert len(quickstart_code().strip().splitlines()) <= 20


def test_glossary_defines_every_word_the_page_uses():
    glossary = section("Glossary")
    for word in ("root", "node", "node budget", "draft vocabulary", "accepted", "committed", "tau", "Reflex",
                 "fast path", "consolidation", "slow path", "drift"):
        assert f"**{word}" in glossary or f"/ {word}**" in glossary, word


def test_settings_table_is_the_dataclass():
    rows = re.findall(r"^\| `(spec_\w+)` \| `?([^|`]+)`? \|", section("Settings"), re.M)
    table = {name: default.strip() for name, default in rows}
    spec = {f.name: f.default for f in dataclasses.fields(SpecGRPOConfig) if f.name.startswith("spec_")}
    assert list(table) == list(spec), "the README's settings table lists other fields than SpecGRPOConfig"
    for name, default in spec.items():
        assert ast.literal_eval(table[name]) == default, f"{name}: README says {table[name]}, the field {default!r}"
    docstring = SpecGRPOConfig.__doc__
    assert all(f"{name} (" in docstring for name in spec), "every field is documented in the class docstring"


@pytest.mark.slow
def test_quickstart_runs_as_written(specroll_home, tmp_path):
    from specroll_trl.experiments import zoo

    zoo.build_policy("smollm2-135m", progress=False)  # what the main job leaves behind
    env = {**os.environ, "SPECROLL_HOME": specroll_home, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", quickstart_code()], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    logged = out.stdout + out.stderr
    assert "spec/tau" in logged and "spec/tree_nodes_per_row" in logged
    assert not list(tmp_path.rglob("checkpoint-*")), "a two-step demo leaves no 1.6 GB checkpoint behind"
