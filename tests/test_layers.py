"""The package's layers: the engine works without TRL, and each layer imports only those below it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specroll_trl"
# what each part of the library may import from the package (the lab, experiments/ and cli.py, may import anything)
ALLOWED = {
    "engine": {"engine", "files"},  # files.py: the local cache, below every layer (the streamed kernel is built there)
    "adapt": {"engine", "adapt", "files"},
    "trainer.py": {"engine", "adapt"},
    "export.py": {"engine"},
    "files.py": set(),
    "__init__.py": {"engine", "adapt", "trainer"},
}


def package_imports(path: Path) -> set[str]:
    """The top-level parts of ``specroll_trl`` a module imports (``engine``, ``adapt``, ``trainer``, ...)."""
    rel = path.relative_to(PACKAGE)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "specroll_trl" and len(parts) > 1:
                    found.add(parts[1])
                continue
            base = list(rel.parts[:-1])[: len(rel.parts) - node.level]
            parts = base + (node.module.split(".") if node.module else [n.name for n in node.names])
            found.add(parts[0].removesuffix(".py"))
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("specroll_trl.")}
    return found


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(part):
    files = sorted((PACKAGE / part).rglob("*.py")) if (PACKAGE / part).is_dir() else [PACKAGE / part]
    for path in files:
        imported = {name.removesuffix(".py") for name in package_imports(path)}
        allowed = {name.removesuffix(".py") for name in ALLOWED[part]}
        assert imported <= allowed, f"{path.relative_to(PACKAGE)} imports {sorted(imported - allowed)}"


def test_the_engine_and_the_package_root_work_without_trl():
    code = """
import sys
sys.modules["trl"] = None  # any `import trl` now raises ImportError
import specroll_trl.engine
from specroll_trl import DriftMonitor, SpeculativeGenerator, SpeculativeHeads, consolidate_heads
from specroll_trl.adapt.reflex import reflex_hooks
assert reflex_hooks("lookup")
try:
    from specroll_trl import SpecGRPOTrainer
except ImportError as err:
    print("trainer needs trl:", err)
else:
    raise SystemExit("the trainer imported without TRL")
assert not any(name.startswith("specroll_trl.experiments") for name in sys.modules), "the lab was imported"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "trainer needs trl" in out.stdout and out.stdout.strip().endswith("ok")


def lab_import_graph() -> dict[str, set[str]]:
    """Which modules of ``experiments/`` each one imports (at the top or inside a function)."""
    lab = PACKAGE / "experiments"
    graph = {}
    for path in lab.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module.split(".")[0]] if node.module else [a.name for a in node.names]
                found |= {name for name in names if (lab / f"{name}.py").is_file()}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specroll_trl.experiments."):
                found.add(node.module.split(".")[2])
        graph[path.stem] = found - {path.stem}
    return graph


def test_the_lab_has_no_import_cycles():
    graph = lab_import_graph()
    assert graph["bench"] and graph["zoo"], "the graph reads the lab's imports"
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            raise AssertionError(f"import cycle in experiments/: {' -> '.join(on_path[on_path.index(module):])} -> "
                                 f"{module}")
        if module in done:
            return
        on_path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        on_path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
