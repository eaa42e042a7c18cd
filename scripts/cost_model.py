"""Cost model: project speculative-rollout speedups to other hardware, model sizes and batch sizes.

THIS IS A PROJECTION, NOT A MEASUREMENT. It combines three things:

1. tau(N): tokens committed per target forward per row as a function of the draft nodes per row, measured
   here on a zoo policy with its heads (``--measure``; acceptance does not depend on timing or hardware);
2. a verify-cost curve c(B, k) = cost of one target forward with B rows x k query tokens, relative to a plain
   decoding step (k = 1): measured on this CPU (``--measure``), or a roofline model for an accelerator,
   c(B, k) = max(1, B k / C_hw), where C_hw is the number of query tokens a forward absorbs before it turns
   compute-bound (``--capacity``, a few hundred for a 7-8B model on one H100/H200 at fp16/bf16);
3. the generation share g of a GRPO step (``--share``) and an engine overhead per step (``--overhead``).

With N_t = clamp(floor(C_hw / B) - 1, 0, N_max) nodes per row (SPEC 2.2), it reports
generation speedup S_gen = tau(N_t) / (c(B, 1 + N_t) (1 + overhead)) and end-to-end speedup
S_e2e = 1 / ((1 - g) + g / S_gen) (Amdahl), as a table and a PNG. Larger models accept as well or better
than our 0.9M-parameter policy (SpecRoll and NeMo-RL report tau 2.5-3.5 at 7-8B), so using our tau is a
conservative choice; ``--tau-scale`` explores that.

  python scripts/cost_model.py --measure --model tiny          # measure tau(N) and the CPU cost curve here
  python scripts/cost_model.py --capacity 256 --share 0.7      # project onto an accelerator
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "cost_model_measured.json"


@torch.no_grad()
def measure(model_name: str, batch: int, nodes: list[int], max_new_tokens: int, repeats: int) -> dict:
    from specroll_trl import SpeculativeGenerator
    from specroll_trl.adapt.samples import left_pad
    from specroll_trl.experiments import zoo
    from specroll_trl.experiments.zoo import trl_generation_config

    model, tokenizer = zoo.load_policy(model_name, progress=False)
    heads = zoo.load_heads(model_name, progress=False)
    prompts = zoo.task_prompt_ids(tokenizer, zoo.preset_task(model_name), batch, seed=99)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    gc = trl_generation_config(model, tokenizer, max_new_tokens)
    tau = {}
    for n in nodes:  # capacity chosen so that N_t = n at this batch
        engine = SpeculativeGenerator(model, heads, gc, capacity=(n + 1) * batch, max_nodes=n)
        runs = []
        for r in range(repeats):
            torch.manual_seed(r)
            runs.append(engine.generate(ids, mask).stats["tau"])
        tau[n] = statistics.mean(runs)
    cost = {}
    seq = 96
    cache_ids = torch.randint(3, model.config.vocab_size, (1, seq))
    for b in (1, 8, 32, 64):
        for k in (1, 2, 4, 8, 16):
            x = torch.randint(3, model.config.vocab_size, (b, k))
            past = model(cache_ids.expand(b, -1), use_cache=True).past_key_values
            times = []
            for _ in range(5):
                start = time.perf_counter()
                model(x, past_key_values=_copy_cache(past), use_cache=True)
                times.append(time.perf_counter() - start)
            cost[(b, k)] = statistics.median(times)
    relative = {f"{b},{k}": cost[(b, k)] / cost[(b, 1)] for (b, k) in cost}
    return {"model": model_name, "batch_for_tau": batch, "max_new_tokens": max_new_tokens,
            "tau_by_nodes": {str(n): t for n, t in tau.items()}, "cpu_relative_cost": relative,
            "machine": "2-core CPU, torch 2.13 fp32"}


def _copy_cache(past):
    import copy

    return copy.deepcopy(past)


def tau_at(tau_by_nodes: dict[int, float], n: int) -> float:
    """Piecewise-linear in the node count, flat past the largest measured budget."""
    xs = sorted(tau_by_nodes)
    if n <= xs[0]:
        return tau_by_nodes[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if n <= hi:
            return tau_by_nodes[lo] + (tau_by_nodes[hi] - tau_by_nodes[lo]) * (n - lo) / (hi - lo)
    return tau_by_nodes[xs[-1]]


def project(tau_by_nodes, capacity: int, batches, share: float, overhead: float, max_nodes: int,
            tau_scale: float) -> list[dict]:
    rows = []
    for b in batches:
        n = max(0, min(capacity // b - 1, max_nodes))
        tau = 1 + (tau_at(tau_by_nodes, n) - 1) * tau_scale
        c = max(1.0, b * (1 + n) / capacity) / max(1.0, b / capacity)  # relative to a plain step at this batch
        s_gen = tau / (c * (1 + overhead)) if n else 1 / (1 + overhead)
        rows.append({"batch": b, "nodes_per_row": n, "tau": tau, "relative_verify_cost": c,
                     "generation_speedup": s_gen, "e2e_speedup": 1 / ((1 - share) + share / s_gen)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", action="store_true", help="measure tau(N) and the CPU cost curve first")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--capacity", type=int, nargs="+", default=[64, 256, 1024],
                        help="C_hw values to project (query tokens per forward before compute-bound)")
    parser.add_argument("--share", type=float, default=0.7, help="generation share of a GRPO step")
    parser.add_argument("--overhead", type=float, default=0.1, help="engine overhead per step (0.1 = 10%%)")
    parser.add_argument("--max-nodes", type=int, default=16)
    parser.add_argument("--tau-scale", type=float, default=1.0, help="scale (tau - 1), e.g. 1.3 for a larger model")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "cost_model_projection.json"))
    args = parser.parse_args()
    if args.measure:
        data = measure(args.model, batch=8, nodes=[0, 1, 2, 3, 4, 6, 8, 12, 16], max_new_tokens=160, repeats=3)
        MEASURED.write_text(json.dumps(data, indent=1) + "\n")
    data = json.loads(MEASURED.read_text())
    tau_by_nodes = {int(k): v for k, v in data["tau_by_nodes"].items()}
    batches = [1, 8, 16, 32, 64, 128, 256]
    records = []
    print("PROJECTION (not a measurement): tau(N) measured on "
          f"'{data['model']}' here, verify cost from a roofline model, share {args.share}, overhead {args.overhead}")
    print(f"{'C_hw':>6} {'batch':>6} {'N_t':>4} {'tau':>5} {'verify cost':>11} {'gen speedup':>11} {'e2e':>6}")
    for cap in args.capacity:
        for row in project(tau_by_nodes, cap, batches, args.share, args.overhead, args.max_nodes, args.tau_scale):
            records.append({"capacity": cap, **row, "share": args.share, "overhead": args.overhead,
                            "tau_scale": args.tau_scale, "kind": "projection"})
            print(f"{cap:>6} {row['batch']:>6} {row['nodes_per_row']:>4} {row['tau']:5.2f} "
                  f"{row['relative_verify_cost']:11.2f} {row['generation_speedup']:10.2f}x {row['e2e_speedup']:5.2f}x")
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    _plot(records, Path(args.out).with_suffix(".png"), data)
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")


def _plot(records, path, data) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for cap in dict.fromkeys(r["capacity"] for r in records):
        rows = [r for r in records if r["capacity"] == cap]
        ax.plot([r["batch"] for r in rows], [r["generation_speedup"] for r in rows], marker="o",
                label=f"generation, C_hw={cap}")
        ax.plot([r["batch"] for r in rows], [r["e2e_speedup"] for r in rows], ls="--", marker=".",
                label=f"end to end, C_hw={cap}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows generating together")
    ax.set_ylabel("projected speedup")
    ax.set_title(f"PROJECTION from tau(N) measured on '{data['model']}'", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
