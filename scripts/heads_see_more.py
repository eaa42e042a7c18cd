"""Heads that see more, measured before building them into the engine: does a Hydra++ prefix-attention layer, a
wider path-head MLP, or EAGLE-3's fused layers raise the path heads' held-out hit rates and drawn acceptance on
SmolLM2-135M-Instruct at T=1.0?

Every variant starts from fitted T=1.0 path heads (``--start``: the shipped set by default; the 2026-12-04
runs in ``1 - TV`` terms started from ``s10-t10-kl-linear`` of ``scripts/heads_temperature.py``, the set shipped
before the TV-fitted one, the fifth session's top-1 runs from ``s10-t10-kl``) and continues
``--steps`` Adam steps on the same batches of whole training sequences (8 per step, learning rate 3e-4) of the
package's T=1.0 samples, T=1.0 targets, by the recipe's loss (KL + CE + ``--tv-weight`` TV; the fifth session's
top-1 runs had no TV term):

  plain    the heads alone: the control (continued training by itself moves the hit rates)
  prefix   + one decoder layer of the base model's architecture over the target's final hidden states of the
           sequence so far (Hydra++'s prefix attention: causal, rotary positions), initialised from the target's
           last layer with its two output projections at zero (so it starts as the identity); each head reads its
           output in place of ``h_t``
  wide     the path heads' inner layer twice as wide (the fitted head in its first half, so it starts as the
           fitted head)
  fused    EAGLE-3's features: the heads read ``h_t`` plus a learned projection of the hidden states of an early and
           a middle decoder layer (``--fuse-layers``, RMS-normalised), the projection starting at zero (so it starts
           as the fitted heads); those states come from a forward over each batch's sequences

Per head on the 48 held-out GSM8K-test sequences at T=1.0, every 100 steps: top-1 / top-3 hit of the realised token
and the mean ``1 - TV(p, q)`` over the target's stored top-16 (what one child drawn from ``q`` is accepted at, as
``measure_heads`` reports it), with 95% bootstrap intervals over sequences at the last evaluation; against the
control's last evaluation (when ``plain`` ran first, same steps), the paired difference with its interval (both
variants' per-sequence figures resampled together). A variant that does not beat the control is not built into the
library (``benchmarks/README.md`` keeps its numbers).

  for v in plain prefix wide fused; do python scripts/heads_see_more.py $v; done
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from specroll_trl.adapt.distill import hit_rate_intervals
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


class FusedLayers(nn.Module):
    """EAGLE-3's fused features for the heads: ``h_t + W [norm(h_early); norm(h_middle)]``, ``W`` starting at zero."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.fc = nn.Linear(layers * dim, dim, bias=False)
        nn.init.zeros_(self.fc.weight)

    def forward(self, hidden: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """``hidden [N, D]``, ``extra [N, layers, D]``."""
        return hidden + self.fc(F.rms_norm(extra, extra.shape[-1:]).flatten(-2))


@torch.no_grad()
def stream_layer_states(model, stream, pairs, layers, path: Path) -> torch.Tensor:
    """``[N, len(layers), D]`` (bf16): the output of the ``k``-th decoder layer (``hidden_states[k]``, before the final
    norm) for each ``k`` of ``layers`` at every position of ``stream``, whose sequences are ``pairs`` sorted by length;
    cached at ``path``. Only the layers up to ``max(layers) + 1`` run (the last entry of ``hidden_states`` is
    normed)."""
    if path.is_file():
        return load_file(path)["states"]
    ordered = sorted(pairs, key=lambda pair: len(pair[0]) + len(pair[1]))  # as build_stream lists them
    if not torch.equal(stream.ids, torch.tensor([t for p, c in ordered for t in p[-1:] + c])):
        raise SystemExit("the stream's sequences are not these samples sorted by length")
    every_layer = model.model.layers
    model.model.layers = every_layer[: max(layers) + 1]
    out = []
    try:
        for i in tqdm(range(0, len(ordered), 8), desc=f"layers {layers}"):
            batch_pairs = ordered[i : i + 8]
            width = max(len(p) + len(c) for p, c in batch_pairs)
            ids = torch.zeros(len(batch_pairs), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, (p, c) in enumerate(batch_pairs):
                ids[j, : len(p) + len(c)], mask[j, : len(p) + len(c)] = torch.tensor(p + c), 1
            states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                           logits_to_keep=1).hidden_states
            stacked = torch.stack([states[k] for k in layers], dim=2).bfloat16()
            out.extend(stacked[j, len(p) - 1 : len(p) + len(c)] for j, (p, c) in enumerate(batch_pairs))
    finally:
        model.model.layers = every_layer
    states = torch.cat(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"states": states}, path)
    return states


