"""Drawn children with or without replacement: which accepts more, on the default policy's held-out sequences?

#34 asked to measure recursive rejection sampling over children drawn from the heads' ``q`` *with* replacement
(SpecInfer: every child an independent draw of ``q``, each checked against the residual left by the ones before)
against drawing them *without* replacement (the engine's rule: each child a draw of ``q`` with the earlier children
removed, as ``engine/drawn.py`` says). Both are lossless; they differ only in how often some child is accepted.

At every anchor of the held-out stream (48 GSM8K-test sequences of the policy's own samples) and for each head
``d`` reading the true path, ``q`` is the shipped path heads' distribution at the stream's temperature over their
draft vocabulary and ``p`` the target's stored top-16 at that temperature (the rest of its mass in one bucket no
child can hit, so the figures are lower bounds by at most that mass). For ``m = 1..4`` children, ``--draws`` child
lists are drawn per anchor under each rule, and each list's exact chance that some child is accepted (the
rejection chain of ``engine.drawn.rank_acceptance``, or its with-replacement twin below) is averaged: the mean
over anchors, with a 95% bootstrap interval over sequences, and the paired difference.

  python scripts/drawn_children_probe.py --out benchmarks/drawn_children_smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specroll_trl.adapt.distill import hit_rate_intervals
from specroll_trl.engine.drawn import TINY, first_accepted, rank_acceptance
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.experiments import onpolicy_heads, zoo


def acceptance_with_replacement(p: torch.Tensor, q: torch.Tensor, children: torch.Tensor) -> torch.Tensor:
    """Each child's acceptance chance once the earlier ones were rejected, every child an independent draw of ``q``:
    ``alpha_i = min(1, p_i(c_i) / q(c_i))``, ``p_{i+1} = norm(max(p_i - q, 0))``."""
    alphas = []
    for r in range(children.shape[-1]):
        at = children[..., r : r + 1]
        alphas.append((p.gather(-1, at) / q.gather(-1, at).clamp(min=TINY)).clamp(max=1.0).squeeze(-1))
        residual = (p - q).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        p = torch.where(mass > 1e-12, residual / mass.clamp(min=TINY), p)
    return torch.stack(alphas, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/heads_t10", help="where the held-out streams are cached")
    parser.add_argument("--draws", type=int, default=16, help="child lists drawn per anchor, rule and width")
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/drawn_children_smollm2.json")
    args = parser.parse_args()
    model, _ = zoo.load_policy("smollm2-135m")
    embed = model.get_input_embeddings()
    heads = SpeculativeHeads.from_pretrained(onpolicy_heads.shipped_folder("smollm2-135m", "path"),
                                             dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    results = {"heads": "shipped path heads", "draws": args.draws, "children": args.children}
    for temperature, stem in ((1.0, "heldout_s10_t10"), (0.7, "heldout_s07_t07")):
        stream = onpolicy_heads.read_stream(Path(args.work) / f"{stem}.safetensors")
        projection = heads.projection(model.get_output_embeddings(), temperature)
        anchors = stream.anchor_ok.nonzero().squeeze(-1)
        sequence = torch.unique(stream.seq_end, return_inverse=True)[1]
        num_seq, m = int(sequence.max()) + 1, args.children
        sums = {rule: torch.zeros(num_seq, heads.num_heads, m) for rule in ("without", "with")}
        counts = torch.zeros(num_seq, heads.num_heads)
        for i in range(0, len(anchors), 64):
            a = anchors[i : i + 64]
            records = stream.records(a, heads.num_heads)
            with torch.no_grad():
                q = torch.softmax(projection(heads(records.hidden, embed(records.path))).float(), -1)  # [n, H, V']
            index = projection.index_of(records.target_ids)
            vocab = q.shape[-1]
            p = torch.zeros(*q.shape[:-1], vocab + 1)  # the last bucket: mass no child can hit
            p.scatter_add_(-1, torch.where(index >= 0, index, vocab), records.target_probs.float())
            p[..., vocab] += (1 - p.sum(-1)).clamp(min=0)
            q = torch.cat([q, torch.zeros(*q.shape[:-1], 1)], -1)
            p, q = (t[:, :, None].expand(-1, -1, args.draws, -1) for t in (p, q))
            gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=generator).clamp(min=TINY)))
            without = (q.clamp(min=TINY).log() + gumbel).masked_fill(q == 0, -torch.inf).topk(m, -1).indices
            with_ = torch.multinomial(q.reshape(-1, vocab + 1), m, replacement=True, generator=generator)
            with_ = with_.reshape(*q.shape[:-1], m)
            for rule, alpha in (("without", rank_acceptance(p, q, without, fixed=0)[0]),
                                ("with", acceptance_with_replacement(p, q, with_))):
                accepted = first_accepted(alpha).cumsum(-1).mean(2)  # [n, H, m]: some child among the first k
                sums[rule].index_add_(0, sequence[a], accepted * records.valid[..., None])
            counts.index_add_(0, sequence[a], records.valid.float())
        cell = {}
        for rule, total in sums.items():
            mean = total.sum(0) / counts.sum(0)[:, None]
            ci = [hit_rate_intervals({"hits": total[:, :, k], "counts": counts}) for k in range(m)]
            cell[rule] = {"mean": mean.tolist(), "ci": [[ci[k][h] for k in range(m)] for h in range(heads.num_heads)]}
        gain = {"hits": sums["without"] - sums["with"], "counts": counts}
        cell["without_minus_with_ci"] = [hit_rate_intervals({"hits": gain["hits"][:, :, k], "counts": counts})
                                         for k in range(m)]
        results[f"T={temperature}"] = cell
        for rule in ("without", "with"):
            rows = [" / ".join(f"{100 * v:.1f}" for v in head) for head in cell[rule]["mean"]]
            print(f"T={temperature} {rule} replacement, heads 1-4, some child of 1..{m} accepted (%): {rows}",
                  flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
