"""The cost model's projection arithmetic (scripts/cost_model.py)."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("cost_model", Path(__file__).resolve().parents[1] / "scripts" /
                                              "cost_model.py")
cost_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cost_model)

TAU = {0: 1.0, 4: 2.0, 16: 3.0}


def test_tau_interpolates_and_saturates():
    assert cost_model.tau_at(TAU, 0) == 1.0
    assert cost_model.tau_at(TAU, 2) == pytest.approx(1.5)
    assert cost_model.tau_at(TAU, 10) == pytest.approx(2.5)
    assert cost_model.tau_at(TAU, 64) == 3.0


def test_projection_follows_the_node_budget_roofline_and_amdahl():
    rows = {r["batch"]: r for r in cost_model.project(TAU, capacity=80, batches=[1, 16, 40, 80, 160], share=0.5,
                                                       overhead=0.0, max_nodes=16, tau_scale=1.0)}
    assert rows[1]["nodes_per_row"] == 16 and rows[1]["relative_verify_cost"] == 1.0
    assert rows[1]["generation_speedup"] == pytest.approx(3.0)
    assert rows[1]["e2e_speedup"] == pytest.approx(1 / (0.5 + 0.5 / 3.0))
    assert rows[16]["nodes_per_row"] == 4 and rows[16]["relative_verify_cost"] == 1.0  # 16 x 5 = 80 tokens
    assert rows[40]["nodes_per_row"] == 1 and rows[40]["relative_verify_cost"] == 1.0
    assert rows[80]["nodes_per_row"] == 0 and rows[80]["generation_speedup"] == 1.0
    assert rows[160]["e2e_speedup"] == 1.0
    heavy = cost_model.project(TAU, 80, [1], 0.5, overhead=0.25, max_nodes=16, tau_scale=2.0)[0]
    assert heavy["tau"] == pytest.approx(5.0) and heavy["generation_speedup"] == pytest.approx(4.0)