def spans_of(stream) -> list[tuple[int, int]]:
    ends = torch.unique(stream.seq_end)
    return list(zip(torch.cat([ends.new_zeros(1), ends[:-1]]).tolist(), ends.tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=["plain", "prefix", "wide", "fused"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tv-weight", type=float, default=onpolicy_heads.onpolicy_distill_config().tv_weight,
                        help="weight of TV(p, q) beside KL + CE in the loss (the recipe's by default)")
    parser.add_argument("--layer-lr", type=float, default=1e-4, help="the prefix layer's learning rate")
    parser.add_argument("--fuse-layers", type=int, nargs="+", default=[2, 15],
                        help="the decoder layers whose outputs the fused variant reads beside the final hidden state")
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
    fused = FusedLayers(held.hidden.shape[1], len(args.fuse_layers)) if args.variant == "fused" else None
    layers = {}
    if fused is not None:
        tag = "-".join(map(str, args.fuse_layers))
        layers = {id(stream): stream_layer_states(model, stream, samples[name], args.fuse_layers,
                                                  work / f"layers_{tag}_{stem}.safetensors")
                  for stream, name, stem in ((train, "train", f"train_s10_t10_{len(samples['train'])}"),
                                             (held, "heldout", "heldout_s10_t10"))}
    if args.variant == "wide":
        heads.heads = nn.ModuleList(WidePathHead(h) for h in heads.heads)

    def records(stream, spans):
        """The head records of every anchor of ``spans``, ``hidden`` replaced by the prefix layer's or the fused
        layers' output."""
        width = max(e - s for s, e in spans)
        hidden = torch.zeros(len(spans), width, stream.hidden.shape[1])
        valid = torch.zeros(len(spans), width, dtype=torch.bool)
        for i, (s, e) in enumerate(spans):
            hidden[i, : e - s], valid[i, : e - s] = stream.hidden[s:e], True
        seen = (prefix(hidden, valid) if prefix is not None else hidden)[valid]
        index = torch.cat([torch.arange(s, e) for s, e in spans])
        anchor = stream.anchor_ok[index]
        batch = stream.records(index[anchor], heads.num_heads)
        if fused is not None:
            seen = fused(seen, layers[id(stream)][index].float())
        batch.hidden = seen[anchor]
        return batch

    @torch.no_grad()
    def hit_rates(intervals: bool = False):
        """Top-1 and top-3 hit and ``1 - TV`` per head, in percent (and their intervals)."""
        heads.eval()
        spans = spans_of(held)
        hits, counts = torch.zeros(len(spans), 3, heads.num_heads), torch.zeros(len(spans), heads.num_heads)
        for i in range(0, len(spans), 8):
            numbers = list(range(i, min(i + 8, len(spans))))
            batch = records(held, spans[i : i + 8])
            logits = projection(heads(batch.hidden, embed(batch.path))).float()
            match = projection.target_ids(logits.topk(3, dim=-1).indices) == batch.tokens[..., None]
            index = projection.index_of(batch.target_ids)
            q_at = torch.softmax(logits, dim=-1).gather(-1, index.clamp(min=0)) * (index >= 0)
            overlap = torch.minimum(batch.target_probs.float(), q_at).sum(-1)
            per_anchor = torch.stack([match[..., :1].any(-1), match.any(-1), overlap], 1) * batch.valid[:, None]
            lengths = [int(held.anchor_ok[s:e].sum()) for s, e in spans[i : i + 8]]
            sequence = torch.repeat_interleave(torch.tensor(numbers), torch.tensor(lengths))
            hits.index_add_(0, sequence, per_anchor.float())
            counts.index_add_(0, sequence, batch.valid.float())
        heads.train()
        rates = [[round(v, 1) for v in row] for row in (100 * hits.sum(0) / counts.sum(0)).tolist()]
        if not intervals:
            return rates
        return rates, {"hits": hits, "counts": counts}

    def percent_intervals(hits, counts):
        """Per metric and head, the 95% bootstrap interval over sequences of ``hits / counts``, in percent."""
        return [[[round(100 * v, 1) for v in pair]
                 for pair in hit_rate_intervals({"hits": hits[:, m], "counts": counts})] for m in range(3)]

    groups = [{"params": heads.parameters(), "lr": 3e-4}]
    if prefix is not None:
        groups.append({"params": prefix.parameters(), "lr": args.layer_lr})
    if fused is not None:
        groups.append({"params": fused.parameters(), "lr": 3e-4})
    optimizer = torch.optim.Adam(groups)
    spans, generator = spans_of(train), torch.Generator().manual_seed(0)
    log = {"variant": args.variant, "start": args.start, "steps": args.steps, "layer_lr": args.layer_lr,
           "tv_weight": args.tv_weight,
           "fuse_layers": args.fuse_layers, "metrics": ["top-1", "top-3", "1-TV"], "evals": [[0, hit_rates()]]}
    out = Path(args.out) / f"{args.variant}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    heads.train()
    for step in range(1, args.steps + 1):
        pick = torch.randint(len(spans), (8,), generator=generator).tolist()
        loss = head_fit_loss(heads, projection, records(train, [spans[i] for i in pick]), embed,
                             tv_weight=args.tv_weight).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == args.steps:
            if step == args.steps:
                rates, per_sequence = hit_rates(intervals=True)
                log["intervals"] = percent_intervals(per_sequence["hits"], per_sequence["counts"])
                log["per_sequence"] = {k: v.tolist() for k, v in per_sequence.items()}
                control = out.parent / "plain.json"
                if args.variant != "plain" and control.is_file():  # paired: the same sequences, resampled together
                    plain = json.loads(control.read_text())
                    if plain["steps"] == args.steps and "per_sequence" in plain:
                        log["minus_plain"] = [[round(a - b, 2) for a, b in zip(x, y)]
                                              for x, y in zip(rates, plain["evals"][-1][1])]
                        log["minus_plain_intervals"] = percent_intervals(
                            per_sequence["hits"] - torch.tensor(plain["per_sequence"]["hits"]), per_sequence["counts"])
                        print(f"{args.variant} - plain, top-1 / top-3 / 1-TV per head: {log['minus_plain']} "
                              f"95% paired intervals {log['minus_plain_intervals']}", flush=True)
            else:
                rates = hit_rates()
            log["evals"].append([step, rates])
            print(f"{args.variant} step {step} ({time.time() - start:.0f} s): top-1 / top-3 / 1-TV per head "
                  f"{rates}", flush=True)
            out.write_text(json.dumps(log, indent=1) + "\n")


if __name__ == "__main__":
    main()
