"""Heads that see more, measured before building them into the engine: does a Hydra++ prefix-attention layer, or a
wider path-head MLP, raise the path heads' held-out hit rates on SmolLM2-135M-Instruct at T=1.0?

Every variant starts from fitted T=1.0 path heads (``--start``: the shipped set, ``s10-t10-kl-linear`` of
``scripts/heads_temperature.py``, by default; the prefix variant was measured from ``s10-t10-kl``) and continues
``--steps`` Adam steps on the same batches of whole training sequences (8 per step, learning rate 3e-4) of the
package's T=1.0 samples, T=1.0 targets:

  plain    the heads alone: the control (continued training by itself moves the hit rates)
  prefix   + one decoder layer of the base model's architecture over the target's final hidden states of the
           sequence so far (Hydra++'s prefix attention: causal, rotary positions), initialised from the target's
           last layer with its two output projections at zero (so it starts as the identity); each head reads its
           output in place of ``h_t``
  wide     the path heads' inner layer twice as wide (the fitted head in its first half, so it starts as the
           fitted head)

Top-1 / top-3 hit of the realised token per head on the 48 held-out GSM8K-test sequences at T=1.0, every 100 steps.
A variant that does not beat the control is not built into the library (``benchmarks/README.md`` keeps its numbers).

  for v in plain prefix wide; do python scripts/heads_see_more.py $v; done
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from specroll_trl.adapt.records import head_fit_loss
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.experiments import onpolicy_heads, zoo


class PrefixAttention(nn.Module):
    """One decoder layer of the target's architecture over its final hidden states (causal, rotary), starting as the
    identity: the target's last layer with its attention output and MLP down projections zeroed."""

    def __init__(self, model):
        super().__init__()
        self.layer = type(model.model.layers[-1])(model.config, layer_idx=0)
        self.layer.load_state_dict(model.model.layers[-1].state_dict())
        self.rotary = type(model.model.rotary_emb)(model.config)
        nn.init.zeros_(self.layer.self_attn.o_proj.weight)
        nn.init.zeros_(self.layer.mlp.down_proj.weight)

    def forward(self, hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``hidden [S, L, D]`` right-padded sequences, ``valid [S, L]``."""
        length = hidden.shape[1]
        allowed = torch.ones(length, length, dtype=torch.bool).tril()[None] & valid[:, None, :]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(hidden.dtype).min)[:, None]
        positions = torch.arange(length)[None].expand(hidden.shape[0], -1)
        return self.layer(hidden, attention_mask=mask, position_embeddings=self.rotary(hidden, positions))


class WidePathHead(nn.Module):
    """A fitted path head with an inner layer ``factor`` times as wide, starting as that head."""

    def __init__(self, head, factor: int = 2):
        super().__init__()
        width = head.outer.weight.shape[0]
        self.path_length = head.path_length
        self.inner = nn.Linear(head.inner.in_features, factor * width)
        self.outer = nn.Linear(factor * width, width)
        with torch.no_grad():
            self.inner.weight[:width], self.inner.bias[:width] = head.inner.weight, head.inner.bias
            self.inner.weight[width:].mul_(0.5)
            self.outer.weight.zero_()
            self.outer.weight[:, :width] = head.outer.weight
            self.outer.bias.copy_(head.outer.bias)

    def forward(self, hidden, path=None):
        inputs = torch.cat([hidden, path[..., : self.path_length, :].flatten(-2)], dim=-1)
        return hidden + self.outer(F.silu(self.inner(inputs)))


def spans_of(stream) -> list[tuple[int, int]]:
    ends = torch.unique(stream.seq_end)
    return list(zip(torch.cat([ends.new_zeros(1), ends[:-1]]).tolist(), ends.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=["plain", "prefix", "wide"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layer-lr", type=float, default=1e-4, help="the prefix layer's learning rate")
    parser.add_argument("--start", default=str(onpolicy_heads.shipped_folder("smollm2-135m", "path")),
                        help="the fitted path heads every variant starts from")
    parser.add_argument("--work", default="runs/heads_t10", help="where the T=1.0 streams are cached")
    parser.add_argument("--out", default="runs/heads_see_more")
    args = parser.parse_args()
    torch.manual_seed(0)
    work = Path(args.work)
    model, _ = zoo.load_policy("smollm2-135m")
    model.requires_grad_(False)
    embed = model.get_input_embeddings()
    samples = onpolicy_heads.shipped_samples("smollm2-135m", onpolicy_heads.policy_fingerprint(model))
    if samples is None:
        raise SystemExit("the package's samples do not match this policy")
    topk = onpolicy_heads.onpolicy_distill_config().target_topk
    train, held = (onpolicy_heads.cached_stream(model, samples[name], 1.0, topk, work / f"{stem}.safetensors")
                   for name, stem in (("train", f"train_s10_t10_{len(samples['train'])}"),
                                      ("heldout", "heldout_s10_t10")))
    heads = SpeculativeHeads.from_pretrained(args.start, dtype=torch.float32)
    projection = heads.projection(model.get_output_embeddings(), 1.0)
    prefix = PrefixAttention(model) if args.variant == "prefix" else None
    if args.variant == "wide":
        heads.heads = nn.ModuleList(WidePathHead(h) for h in heads.heads)

    def records(stream, spans):
        """The head records of every anchor of ``spans``, ``hidden`` replaced by the prefix layer's output."""
        width = max(e - s for s, e in spans)
        hidden = torch.zeros(len(spans), width, stream.hidden.shape[1])
        valid = torch.zeros(len(spans), width, dtype=torch.bool)
        for i, (s, e) in enumerate(spans):
            hidden[i, : e - s], valid[i, : e - s] = stream.hidden[s:e], True
        seen = (prefix(hidden, valid) if prefix is not None else hidden)[valid]
        index = torch.cat([torch.arange(s, e) for s, e in spans])
        anchor = stream.anchor_ok[index]
        batch = stream.records(index[anchor], heads.num_heads)
        batch.hidden = seen[anchor]
        return batch

    @torch.no_grad()
    def hit_rates():
        heads.eval()
        hits, counts = torch.zeros(2, heads.num_heads), torch.zeros(heads.num_heads)
        spans = spans_of(held)
        for i in range(0, len(spans), 8):
            batch = records(held, spans[i : i + 8])
            top = projection(heads(batch.hidden, embed(batch.path))).topk(3, dim=-1).indices
            match = projection.target_ids(top) == batch.tokens[..., None]
            hits[0] += (match[..., :1].any(-1) & batch.valid).sum(0)
            hits[1] += (match.any(-1) & batch.valid).sum(0)
            counts += batch.valid.sum(0)
        heads.train()
        return [[round(v, 1) for v in row] for row in (100 * hits / counts).tolist()]

    groups = [{"params": heads.parameters(), "lr": 3e-4}]
    if prefix is not None:
        groups.append({"params": prefix.parameters(), "lr": args.layer_lr})
    optimizer = torch.optim.Adam(groups)
    spans, generator = spans_of(train), torch.Generator().manual_seed(0)
    log = {"variant": args.variant, "start": args.start, "steps": args.steps, "layer_lr": args.layer_lr,
           "evals": [[0, hit_rates()]]}
    out = Path(args.out) / f"{args.variant}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    heads.train()
    for step in range(1, args.steps + 1):
        pick = torch.randint(len(spans), (8,), generator=generator).tolist()
        loss = head_fit_loss(heads, projection, records(train, [spans[i] for i in pick]), embed).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps:
            log["evals"].append([step, hit_rates()])
            print(f"{args.variant} step {step} ({time.time() - start:.0f} s): top-1 / top-3 per head "
                  f"{log['evals'][-1][1]}", flush=True)
            out.write_text(json.dumps(log, indent=1) + "\n")


if __name__ == "__main__":
    main()
