"""The online node budget against the no-draft loop in simulation, where rows finish and the batch shrinks: the step
costs measured for SmolLM2 on 2 CPU cores (1 row, 8 rows, 32 rows: ``tests/test_budget.py``, from
``benchmarks/step_cost_32rows_smollm2.json`` and the 1- and 8-row curve), acceptance of the tree's j-th best node as
measured at T=1.0 / T=0.7, heads that overrate deep nodes. Three generations of 128 tokens per run (completion
lengths drawn per seed), the budget kept across them as in training; prints the mean and worst ratio of committed
tokens per second to the no-draft loop's over seeds.

  python -m scripts.budget_simulation      # from the repository root (it reads the tests' measured curves)
"""

from __future__ import annotations

import random
import statistics

import torch

from specroll_trl.engine.budget import OnlineBudget
from tests.test_budget import ACCEPT_T07, ACCEPT_T10, COST_1_ROW, COST_8_ROWS, COST_32_ROWS, OVERRATED


def relative_cost(rows: int) -> list[float]:
    return COST_1_ROW if rows <= 2 else COST_8_ROWS if rows <= 16 else COST_32_ROWS


def tokens_per_second(start_rows: int, accept: list[float], online: bool, seed: int, generations: int = 3,
                      max_new_tokens: int = 128) -> float:
    rng = random.Random(seed)
    budget = OnlineBudget(max_nodes=16, seed=seed)
    tokens = seconds = 0.0
    for _ in range(generations):
        mean_length = 1.2 * max_new_tokens
        lengths = [min(max_new_tokens, int(rng.expovariate(1 / mean_length)) + 20) for _ in range(start_rows)]
        done = [0.0] * start_rows
        while rows := sum(d < n for d, n in zip(done, lengths)):
            nodes = budget.choose(rows) if online else 0
            step = relative_cost(rows)[nodes] * (0.03 + rows / 64)  # a plain step grows with rows
            accepted = sum(accept[:nodes])
            scores = torch.tensor(OVERRATED, dtype=torch.float64).log()[None].expand(rows, -1)
            budget.observe(rows, nodes, step, accepted, scores if nodes else None)
            done = [d + (1 + accepted) * (d < n) for d, n in zip(done, lengths)]
            tokens, seconds = tokens + rows * (1 + accepted), seconds + step
    return tokens / seconds


def main() -> None:
    for rows in (1, 8, 32, 64):
        for name, accept in (("T=1.0", ACCEPT_T10), ("T=0.7", ACCEPT_T07)):
            ratios = [tokens_per_second(rows, accept, True, s) / tokens_per_second(rows, accept, False, s)
                      for s in range(16)]
            print(f"{rows:>2} rows {name}: online / no-draft loop {statistics.mean(ratios):.3f} "
                  f"(worst {min(ratios):.3f})", flush=True)


if __name__ == "__main__":
    main()
