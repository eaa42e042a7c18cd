"""A step's cost with the streamed linear kernel among the engine's candidates (``with``, what users get) against
without it (``without``: ``F.linear`` and the packed kernel only, the engine before ``engine/streamed.py``), on
SmolLM2 with the shipped heads: per tree size (or ``online``: the default budget), two engines alternate calls on the
bench's held-out prompts, each after an untimed call in which its kernels (and budget) settle; ms per step and per
token (packing left out), with / without round by round, and the kernels each chose for the decoder's shapes.

  python scripts/streamed_ab.py --nodes 0 2 4 16 --rows 1 --rounds 5 --out /tmp/streamed_ab.json
  python scripts/streamed_ab.py --nodes online --max-new-tokens 256 --rounds 6 --out /tmp/streamed_online.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specroll_trl.adapt.samples import left_pad
from specroll_trl.engine import SpeculativeGenerator
from specroll_trl.engine.kernels import STREAMED, LinearKernels
from specroll_trl.experiments.bench import _prompt_sets
from specroll_trl.experiments.zoo import policy_heads_and_config

KERNEL_NAMES = ("F.linear", "packed", "streamed")


class WithoutStreamed(LinearKernels):
    def candidates(self, bucket: int) -> list[int]:
        return [k for k in super().candidates(bucket) if k != STREAMED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", nargs="+", default=["0", "2", "4", "16"], help="fixed tree sizes, or online")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, tokenizer, heads, gc = policy_heads_and_config("smollm2-135m", args.max_new_tokens, args.temperature)
    inputs = [left_pad(prompts, tokenizer.pad_token_id)
              for prompts in _prompt_sets("smollm2-135m", tokenizer, "gsm8k-test", args.rows, args.rounds + 1)]
    results = {}
    for nodes in args.nodes:
        engines = {}
        for name, kernels in (("with", LinearKernels(model)), ("without", WithoutStreamed(model))):
            fixed = {} if nodes == "online" else {"max_nodes": int(nodes), "capacity": 10**9}
            engine = engines[name] = SpeculativeGenerator(model, heads, gc, **fixed)
            engine.kernels = kernels
        ms, per_token = {name: [] for name in engines}, {name: [] for name in engines}
        with torch.no_grad():
            for engine in engines.values():
                torch.manual_seed(0)
                engine.generate(*inputs[0])  # the kernels settle: untimed
            for round_, (ids, mask) in enumerate(inputs[1:]):
                for name in (list(engines) if round_ % 2 == 0 else list(engines)[::-1]):
                    torch.manual_seed(round_)
                    stats = engines[name].generate(ids, mask).stats
                    ms[name].append(1e3 * (stats.seconds - stats.pack_seconds) / stats.forwards)
                    per_token[name].append(1e3 * (stats.seconds - stats.pack_seconds) / stats.tokens)
        ratios = [a / b for a, b in zip(per_token["with"], per_token["without"])]
        chosen = {name: {f"{'drafting ' * key[0][-1]}{key[0][0]} x {key[1]} rows": KERNEL_NAMES[k]
                         for key, k in engine.kernels.choice.items()} for name, engine in engines.items()}
        results[nodes] = {"ms_per_step": ms, "ms_per_token": per_token, "with_over_without_per_token": ratios,
                          "choice": chosen}
        print(f"{nodes} nodes, {args.rows} rows: with {statistics.median(ms['with']):.1f} ms, without "
              f"{statistics.median(ms['without']):.1f} ms per step; per token, with / without round by round "
              f"{' '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f}); streamed chosen for "
              f"{sum(v == 'streamed' for v in chosen['with'].values())} of {len(chosen['with'])} shapes x buckets",
              flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": args.rows, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                   "threads": torch.get_num_threads(), "nodes": results}, f, indent=1)


if __name__ == "__main__":
    main()
