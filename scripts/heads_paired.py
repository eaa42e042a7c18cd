"""Two head sets on the same held-out sequences, compared pairwise: is one's gain more than the sequences' noise?

Each set's per-sequence top-1 hit and ``1 - TV(p, q)`` (``q`` at the stream's temperature, as the engine drafts) on
the plan's 48 held-out GSM8K-test sequences at T=1.0 and at T=0.7 (the streams ``scripts/heads_temperature.py``
caches in ``--work``), and the difference B - A per head with a 95% bootstrap interval over sequences resampled
*together* for both sets (a paired interval: far narrower than comparing two unpaired intervals).

  python scripts/heads_paired.py specroll_trl/experiments/data/heads/smollm2-135m/path \\
      runs/heads_t10/heads/s10-t10-kl-tv-linear --out benchmarks/heads_tv_paired_smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specroll_trl.adapt.distill import hit_rate_intervals, sequence_hits
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.experiments import onpolicy_heads, zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="heads folder A (the reference)")
    parser.add_argument("b", help="heads folder B")
    parser.add_argument("--work", default="runs/heads_t10", help="where the held-out streams are cached")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, _ = zoo.load_policy("smollm2-135m")
    embed = model.get_input_embeddings()
    heads = {name: SpeculativeHeads.from_pretrained(folder, dtype=torch.float32)
             for name, folder in (("a", args.a), ("b", args.b))}
    results = {"a": args.a, "b": args.b}
    for temperature, stem in ((1.0, "heldout_s10_t10"), (0.7, "heldout_s07_t07")):
        stream = onpolicy_heads.read_stream(Path(args.work) / f"{stem}.safetensors")
        per = {name: sequence_hits(h, h.projection(model.get_output_embeddings(), temperature), stream, ks=(1,),
                                   embed=embed) for name, h in heads.items()}
        counts = per["a"]["counts"]
        cell = {}
        for metric, key in (("top-1", "hits"), ("1-TV", "accept")):
            a, b = (per[n][key][..., 0] if key == "hits" else per[n][key] for n in ("a", "b"))
            total = counts.sum(0)
            cell[metric] = {"a": (a.sum(0) / total).tolist(), "b": (b.sum(0) / total).tolist(),
                            "b_minus_a": ((b - a).sum(0) / total).tolist(),
                            "b_minus_a_ci": hit_rate_intervals({"hits": b - a, "counts": counts})}
            print(f"T={temperature} {metric} heads 1-4: A " + " / ".join(f"{100 * v:.1f}" for v in cell[metric]["a"])
                  + "  B " + " / ".join(f"{100 * v:.1f}" for v in cell[metric]["b"]) + "  B-A "
                  + " / ".join(f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]"
                               for d, (lo, hi) in zip(cell[metric]["b_minus_a"], cell[metric]["b_minus_a_ci"])),
                  flush=True)
        results[f"T={temperature}"] = cell
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
