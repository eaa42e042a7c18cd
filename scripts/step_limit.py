"""What a verification forward costs against what reading the weights costs, on this machine.

For SmolLM2-135M-Instruct after a 200-token prefix: the time to read every weight once (the bandwidth limit of a
decoding step), and the forward over k = 1, 2, 3, 5, 9, 17 query tokens at 1 and 8 rows, split into the decoder
layers, the verification ``lm_head`` and the rest (embedding, final norm, mask and cache work), each with the
model's own kernels (``F.linear``) and with every linear layer through oneDNN-packed weights (``engine.kernels``);
beside each forward, its linear layers alone (every weight of the model in turn, from memory, at the forward's
query rows) and the compute floor (its multiply-adds at the rate a large GEMM reaches on these threads): a forward
costs at least the larger of the read and the compute floor. Medians of ``--repeats``, the kernels alternated.
Writes JSON and a PNG (ms against k, the two floors drawn).

  python scripts/step_limit.py --threads 1 2 --out benchmarks/step_limit_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from specroll_trl.engine.attention import grouped_attention
from specroll_trl.engine.kernels import LinearKernels, rows_bucket, siblings_shape
from specroll_trl.experiments.zoo import load_policy

PREFIX = 200
QUERY_TOKENS = (1, 2, 3, 5, 9, 17)


def read_weights_ms(model, repeats: int) -> float:
    """Milliseconds to read every parameter once (a reduction over each: the bytes a decoding step must stream)."""
    weights = [p.detach() for p in model.parameters()]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            w.sum()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def gemm_gflops(repeats: int) -> float:
    """Multiply-add rate (GFLOP/s) of a large float32 GEMM on the current threads: the compute ceiling."""
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 512 * 1024 * 1024 / statistics.median(times) / 1e9


def linears_ms(model, kernels: LinearKernels, rows: int, repeats: int) -> dict:
    """Every linear layer of the model once, in model order, on ``rows`` query rows: F.linear against packed."""
    from torch.nn import functional as F

    from specroll_trl.engine.kernels import packed_linear

    layers = [(m.weight.detach(), torch.randn(rows, m.in_features)) for m in kernels.modules]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 3) for w, _ in layers]
    runs = {"f_linear": lambda: [F.linear(x, w) for w, x in layers],
            "packed": lambda: [packed_linear(x, p, None) for (_, x), p in zip(layers, packed)]}
    times = {kind: [] for kind in runs}
    for _ in range(repeats + 1):
        for kind, run in runs.items():
            start = time.perf_counter()
            run()
            times[kind].append(time.perf_counter() - start)
    return {kind: 1e3 * statistics.median(t[1:]) for kind, t in times.items()}


class Split:
    """Wall time of the decoder layers and of the lm_head inside each forward (hooks on the first and last layer)."""

    def __init__(self, model):
        self.marks: dict[str, float] = {}
        layers = model.model.layers
        mark = self.marks.__setitem__
        layers[0].register_forward_pre_hook(lambda *a: mark("layers_in", time.perf_counter()))
        layers[-1].register_forward_hook(lambda *a: mark("layers_out", time.perf_counter()))
        head = model.get_output_embeddings()
        head.register_forward_pre_hook(lambda *a: mark("head_in", time.perf_counter()))
        head.register_forward_hook(lambda *a: mark("head_out", time.perf_counter()))


def forward_ms(model, split: Split, kernels: LinearKernels, rows: int, k: int, repeats: int) -> dict:
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (rows, PREFIX)), cache=cache, use_cache=True)
    query = torch.randint(0, vocab, (rows, k))
    mask = torch.zeros(rows, 1, k, PREFIX + k)
    mask[..., PREFIX:] = torch.triu(torch.full((k, k), torch.finfo(torch.float32).min), 1)
    position = torch.arange(PREFIX, PREFIX + k)[None].expand(rows, -1)
    result = {}
    runs = {False: [], True: []}
    with torch.no_grad(), kernels.active():
        for _ in range(repeats + 1):  # the first of each is a warm-up
            for packed in (False, True):
                # siblings (learnt in the warm-up forward) packed as one product, as the engine runs them
                kernels.choice.update({(siblings_shape(unit), rows_bucket(rows * k)): packed
                                       for unit in kernels.units()})
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, :PREFIX], layer.values[:, :, :PREFIX]
                with kernels.forward(rows * k), grouped_attention(model):
                    start = time.perf_counter()
                    model(input_ids=query, position_ids=position, attention_mask=mask, cache=cache, use_cache=True)
                    end = time.perf_counter()
                m = split.marks
                runs[packed].append((end - start, m["layers_out"] - m["layers_in"], m["head_out"] - m["head_in"]))
    linears = linears_ms(model, kernels, rows * k, repeats)
    for packed, times in runs.items():
        total, layers, head = (1e3 * statistics.median(t[i] for t in times[1:]) for i in range(3))
        kind = "packed" if packed else "f_linear"
        result[kind] = {"total_ms": total, "decoder_layers_ms": layers, "lm_head_ms": head,
                        "rest_ms": total - layers - head, "linears_alone_ms": linears[kind]}
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    keys = sorted({(c["threads"], c["rows"]) for c in cells})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (threads, rows) in zip(axes[0], keys):
        mine = [c for c in cells if c["threads"] == threads and c["rows"] == rows]
        ks = [c["k"] for c in mine]
        for kernel, style in (("f_linear", "o-"), ("packed", "s-")):
            ax.plot(ks, [c[kernel]["total_ms"] for c in mine], style, label=f"forward, {kernel}")
            ax.plot(ks, [c[kernel]["lm_head_ms"] for c in mine], style, alpha=0.4, label=f"lm_head, {kernel}")
        limit = report["read_weights_ms"][str(threads)]
        ax.axhline(limit, color="k", ls="--", label="read every weight once")
        ax.plot(ks, [c["compute_floor_ms"] for c in mine], "k:", label="multiply-adds at large-GEMM rate")
        ax.plot(ks, [c["packed"]["linears_alone_ms"] for c in mine], "^-", alpha=0.6,
                label="linears alone, packed")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_title(f"{rows} row(s), {threads} thread(s)")
        ax.set_xlabel("query tokens per row")
        ax.set_ylabel("ms")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/step_limit_smollm2.json")
    args = parser.parse_args()
    model, _ = load_policy("smollm2-135m", progress=False)
    split, kernels = Split(model), LinearKernels(model)
    params = sum(m.weight.numel() for m in kernels.modules)  # multiply-adds per query row (the linears')
    report = {"model": "smollm2-135m", "prefix": PREFIX, "read_weights_ms": {}, "gemm_gflops": {}, "cells": [],
              "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6}
    for threads in args.threads:
        torch.set_num_threads(threads)
        report["read_weights_ms"][str(threads)] = read_weights_ms(model, 3 * args.repeats)
        report["gemm_gflops"][str(threads)] = gflops = gemm_gflops(3 * args.repeats)
        print(f"{threads} thread(s): reading {report['weights_mb']:.0f} MB of weights takes "
              f"{report['read_weights_ms'][str(threads)]:.1f} ms; a large GEMM runs at {gflops:.0f} GFLOP/s",
              flush=True)
        for rows in args.rows:
            for k in QUERY_TOKENS:
                cell = {"threads": threads, "rows": rows, "k": k, "compute_floor_ms": 2e-6 * params * rows * k / gflops,
                        **forward_ms(model, split, kernels, rows, k, args.repeats)}
                report["cells"].append(cell)
                parts = [f"{kind} {c['total_ms']:6.1f} ms (layers {c['decoder_layers_ms']:5.1f}, lm_head "
                         f"{c['lm_head_ms']:5.1f}, rest {c['rest_ms']:4.1f}; linears alone "
                         f"{c['linears_alone_ms']:5.1f})"
                         for kind, c in (("F.linear", cell["f_linear"]), ("packed", cell["packed"]))]
                floor = f"compute floor {cell['compute_floor_ms']:5.1f} ms"
                print(f"  rows {rows} k {k:2d}: {floor} | " + " | ".join(parts), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
