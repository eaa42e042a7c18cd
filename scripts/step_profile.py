"""Where a decoding step's time goes at one row on this CPU: ms per step of the engine at 0 / 2 / 4 draft nodes against
`generate`, torch.profiler tables of a 0- and a 2-node run and of `generate`, and the lm_head product alone,
`F.linear` against `x @ W.T` with a transposed copy, for 1-8 query rows.

  OMP_NUM_THREADS=1 python scripts/step_profile.py     (shares hold under load; milliseconds do not)
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from specroll_trl.adapt.samples import left_pad
from specroll_trl.engine import SpeculativeGenerator
from specroll_trl.experiments.heads_bench import bench_prompts
from specroll_trl.experiments.zoo import load_heads, load_policy, trl_generation_config


def median_ms(fn, repeats: int = 9, inner: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return 1e3 * statistics.median(times)


def main() -> None:
    model, tokenizer = load_policy("smollm2-135m", progress=False)
    heads = load_heads("smollm2-135m", progress=False)
    gc = trl_generation_config(model, tokenizer, 64, 1.0)
    ids, mask = left_pad(bench_prompts(tokenizer, 1), tokenizer.pad_token_id)
    engines = {n: SpeculativeGenerator(model, heads, gc, max_nodes=n, capacity=10**9) for n in (0, 2, 4)}
    per_step = {n: [] for n in [*engines, "generate"]}
    for seed in range(4):
        for n, engine in engines.items():
            torch.manual_seed(seed)
            stats = engine.generate(ids, mask).stats
            per_step[n].append(stats.seconds / stats.forwards)
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        per_step["generate"].append((time.perf_counter() - start) / (out.shape[1] - ids.shape[1]))
    for name, seconds in per_step.items():
        print(f"{name}: {1000 * statistics.median(seconds):.1f} ms per step", flush=True)
    runs = {"nodes 0": lambda: engines[0].generate(ids, mask), "nodes 2": lambda: engines[2].generate(ids, mask),
            "generate": lambda: model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)}
    for name, run in runs.items():
        torch.manual_seed(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        print(f"== {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    weight = model.get_output_embeddings().weight.detach()
    transposed = weight.t().contiguous()
    for rows in (1, 2, 3, 4, 5, 8):
        x = torch.randn(rows, weight.shape[1])
        linear = median_ms(lambda x=x: F.linear(x, weight))
        copy = median_ms(lambda x=x: x @ transposed)
        print(f"lm_head, {rows} query rows: F.linear {linear:6.1f} ms, x @ W.T (transposed copy) {copy:6.1f} ms")


if __name__ == "__main__":
    main()
