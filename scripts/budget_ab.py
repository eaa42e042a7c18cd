"""The online node budget of this checkout against another version of ``engine/budget.py``, side by side: two online
engines (``new``: this checkout's budget, ``old``: the file given), a fixed tree and `generate`, alternating round
by round on the bench's held-out prompts (``specroll-trl bench generation``'s rounds: same prompts and seed per
round, the order rotated), each engine after the bench's untimed warm-up call. Prints and writes, per round, each
arm's speed per token against `generate` and the ratios new / old, new / fixed, old / fixed.

  git show b474d25:specroll_trl/engine/budget.py > /tmp/budget_old.py   (the budget before 2026-12-06 evening)
  python scripts/budget_ab.py --old /tmp/budget_old.py --temperature 0.7 --rounds 8 --out /tmp/ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics

import torch

from specroll_trl.adapt.samples import left_pad
from specroll_trl.engine import SpeculativeGenerator
from specroll_trl.experiments.bench import _alternate, _prompt_sets
from specroll_trl.experiments.zoo import policy_heads_and_config


def old_budget_class(path: str):
    spec = importlib.util.spec_from_file_location("budget_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OnlineBudget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="another version of specroll_trl/engine/budget.py")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--fixed-nodes", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer, heads, gc = policy_heads_and_config("smollm2-135m", args.max_new_tokens, args.temperature)
    engines = {"new": SpeculativeGenerator(model, heads, gc), "old": SpeculativeGenerator(model, heads, gc),
               f"fixed_{args.fixed_nodes}": SpeculativeGenerator(model, heads, gc, max_nodes=args.fixed_nodes,
                                                                 capacity=10**9)}
    new = engines["new"].budget
    engines["old"].budget = old_budget_class(args.old)(new.max_nodes, new.rules)
    inputs = [left_pad(prompts, tokenizer.pad_token_id)
              for prompts in _prompt_sets("smollm2-135m", tokenizer, "gsm8k-test", args.rows, args.rounds)]
    with torch.no_grad():
        for engine in engines.values():
            ids, mask = inputs[0]
            engine.generate(ids[:, -64:], mask[:, -64:], max_new_tokens=8)  # the bench's warm-up, untimed
        records = {r["mode"]: r for r in _alternate(model, engines, inputs, gc)}
    fixed = f"fixed_{args.fixed_nodes}"
    speeds = {mode: r["per_token_speedups"] for mode, r in records.items()}
    pairs = {f"{a}/{b}": [x / y for x, y in zip(speeds[a], speeds[b])]
             for a, b in (("new", "old"), ("new", fixed), ("old", fixed))}
    for name, values in {**speeds, **pairs}.items():
        print(f"{name:>14}: {' '.join(f'{v:.2f}' for v in values)}  median {statistics.median(values):.2f}")
    with open(args.out, "w") as f:
        json.dump({"temperature": args.temperature, "rows": args.rows, "old": args.old, "records": records,
                   "ratios": pairs}, f, indent=2)


if __name__ == "__main__":
    main()
