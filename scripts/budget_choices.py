"""What the online budget chooses, call after call: per call its tau, ms per token and the (rule, nodes) it planned
most often per batch-size bucket, then per bucket its cost and acceptance estimates and what it measured per width.

  python scripts/budget_choices.py --temperature 1.0 --calls 6               (one row; two threads, quiet machine)
  python scripts/budget_choices.py --temperature 0.7 --rows 32 --calls 3     (32 rows: ~1 min a call)
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
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    model, tokenizer = load_policy("smollm2-135m", progress=False)
    engine = SpeculativeGenerator(model, load_heads("smollm2-135m", progress=False),
                                  trl_generation_config(model, tokenizer, args.max_new_tokens, args.temperature))
    budget, plans = engine.budget, []
    plan = budget.plan
    budget.plan = lambda rows, rules=None: plans.append((budget._bucket(rows), *plan(rows, rules))) or plans[-1][1:]
    prompts = bench_prompts(tokenizer, args.calls * args.rows, start=BENCH_ROW)
    with torch.no_grad():
        ids, mask = left_pad(prompts[:args.rows], tokenizer.pad_token_id)
        engine.generate(ids[:, -64:], mask[:, -64:], max_new_tokens=8)  # the benches' untimed warm-up
        for call in range(args.calls):
            plans.clear()
            ids, mask = left_pad(prompts[call * args.rows:(call + 1) * args.rows], tokenizer.pad_token_id)
            torch.manual_seed(call)
            stats = engine.generate(ids, mask).stats
            print(f"call {call}: tau {stats.tau:.2f}, {stats.tokens} tokens, {stats.forwards} steps, "
                  f"{1000 * stats.seconds / stats.tokens:.1f} ms a token", flush=True)
            by_bucket = collections.defaultdict(collections.Counter)
            for bucket, rule, nodes in plans:
                by_bucket[bucket][(rule, nodes)] += 1
            for bucket in sorted(by_bucket, reverse=True):
                print(f"  bucket {bucket:>3}: (rule, nodes) planned {by_bucket[bucket].most_common(6)}", flush=True)
    for bucket in sorted(budget.width_seconds, reverse=True):
        print(f"bucket {bucket}: predicted ms a step by nodes, any rule:",
              [round(1000 * float(c), 1) for c in budget.cost(bucket)])
        for rule in budget.rules:
            cost, accepted = budget.cost(bucket, rule), budget.accepted(rule)
            print(f"  {rule}: ms", [round(1000 * float(c), 1) for c in cost])
            print(f"  {rule}: accepted", [round(float(a), 2) for a in accepted],
                  "tokens/s", [round(float(r), 1) for r in (1 + accepted) / cost])
            weight, realised, predicted = budget.by_rule[rule].width_accept
            print(f"  {rule}: (nodes, weight, realised, predicted) a step:",
                  [(n, round(float(weight[n]), 2), round(float(realised[n] / weight[n]), 2),
                    round(float(predicted[n] / weight[n]), 2)) for n in range(len(weight)) if weight[n] > 0.01])
        weight, seconds = budget.width_seconds[bucket]
        measured = [(n, round(float(weight[n]), 2), round(1000 * float(seconds[n] / weight[n]), 1))
                    for n in range(len(weight)) if weight[n] > 0]
        print("  measured (nodes, weight, ms):", measured, flush=True)


if __name__ == "__main__":
    main()
