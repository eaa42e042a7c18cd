"""How often the engine's in-place kernel choice (``engine.kernels``) picks, per weight shape of the policy, the kernel
that is slower in steady state, on SmolLM2 with the shipped heads at one row.

Steady state: every linear layer forced to one kernel for whole ``generate`` calls (``F.linear``, then packed, three
times each, alternating), the median time of each shape's calls over the verification forward's rows. Then
``--trials`` fresh choices, each made by a new ``LinearKernels`` in one engine call of 48 tokens, as a user's first
call makes it. ``--compare-with PATH`` alternates those with the choices of another version of ``engine/kernels.py``
(e.g. ``git show 7a4a495:specroll_trl/engine/kernels.py > /tmp/kernels_old.py``); ``--step-rounds N`` then times N
alternating rounds of 64 tokens with each version's last choice (ms per step, packing left out).

  python scripts/kernel_choice.py --trials 6                       (two threads, quiet machine)
  python scripts/kernel_choice.py --trials 6 --nodes 4 --compare-with /tmp/kernels_old.py
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import statistics
import time

import torch
from torch.nn import functional as F

from specroll_trl.adapt.samples import left_pad
from specroll_trl.engine import SpeculativeGenerator
from specroll_trl.engine import generator as engine_module
from specroll_trl.engine import kernels as kernels_module
from specroll_trl.experiments.heads_bench import bench_prompts
from specroll_trl.experiments.zoo import load_heads, load_policy, trl_generation_config


def steady_state(model, heads, gc, ids, mask, nodes: int, rows: int) -> dict:
    """Per weight shape: (median ms per call with ``F.linear``, with the packed kernel), every layer one kernel for a
    whole call, over the forwards of ``rows`` query rows."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    times = collections.defaultdict(list)

    def force(module, packed: bool):
        weight, bias = module.weight, module.bias
        copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 3) if packed else None

        def forward(x):
            start = time.perf_counter()
            out = F.linear(x, weight, bias) if copy is None else kernels_module.packed_linear(x, copy, bias)
            if x.numel() // x.shape[-1] == rows:
                times[packed, tuple(weight.shape)].append(time.perf_counter() - start)
            return out
        module.forward = forward

    for seed in range(3):
        for packed in (False, True):
            for module in layers:
                force(module, packed)
            engine = SpeculativeGenerator(model, heads, gc, max_nodes=nodes, capacity=10**9, pack_linears=False)
            torch.manual_seed(seed)
            engine.generate(ids, mask)
            for module in layers:
                module.__dict__.pop("forward")
    shapes = {shape for _, shape in times}
    return {s: (1e3 * statistics.median(times[False, s]), 1e3 * statistics.median(times[True, s])) for s in shapes}


def choice_of(module, model, heads, gc, ids, mask, nodes: int, rows: int, seed: int):
    """The engine whose fresh ``module.LinearKernels`` made its choice in one call, and the model's shapes' choice
    at ``rows``: shape -> packed."""
    kernels = module.LinearKernels(model)
    engine_module.kernels_of = lambda m: kernels
    try:
        engine = SpeculativeGenerator(model, heads, gc, max_nodes=nodes, capacity=10**9)
    finally:
        engine_module.kernels_of = kernels_module.kernels_of
    torch.manual_seed(seed)
    engine.generate(ids, mask)
    bucket = kernels_module.rows_bucket(rows)
    # this version's keys: (shape, bias, drafting); earlier ones: (shape, bias)
    return engine, {key[0][0]: packed for key, packed in kernels.choice.items()
                    if key[1] == bucket and not (len(key[0]) > 2 and key[0][2])}


def step_ms(engines: dict, ids, mask, rounds: int) -> dict:
    """Per engine, ms per step of ``rounds`` calls of 64 tokens, the engines alternating, packing left out."""
    per_step = {name: [] for name in engines}
    for round_ in range(rounds):
        for name, engine in engines.items():
            torch.manual_seed(100 + round_)
            stats = engine.generate(ids, mask, max_new_tokens=64).stats
            per_step[name].append(1e3 * (stats.seconds - stats.pack_seconds) / stats.forwards)
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--nodes", type=int, default=0, help="draft nodes per step (the forward's rows: nodes + 1)")
    parser.add_argument("--compare-with", default=None, help="another engine/kernels.py, its choices alternated")
    parser.add_argument("--step-rounds", type=int, default=0, help="then time steps with each version's choice")
    parser.add_argument("--out", default=None, help="JSON of the steady state and every choice")
    args = parser.parse_args()
    model, tokenizer = load_policy("smollm2-135m", progress=False)
    heads = load_heads("smollm2-135m", progress=False)
    gc = trl_generation_config(model, tokenizer, 48, 1.0)
    ids, mask = left_pad(bench_prompts(tokenizer, 1), tokenizer.pad_token_id)
    rows = args.nodes + 1
    rules = {"engine": kernels_module}
    if args.compare_with:
        spec = importlib.util.spec_from_file_location("kernels_compared", args.compare_with)
        rules["compared"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(rules["compared"])
    with torch.no_grad():
        truth = steady_state(model, heads, gc, ids, mask, args.nodes, rows)
        for shape, (f_ms, packed_ms) in sorted(truth.items()):
            print(f"steady state {shape}: F.linear {f_ms:.3f} ms, packed {packed_ms:.3f} ms per call "
                  f"-> {'packed' if packed_ms < f_ms else 'F.linear'}", flush=True)
        picks, engines = {name: [] for name in rules}, {}
        for trial in range(args.trials):
            for name, module in rules.items():
                engines[name], choice = choice_of(module, model, heads, gc, ids, mask, args.nodes, rows, trial)
                choice = {s: c for s, c in choice.items() if s in truth}  # siblings' one product: no layer alone
                wrong = [s for s in choice if choice[s] != (truth[s][1] < truth[s][0])]
                picks[name].append({"choice": {str(s): c for s, c in choice.items()}, "wrong": [str(s) for s in wrong]})
                print(f"trial {trial} {name}: {len(wrong)} of {len(choice)} shapes on the slower kernel {wrong}",
                      flush=True)
        steps = step_ms(engines, ids, mask, args.step_rounds) if args.step_rounds else {}
    for name, runs in picks.items():
        wrong = sum(len(r["wrong"]) for r in runs)
        total = sum(len(r["choice"]) for r in runs)
        print(f"{name}: {wrong} of {total} choices on the slower kernel, in {sum(bool(r['wrong']) for r in runs)} "
              f"of {len(runs)} calls")
    for name, times in steps.items():
        print(f"{name}: {statistics.median(times):.1f} ms per step, rounds {[round(t, 1) for t in times]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "steady_state_ms": {str(s): t for s, t in truth.items()}, "picks": picks,
                       "step_ms": steps}, f, indent=1)


if __name__ == "__main__":
    main()
