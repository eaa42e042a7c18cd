"""Head distillation: fit speculative heads to the policy's own samples (backbone frozen).

The policy samples completions at the rollout temperature; one forward over each sequence gives the
final hidden states ``h_t`` and, through the shared ``lm_head``, the target's distribution at every
position. Head ``k`` at anchor ``t`` is trained towards the target's distribution of ``x_{t+1+k}``
(computed at position ``t+k``) with a KL term plus cross-entropy on the realised token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..engine.heads import SpeculativeHeads, lm_head_of


@dataclass
class HeadDistillConfig:
    """Self-distillation settings.

    Each field's ``help`` says what it does.
    """

    num_heads: int = field(default=4, metadata={"help": "heads to build when none are given."})
    num_layers: int = field(default=1, metadata={"help": "residual blocks per head."})
    num_samples: int = field(
        default=512, metadata={"help": "completions sampled from the policy (10% held out for hit rates)."})
    max_new_tokens: int = field(default=160, metadata={"help": "completion length cap when sampling."})
    temperature: float = field(
        default=1.0,
        metadata={"help": "rollout temperature; targets are the policy's distributions at this temperature."},
    )
    sample_batch_size: int = field(default=64, metadata={"help": "prompts per sampling call."})
    steps: int = field(default=600, metadata={"help": "optimiser steps."})
    batch_size: int = field(default=1024, metadata={"help": "anchor positions per step."})
    lr: float = field(default=1e-2, metadata={"help": "Adam learning rate."})
    kl_weight: float = field(default=1.0, metadata={"help": "weight of ``KL(p || q_k)``."})
    nll_weight: float = field(default=1.0, metadata={"help": "weight of cross-entropy on the realised token."})
    max_seconds: float | None = field(
        default=None, metadata={"help": "stop training early after this many seconds (``None``: no limit)."})
    heldout_fraction: float = field(default=0.1, metadata={"help": "share of samples kept for hit rates."})
    seed: int = field(default=0, metadata={"help": "seeds sampling and batching."})
    hit_ks: tuple[int, ...] = field(default=(1, 3, 5), metadata={"help": "the k of the top-k hit rates reported."})

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for self-distillation, got {self.temperature}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        for name in ("num_samples", "steps", "batch_size", "max_new_tokens", "sample_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class TokenStream:
    """Flattened sequences: final hidden states, token ids, and which positions are anchors.

    ``anchor_ok[i]`` marks positions whose next token is a completion token; head ``k`` at anchor ``i``
    is defined when ``i + k + 1`` is still inside the same sequence (``seq_end[i]`` is exclusive).
    """

    hidden: torch.Tensor  # [N, D]
    ids: torch.Tensor  # [N]
    anchor_ok: torch.Tensor  # [N] bool
    seq_end: torch.Tensor  # [N]

    def targets(self, anchors: torch.Tensor, num_heads: int):
        """Per (anchor, head): target position ``t+k``, realised token ``x_{t+1+k}``, validity mask."""
        k = torch.arange(1, num_heads + 1)
        pos = anchors[:, None] + k[None, :]
        valid = (pos + 1) < self.seq_end[anchors][:, None]
        pos = torch.where(valid, pos, anchors[:, None])
        token = self.ids[torch.where(valid, pos + 1, anchors[:, None])]
        return pos, token, valid


@torch.no_grad()
def sample_sequences(model, prompt_ids: list[list[int]], config: HeadDistillConfig, pad_token_id: int,
                     progress: bool = True) -> list[tuple[list[int], list[int]]]:
    """``(prompt, completion)`` id pairs sampled from the policy at ``config.temperature``."""
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    out: list[tuple[list[int], list[int]]] = []
    torch.manual_seed(config.seed)
    device = next(model.parameters()).device
    for i in tqdm(range(0, len(prompt_ids), config.sample_batch_size), desc="sampling policy", disable=not progress):
        chunk = prompt_ids[i : i + config.sample_batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        seqs = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=config.temperature, top_k=0,
            top_p=1.0, max_new_tokens=config.max_new_tokens, pad_token_id=pad_token_id,
        )[:, width:].tolist()
        for p, c in zip(chunk, seqs):
            cut = next((j + 1 for j, t in enumerate(c) if t in eos), len(c))
            out.append((p, c[:cut]))
    return out


@torch.no_grad()
def build_stream(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 32) -> TokenStream:
    """Run the frozen policy over each sequence and keep its final hidden states."""
    device = next(model.parameters()).device
    hidden, ids, anchor_ok, seq_end = [], [], [], []
    offset = 0
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        width = max(len(p) + len(c) for p, c in chunk)
        batch = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(batch)
        for j, (p, c) in enumerate(chunk):
            batch[j, : len(p) + len(c)] = torch.tensor(p + c)
            mask[j, : len(p) + len(c)] = 1
        h = model(input_ids=batch, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        for j, (p, c) in enumerate(chunk):
            n = len(p) + len(c)
            hidden.append(h[j, :n].float().cpu())
            ids.append(batch[j, :n].cpu())
            ok = torch.zeros(n, dtype=torch.bool)
            ok[len(p) - 1 : n - 1] = True
            anchor_ok.append(ok)
            seq_end.append(torch.full((n,), offset + n))
            offset += n
    return TokenStream(torch.cat(hidden), torch.cat(ids), torch.cat(anchor_ok), torch.cat(seq_end))


def head_losses(heads: SpeculativeHeads, lm_head, stream: TokenStream, anchors: torch.Tensor,
                temperature: float, kl_weight: float, nll_weight: float) -> torch.Tensor:
    """Per-head mean of ``kl_weight * KL(p || q_k) + nll_weight * CE(x_{t+1+k})`` over valid anchors."""
    device = lm_head.weight.device
    pos, token, valid = stream.targets(anchors, heads.num_heads)
    h = stream.hidden[anchors].to(device)
    with torch.no_grad():
        target_logp = torch.log_softmax(lm_head(stream.hidden[pos].to(device)).float() / temperature, dim=-1)
    logq = torch.log_softmax(heads.logits(h, lm_head).float(), dim=-1)
    kl = (target_logp.exp() * (target_logp - logq)).sum(-1)
    nll = -logq.gather(-1, token.to(device)[..., None]).squeeze(-1)
    per = (kl_weight * kl + nll_weight * nll) * valid.to(device)
    return per.sum(0) / valid.sum(0).clamp(min=1).to(device)


@torch.no_grad()
def head_hit_rates(heads: SpeculativeHeads, lm_head, stream: TokenStream, ks=(1, 3, 5),
                   chunk: int = 4096) -> list[dict[int, float]]:
    """Per head, the share of anchors whose realised ``x_{t+1+k}`` is in the head's top-k."""
    anchors = stream.anchor_ok.nonzero().squeeze(-1)
    hits = torch.zeros(heads.num_heads, len(ks))
    counts = torch.zeros(heads.num_heads)
    device = lm_head.weight.device
    for i in range(0, len(anchors), chunk):
        a = anchors[i : i + chunk]
        _, token, valid = stream.targets(a, heads.num_heads)
        top = heads.logits(stream.hidden[a].to(device), lm_head).topk(max(ks), dim=-1).indices.cpu()
        match = top == token[..., None]
        for j, k in enumerate(ks):
            hits[:, j] += (match[..., :k].any(-1) & valid).sum(0)
        counts += valid.sum(0)
    rates = hits / counts.clamp(min=1)[:, None]
    return [{k: float(rates[h, j]) for j, k in enumerate(ks)} for h in range(heads.num_heads)]


