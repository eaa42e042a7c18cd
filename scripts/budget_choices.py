"""What the online budget chooses at one row, call after call: per call its tau, ms per token and the (rule, nodes)
it planned most often, then its cost and acceptance estimates and what it measured per width.

  python scripts/budget_choices.py --temperature 1.0 --calls 6     (two threads, quiet machine)
"""

from __future__ import annotations

import argparse
import collections

import torch

from specroll_trl.adapt.samples import left_pad
from specroll_trl.engine import SpeculativeGenerator
from specroll_trl.experiments.heads_bench import BENCH_ROW, bench_prompts
from specroll_trl.experiments.zoo import load_heads, load_policy, trl_generation_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    model, tokenizer = load_policy("smollm2-135m", progress=False)
    engine = SpeculativeGenerator(model, load_heads("smollm2-135m", progress=False),
                                  trl_generation_config(model, tokenizer, args.max_new_tokens, args.temperature))
    plans, plan = [], engine.budget.plan
    engine.budget.plan = lambda rows: plans.append(plan(rows)) or plans[-1]
    prompts = bench_prompts(tokenizer, args.calls, start=BENCH_ROW)
    with torch.no_grad():
        ids, mask = left_pad(prompts[:1], tokenizer.pad_token_id)
        engine.generate(ids[:, -64:], mask[:, -64:], max_new_tokens=8)  # the benches' untimed warm-up
        for call, prompt in enumerate(prompts):
            plans.clear()
            ids, mask = left_pad([prompt], tokenizer.pad_token_id)
            torch.manual_seed(call)
            stats = engine.generate(ids, mask).stats
            print(f"call {call}: tau {stats.tau:.2f}, {stats.tokens} tokens, {1000 * stats.seconds / stats.tokens:.1f} "
                  f"ms a token; (rule, nodes) planned: {collections.Counter(plans).most_common(6)}", flush=True)
    budget = engine.budget
    cost = budget.cost(1)
    print("predicted ms a step by nodes:", [round(1000 * float(c), 1) for c in cost])
    for rule in budget.rules:
        accepted = budget.accepted(rule)
        print(f"{rule}: accepted", [round(float(a), 2) for a in accepted],
              "tokens/s", [round(float(r), 1) for r in (1 + accepted) / cost])
    weight, seconds = budget.width_seconds[1]
    measured = [(n, round(float(weight[n]), 2), round(1000 * float(seconds[n] / weight[n]), 1))
                for n in range(len(weight)) if weight[n] > 0]
    print("measured (nodes, weight, ms):", measured)


if __name__ == "__main__":
    main()