def train_heads_on_stream(heads: SpeculativeHeads, lm_head, stream: TokenStream, config: HeadDistillConfig,
                          progress: bool = True) -> dict:
    """Optimise only ``heads``' trainable parameters (LoRA adapters when PEFT-wrapped)."""
    params = [p for p in heads.parameters() if p.requires_grad]
    if not params:
        raise ValueError("heads have no trainable parameters")
    optimizer = torch.optim.Adam(params, lr=config.lr)
    anchors = stream.anchor_ok.nonzero().squeeze(-1)
    gen = torch.Generator().manual_seed(config.seed)
    start = time.time()
    heads.train()
    bar = tqdm(range(config.steps), desc="distilling heads", disable=not progress)
    steps_done, loss = 0, torch.tensor(float("nan"))
    for _ in bar:
        batch = anchors[torch.randint(len(anchors), (config.batch_size,), generator=gen)]
        loss = head_losses(heads, lm_head, stream, batch, config.temperature, config.kl_weight,
                           config.nll_weight).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"head distillation loss became {loss.item()} at step {steps_done}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps_done += 1
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if config.max_seconds is not None and time.time() - start > config.max_seconds:
            break
    heads.eval()
    return {"steps": steps_done, "seconds": time.time() - start, "final_loss": float(loss.detach())}


def distill_heads(model, prompt_ids: list[list[int]], pad_token_id: int, config: HeadDistillConfig | None = None,
                  heads: SpeculativeHeads | None = None, progress: bool = True):
    """Sample the policy on ``prompt_ids``, fit heads, and measure held-out hit rates.

    Returns ``(heads, report)``; ``report["hit_rates"][k-1][j]`` is head ``k``'s top-``j`` hit rate.
    """
    config = config or HeadDistillConfig()
    for p in model.parameters():
        p.requires_grad_(False)
    lm_head = lm_head_of(model)
    if heads is None:
        heads = SpeculativeHeads.from_model(model, num_heads=config.num_heads, num_layers=config.num_layers)
        heads.float()
    heads.check_compatible(model)
    start = time.time()
    pairs = sample_sequences(model, prompt_ids[: config.num_samples], config, pad_token_id, progress)
    n_heldout = max(1, int(len(pairs) * config.heldout_fraction))
    train_stream = build_stream(model, pairs[n_heldout:])
    heldout_stream = build_stream(model, pairs[:n_heldout])
    sampling_seconds = time.time() - start
    report = train_heads_on_stream(heads, lm_head, train_stream, config, progress)
    report.update(
        sampling_seconds=sampling_seconds,
        train_tokens=int(train_stream.anchor_ok.sum()),
        heldout_tokens=int(heldout_stream.anchor_ok.sum()),
        hit_rates=head_hit_rates(heads, lm_head, heldout_stream, config.hit_ks),
        mean_completion_tokens=sum(len(c) for _, c in pairs) / len(pairs),
    )
    return heads, report


def format_hit_table(hit_rates: list[dict[int, float]]) -> str:
    ks = list(hit_rates[0])
    lines = ["head  " + "  ".join(f"top-{k:<3}" for k in ks)]
    for h, rates in enumerate(hit_rates, start=1):
        lines.append(f"{h:>4}  " + "  ".join(f"{100 * rates[k]:5.1f}%" for k in ks))
    return "\n".join(lines)
