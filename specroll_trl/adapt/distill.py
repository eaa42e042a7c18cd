"""Head distillation: fit speculative heads to the policy's own samples (backbone frozen).

The policy samples completions at the rollout temperature; one teacher-forced forward over each sequence (its own
samples, and optionally existing text) gives the final hidden states ``h_t`` and the top-K of the target's
distribution at every completion position, kept once so training never projects through the full vocabulary
again. Head ``k`` at anchor ``t`` is trained towards the target's distribution of ``x_{t+1+k}`` (at position
``t+k``, renormalised on its top-K within the heads' vocabulary) with a KL term plus cross-entropy on the realised
token; path heads also read the input embeddings of the realised ``x_{t+1..t+k}``. With ``draft_vocab_size`` the
heads get a draft vocabulary: the tokens most frequent in those sequences. With a held-out stream (whole
sequences from other prompts) training keeps the heads of the best held-out loss and stops when it stops
improving; hit rates come with a 95% interval from a bootstrap over held-out sequences.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import get_scheduler

from ..engine.generator import eos_ids
from ..engine.heads import HEAD_KINDS, SpeculativeHeads, VocabProjection, lm_head_of
from .records import HeadRecords, head_fit_loss, record_states
from .samples import left_pad

REPORT_FILE = "distill_report.json"
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class HeadDistillConfig:
    """Self-distillation settings.

    Each field's ``help`` says what it does.
    """

    num_heads: int = field(default=4, metadata={"help": "heads to build when none are given."})
    num_layers: int = field(default=1, metadata={"help": "residual blocks per independent head."})
    kind: str = field(default="independent", metadata={
        "help": "kind of new heads: 'independent' (each reads h_t) or 'path' (also the path tokens' embeddings)."})
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
    lr_scheduler_type: str = field(default="constant", metadata={
        "help": "how the learning rate moves over ``steps``, as Trainer's ``lr_scheduler_type`` of that name: "
                "'constant', 'linear' (to zero at the last step) or 'cosine'."})
    kl_weight: float = field(default=1.0, metadata={"help": "weight of ``KL(p || q_k)``."})
    nll_weight: float = field(default=1.0, metadata={"help": "weight of cross-entropy on the realised token."})
    tv_weight: float = field(default=0.0, metadata={
        "help": "weight of ``TV(p, q_k)`` (one minus what a child drawn from the head is accepted at)."})
    max_seconds: float | None = field(
        default=None, metadata={"help": "stop training early after this many seconds (``None``: no limit)."})
    eval_every: int = field(default=0, metadata={
        "help": "steps between held-out evaluations for early stopping (0: none; needs a held-out stream)."})
    patience: int = field(default=4, metadata={
        "help": "stop after this many evaluations without a better held-out loss; the best heads are kept."})
    sampling_max_seconds: float | None = field(
        default=None,
        metadata={"help": "start no new sampling batch after this many seconds (``None``: sample every prompt)."})
    heldout_fraction: float = field(default=0.1, metadata={"help": "share of samples kept for hit rates."})
    seed: int = field(default=0, metadata={"help": "seeds sampling and batching."})
    hit_ks: tuple[int, ...] = field(default=(1, 3, 5), metadata={"help": "the k of the top-k hit rates reported."})
    target_topk: int = field(default=32, metadata={"help": "target probabilities kept per position (top-K)."})
    draft_vocab_size: int = field(
        default=0, metadata={"help": "draft vocabulary of new heads: the most frequent tokens (0: whole vocabulary)."})

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for self-distillation, got {self.temperature}")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        for name in ("num_samples", "steps", "batch_size", "max_new_tokens", "sample_batch_size", "target_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr_scheduler_type not in LR_SCHEDULES:
            raise ValueError(f"lr_scheduler_type must be one of {LR_SCHEDULES}, got {self.lr_scheduler_type!r}")
        if self.target_topk < max(self.hit_ks):
            raise ValueError(f"target_topk ({self.target_topk}) must be >= the largest hit k ({max(self.hit_ks)})")
        for name in ("max_seconds", "sampling_max_seconds"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"kind must be one of {HEAD_KINDS}, got {self.kind!r}")
        if self.eval_every < 0 or self.patience < 1:
            raise ValueError(f"eval_every must be >= 0 and patience >= 1, got {self.eval_every}, {self.patience}")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        weights = {name: getattr(self, name) for name in ("kl_weight", "nll_weight", "tv_weight")}
        if any(w < 0 for w in weights.values()) or not any(weights.values()):
            raise ValueError(f"loss weights must be >= 0 and not all zero, got {weights}")


@dataclass
class TokenStream:
    """Flattened sequences: final hidden states, token ids, which positions are anchors, and the target's top-K.

    ``anchor_ok[i]`` marks positions whose next token is a completion token; head ``k`` at anchor ``i``
    is defined when ``i + k + 1`` is still inside the same sequence (``seq_end[i]`` is exclusive).
    ``top_ids[i]`` / ``top_probs[i]``: the top-K of the target's distribution of token ``i + 1``.
    """

    hidden: torch.Tensor  # [N, D]
    ids: torch.Tensor  # [N]
    anchor_ok: torch.Tensor  # [N] bool
    seq_end: torch.Tensor  # [N]
    top_ids: torch.Tensor  # [N, K]
    top_probs: torch.Tensor  # [N, K]

    def targets(self, anchors: torch.Tensor, num_heads: int):
        """Per (anchor, head): target position ``t+k``, realised token ``x_{t+1+k}``, validity mask."""
        k = torch.arange(1, num_heads + 1)
        pos = anchors[:, None] + k[None, :]
        valid = (pos + 1) < self.seq_end[anchors][:, None]
        pos = torch.where(valid, pos, anchors[:, None])
        token = self.ids[torch.where(valid, pos + 1, anchors[:, None])]
        return pos, token, valid

    def records(self, anchors: torch.Tensor, num_heads: int) -> HeadRecords:
        """The head-training records of ``anchors`` (path tokens ``ids[t+1..t+H]``, clamped to the stream; what
        runs past a sequence's end is masked by ``valid``)."""
        pos, token, valid = self.targets(anchors, num_heads)
        path = self.ids[(anchors[:, None] + torch.arange(1, num_heads + 1)).clamp(max=len(self.ids) - 1)]
        return HeadRecords(hidden=self.hidden[anchors], path=path, target_ids=self.top_ids[pos],
                           target_probs=self.top_probs[pos], tokens=token, valid=valid)


@torch.no_grad()
def sample_sequences(model, prompt_ids: list[list[int]], config: HeadDistillConfig, pad_token_id: int,
                     progress: bool = True) -> list[tuple[list[int], list[int]]]:
    """``(prompt, completion)`` id pairs sampled from the policy at ``config.temperature``."""
    eos = eos_ids(model.generation_config)
    out: list[tuple[list[int], list[int]]] = []
    torch.manual_seed(config.seed)
    device = next(model.parameters()).device
    start = time.time()
    for i in tqdm(range(0, len(prompt_ids), config.sample_batch_size), desc="sampling policy", disable=not progress):
        if config.sampling_max_seconds is not None and out and time.time() - start > config.sampling_max_seconds:
            break
        chunk = prompt_ids[i : i + config.sample_batch_size]
        ids, mask = (t.to(device) for t in left_pad(chunk, pad_token_id))
        width = ids.shape[1]
        seqs = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=config.temperature, top_k=0,
            top_p=1.0, max_new_tokens=config.max_new_tokens, pad_token_id=pad_token_id,
        )[:, width:].tolist()
        for p, c in zip(chunk, seqs):
            cut = next((j + 1 for j, t in enumerate(c) if t in eos), len(c))
            out.append((p, c[:cut]))
    return out


@torch.no_grad()
def build_stream(model, pairs: list[tuple[list[int], list[int]]], temperature: float = 1.0, topk: int = 32,
                 batch_size: int = 8, chunk: int = 2048, progress: bool = False,
                 desc: str = "forward passes") -> TokenStream:
    """Run the frozen policy over each ``(prompt, completion)`` and keep, from the prompt's last token on (every
    position an anchor or a target can be), its final hidden states and the top-``topk`` of its distribution at
    ``temperature``. Sequences are batched by length (little padding), so the stream lists them in that order."""
    device = next(model.parameters()).device
    lm_head = lm_head_of(model)
    hidden, ids, anchor_ok, seq_end, top_ids, top_probs = [], [], [], [], [], []
    offset = 0
    pairs = sorted(pairs, key=lambda pair: len(pair[0]) + len(pair[1]))  # stable: ties keep their order
    for i in tqdm(range(0, len(pairs), batch_size), desc=desc, disable=not progress):
        batch_pairs = pairs[i : i + batch_size]
        width = max(len(p) + len(c) for p, c in batch_pairs)
        batch = torch.zeros((len(batch_pairs), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(batch)
        for j, (p, c) in enumerate(batch_pairs):
            batch[j, : len(p) + len(c)] = torch.tensor(p + c)
            mask[j, : len(p) + len(c)] = 1
        h = model(input_ids=batch, attention_mask=mask, output_hidden_states=True,
                  logits_to_keep=1).hidden_states[-1]
        for j, (p, c) in enumerate(batch_pairs):
            first, end = len(p) - 1, len(p) + len(c)
            n = end - first
            hidden.append(h[j, first:end].float().cpu())
            ids.append(batch[j, first:end].cpu())
            ok = torch.ones(n, dtype=torch.bool)
            ok[-1] = False
            anchor_ok.append(ok)
            seq_end.append(torch.full((n,), offset + n))
            offset += n
            for a in range(first, end, chunk):  # the full-vocabulary projection, once per position, in chunks
                probs = torch.softmax(lm_head(h[j, a : min(end, a + chunk)]).float() / temperature, dim=-1)
                values, index = probs.topk(min(topk, probs.shape[-1]), dim=-1)
                top_ids.append(index.cpu())
                top_probs.append(values.cpu())
    return TokenStream(hidden=torch.cat(hidden), ids=torch.cat(ids), anchor_ok=torch.cat(anchor_ok),
                       seq_end=torch.cat(seq_end), top_ids=torch.cat(top_ids), top_probs=torch.cat(top_probs))


def draft_vocabulary(stream: TokenStream, size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` tokens most frequent in ``stream`` (its tokens and the target's top-1 predictions), plus
    ``always`` (e.g. the eos ids); fewer when the stream has fewer distinct tokens."""
    seen = torch.cat([stream.ids, stream.top_ids[:, 0], stream.ids.new_tensor(always)])
    counts = torch.bincount(seen)
    counts[stream.ids.new_tensor(always)] = counts.max() + 1
    order = counts.argsort(descending=True, stable=True)
    return order[: min(size, int((counts > 0).sum()))].sort().values


def head_losses(heads: SpeculativeHeads, projection: VocabProjection, stream: TokenStream, anchors: torch.Tensor,
                config: HeadDistillConfig, embed=None) -> torch.Tensor:
    """Per-head fit loss (:func:`records.head_fit_loss`, weighted as ``config`` says) of ``anchors`` of ``stream``."""
    weight = projection.lm_head.weight
    records = stream.records(anchors, heads.num_heads).to(weight.device, next(heads.parameters()).dtype)
    return head_fit_loss(heads, projection, records, embed, config.kl_weight, config.nll_weight, config.tv_weight)


@torch.no_grad()
def sequence_hits(heads: SpeculativeHeads, projection: VocabProjection, stream: TokenStream, ks=(1, 3, 5),
                  chunk: int = 4096, embed=None) -> dict[str, torch.Tensor]:
    """Per sequence of ``stream`` (``S`` of them) and head: ``hits [S, H, len(ks)]`` (anchors whose realised
    ``x_{t+1+k}`` is in the head's top-k), the target's own top-k mass summed there (``mass``, same shape),
    ``accept [S, H]`` (summed ``sum_x min(p(x), q(x))`` over the target's stored top-K: ``1 - TV(p, q)``, what one
    child drawn from ``q`` is accepted at, short of at most the target's mass outside its top-K) and ``counts [S, H]``
    (valid anchors)."""
    anchors = stream.anchor_ok.nonzero().squeeze(-1)
    sequence = torch.unique(stream.seq_end, return_inverse=True)[1]
    num_seq, num_heads = int(sequence.max()) + 1 if len(sequence) else 0, heads.num_heads
    hits = torch.zeros(num_seq, num_heads, len(ks))
    mass = torch.zeros(num_seq, num_heads, len(ks))
    accept = torch.zeros(num_seq, num_heads)
    counts = torch.zeros(num_seq, num_heads)
    for i in range(0, len(anchors), chunk):
        a = anchors[i : i + chunk]
        pos, token, valid = stream.targets(a, num_heads)
        records = stream.records(a, num_heads).to(projection.lm_head.weight.device, next(heads.parameters()).dtype)
        logits = projection(record_states(heads, records, embed)).float()
        top = logits.topk(max(ks), dim=-1).indices
        match = projection.target_ids(top).cpu() == token[..., None]
        index = projection.index_of(records.target_ids)
        q_at = torch.softmax(logits, dim=-1).gather(-1, index.clamp(min=0)) * (index >= 0)
        overlap = torch.minimum(records.target_probs.float(), q_at).sum(-1).cpu()
        cumulative = stream.top_probs[pos].cumsum(-1)
        seq = sequence[a]
        for j, k in enumerate(ks):
            hits[:, :, j].index_add_(0, seq, (match[..., :k].any(-1) & valid).float())
            mass[:, :, j].index_add_(0, seq, cumulative[..., k - 1] * valid)
        accept.index_add_(0, seq, overlap * valid)
        counts.index_add_(0, seq, valid.float())
    return {"hits": hits, "mass": mass, "accept": accept, "counts": counts}


def head_hit_rates(heads: SpeculativeHeads, projection: VocabProjection, stream: TokenStream, ks=(1, 3, 5),
                   chunk: int = 4096, embed=None) -> tuple[list[dict[int, float]], list[dict[int, float]]]:
    """Per head: the share of anchors whose realised ``x_{t+1+k}`` is in the head's top-k, and the target's own
    top-k probability mass there (what any draft of k candidates is accepted at, on average)."""
    per = sequence_hits(heads, projection, stream, ks, chunk, embed)
    return _rates(per, "hits", ks), _rates(per, "mass", ks)


def _rates(per_sequence: dict[str, torch.Tensor], what: str, ks) -> list[dict[int, float]]:
    """Per head and k: ``per_sequence[what]`` summed over sequences, over the valid anchors."""
    value = per_sequence[what].sum(0) / per_sequence["counts"].sum(0).clamp(min=1)[:, None]
    return [{k: float(value[h, j]) for j, k in enumerate(ks)} for h in range(value.shape[0])]


def hit_rate_intervals(per_sequence: dict[str, torch.Tensor], ks=(1, 3, 5), level: float = 0.95,
                       resamples: int = 2000, seed: int = 0) -> list[dict[int, list[float]]]:
    """Per head and k, a ``level`` interval of the hit rate from a bootstrap over whole sequences (anchors of one
    sequence are correlated, so they are resampled together)."""
    hits, counts = per_sequence["hits"], per_sequence["counts"]
    pick = torch.randint(len(counts), (resamples, len(counts)), generator=torch.Generator().manual_seed(seed))
    per_head = hits.dim() == 2  # one figure per head (``accept``), not one per k
    totals = counts[pick].sum(1).clamp(min=1)
    rates = hits[pick].sum(1) / (totals if per_head else totals[..., None])  # [R, H(, len(ks))]
    low, high = rates.quantile((1 - level) / 2, dim=0), rates.quantile((1 + level) / 2, dim=0)
    if per_head:
        return [[float(low[h]), float(high[h])] for h in range(hits.shape[1])]
    return [{k: [float(low[h, j]), float(high[h, j])] for j, k in enumerate(ks)} for h in range(hits.shape[1])]


def train_heads_on_stream(heads: SpeculativeHeads, lm_head, stream: TokenStream, config: HeadDistillConfig,
                          progress: bool = True, embed=None, heldout: TokenStream | None = None) -> dict:
    """Optimise only ``heads``' trainable parameters (LoRA adapters when PEFT-wrapped) for ``config.steps`` steps.
    With ``heldout`` and ``config.eval_every``, the held-out loss is measured every ``eval_every`` steps, the best
    heads are kept, and training stops after ``config.patience`` evaluations without improvement."""
    params = [p for p in heads.parameters() if p.requires_grad]
    if not params:
        raise ValueError("heads have no trainable parameters")
    optimizer = torch.optim.Adam(params, lr=config.lr)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=0,
                              num_training_steps=config.steps)
    anchors = stream.anchor_ok.nonzero().squeeze(-1)
    gen = torch.Generator().manual_seed(config.seed)
    projection = heads.projection(lm_head, config.temperature)  # the heads' own temperature -> the targets'
    early = heldout is not None and config.eval_every > 0
    held_anchors = heldout.anchor_ok.nonzero().squeeze(-1)[:16384] if early else None
    best, evals, since_best = (float("inf"), None, 0), [], 0
    start = time.time()
    heads.train()
    bar = tqdm(range(config.steps), desc="distilling heads", disable=not progress)
    steps_done, loss = 0, torch.tensor(float("nan"))
    for _ in bar:
        batch = anchors[torch.randint(len(anchors), (config.batch_size,), generator=gen)]
        loss = head_losses(heads, projection, stream, batch, config, embed).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"head distillation loss became {loss.item()} at step {steps_done}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        steps_done += 1
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if early and (steps_done % config.eval_every == 0 or steps_done == config.steps):
            value = heldout_loss(heads, projection, heldout, held_anchors, config, embed)
            evals.append([steps_done, value])
            if value < best[0]:
                best, since_best = (value, {k: v.detach().clone() for k, v in heads.state_dict().items()}, 0), 0
            else:
                since_best += 1
            heads.train()
            if since_best >= config.patience:
                break
        if config.max_seconds is not None and time.time() - start > config.max_seconds:
            break
    if best[1] is not None:
        heads.load_state_dict(best[1])
    heads.eval()
    report = {"steps": steps_done, "seconds": time.time() - start, "final_loss": float(loss.detach())}
    if early:
        report.update(heldout_losses=evals, best_heldout_loss=best[0],
                      best_step=next(step for step, value in evals if value == best[0]))
    return report


@torch.no_grad()
def heldout_loss(heads, projection, stream: TokenStream, anchors: torch.Tensor, config: HeadDistillConfig,
                 embed=None, chunk: int = 2048) -> float:
    """Sum over heads of the mean distillation loss on ``anchors`` of a held-out stream."""
    heads.eval()
    total, weight = 0.0, 0
    for i in range(0, len(anchors), chunk):
        a = anchors[i : i + chunk]
        losses = head_losses(heads, projection, stream, a, config, embed)
        total += float(losses.sum()) * len(a)
        weight += len(a)
    return total / max(1, weight)


def draft_vocab_coverage(vocab: torch.Tensor, stream: TokenStream) -> float:
    """Share of ``stream``'s completion tokens (the realised ones after each anchor) inside ``vocab``."""
    tokens = stream.ids[stream.anchor_ok.nonzero().squeeze(-1) + 1]
    return float(torch.isin(tokens, vocab).double().mean())


def distill_from_samples(model, train_pairs: list[tuple[list[int], list[int]]],
                         heldout_pairs: list[tuple[list[int], list[int]]], config: HeadDistillConfig | None = None,
                         heads: SpeculativeHeads | None = None, progress: bool = True,
                         fp16_weights: bool = False) -> tuple[SpeculativeHeads, dict]:
    """Fit heads on ``(prompt, completion)`` pairs already sampled from the policy (``train_pairs``; text may be mixed
    in) and measure them on whole held-out sequences: one teacher-forced forward per sequence
    (:func:`build_stream`), then :func:`distill_on_streams`."""
    config = config or HeadDistillConfig()
    if not train_pairs or not heldout_pairs:
        raise ValueError("head distillation needs at least one training and one held-out sequence")
    start = time.time()
    train_stream = build_stream(model, train_pairs, config.temperature, config.target_topk, progress=progress,
                                desc="targets of the training sequences")
    heldout_stream = build_stream(model, heldout_pairs, config.temperature, config.target_topk)
    heads, report = distill_on_streams(model, train_stream, heldout_stream, config, heads, progress, fp16_weights)
    report.update(stream_seconds=time.time() - start - report["seconds"], heldout_sequences=len(heldout_pairs))
    return heads, report


def distill_on_streams(model, train_stream: TokenStream, heldout_stream: TokenStream,
                       config: HeadDistillConfig | None = None, heads: SpeculativeHeads | None = None,
                       progress: bool = True, fp16_weights: bool = False) -> tuple[SpeculativeHeads, dict]:
    """Fit heads (new ones of ``config.kind``, with a draft vocabulary of the training stream's most frequent
    ``config.draft_vocab_size`` tokens, unless ``heads`` are given) with early stopping on ``heldout_stream``.
    Returns ``(heads, report)``: ``report["hit_rates"][k-1][j]`` is head ``k``'s top-``j`` hit rate on the held-out
    stream, ``report["hit_rate_ci"]`` its 95% interval, ``report["target_mass"]`` the target's own top-``j`` mass
    there, ``report["loss_weights"]`` the loss they were fitted by. ``fp16_weights``: round the fitted weights to fp16
    (as they will be saved) before measuring."""
    config = config or HeadDistillConfig()
    for p in model.parameters():
        p.requires_grad_(False)
    lm_head, embed = lm_head_of(model), model.get_input_embeddings()
    heads = heads if heads is not None else new_heads(model, train_stream, config)
    heads.check_compatible(model)
    if heads.config.temperature is None:  # new heads, or heads of unknown temperature: they learn the targets' own
        heads.config.temperature = config.temperature
    report = train_heads_on_stream(heads, lm_head, train_stream, config, progress, embed, heldout_stream)
    if fp16_weights:
        heads.half().float()
    report.update(kind=heads.config.kind, train_tokens=int(train_stream.anchor_ok.sum()),
                  draft_vocab_size=heads.config.draft_vocab_size,
                  loss_weights={name: getattr(config, f"{name}_weight") for name in ("kl", "nll", "tv")},
                  truncated=report["steps"] < config.steps and "best_step" not in report,
                  **measure_heads(heads, model, heldout_stream, config.hit_ks, config.temperature))
    return heads, report


def new_heads(model, stream: TokenStream, config: HeadDistillConfig) -> SpeculativeHeads:
    """Untrained fp32 heads of ``config.kind`` for ``model``, with a draft vocabulary of ``stream``'s
    ``config.draft_vocab_size`` most frequent tokens (and the eos ids) when that is smaller than the vocabulary."""
    draft_ids = None
    if config.draft_vocab_size and config.draft_vocab_size < lm_head_of(model).weight.shape[0]:
        draft_ids = draft_vocabulary(stream, config.draft_vocab_size, eos_ids(model.generation_config))
    return SpeculativeHeads.from_model(model, num_heads=config.num_heads, num_layers=config.num_layers,
                                       draft_ids=draft_ids, kind=config.kind).float()


def measure_heads(heads: SpeculativeHeads, model, stream: TokenStream, ks=(1, 3, 5),
                  temperature: float | None = None) -> dict:
    """Held-out figures of ``heads`` on ``stream``: ``hit_rates``, their 95% ``hit_rate_ci`` (bootstrap over
    sequences), ``drawn_accept`` per head (mean ``1 - TV(p, q)``, what a child drawn from ``q`` is accepted at) with
    its ``drawn_accept_ci``, the target's own ``target_mass``, ``heldout_tokens`` and the draft vocabulary's coverage
    of the stream's tokens.

    ``temperature``: the one ``stream``'s targets were taken at; ``q`` is then the heads' distribution rescaled to it,
    as the engine drafts at that temperature (``None``: as fitted). Hit rates do not depend on it."""
    projection, embed = heads.projection(lm_head_of(model), temperature), model.get_input_embeddings()
    per_sequence = sequence_hits(heads, projection, stream, ks, embed=embed)
    accept = per_sequence["accept"].sum(0) / per_sequence["counts"].sum(0).clamp(min=1)
    return {
        "hit_rates": _rates(per_sequence, "hits", ks),
        "hit_rate_ci": hit_rate_intervals(per_sequence, ks),
        "drawn_accept": accept.tolist(),
        "drawn_accept_ci": hit_rate_intervals({"hits": per_sequence["accept"], "counts": per_sequence["counts"]}),
        "target_mass": _rates(per_sequence, "mass", ks),
        "heldout_tokens": int(stream.anchor_ok.sum()),
        "draft_vocab_coverage": None if heads.draft_ids is None else draft_vocab_coverage(heads.draft_ids.cpu(),
                                                                                          stream),
    }


def distill_heads(model, prompt_ids: list[list[int]], pad_token_id: int, config: HeadDistillConfig | None = None,
                  heads: SpeculativeHeads | None = None, progress: bool = True,
                  text_pairs: list[tuple[list[int], list[int]]] | None = None):
    """Sample the policy on ``prompt_ids`` (``config.heldout_fraction`` of the samples held out), fit heads
    (:func:`distill_from_samples`) and measure held-out hit rates.

    ``text_pairs``: extra ``(prompt, completion)`` token ids of existing text, teacher-forced into the training
    stream (a forward over text is far cheaper per token than sampling it).
    """
    config = config or HeadDistillConfig()
    if not prompt_ids:
        raise ValueError("head distillation needs at least one prompt")
    start = time.time()
    pairs = sample_sequences(model, prompt_ids[: config.num_samples], config, pad_token_id, progress)
    sampling_seconds = time.time() - start
    n_heldout = max(1, int(len(pairs) * config.heldout_fraction)) if len(pairs) > 1 else 0
    heads, report = distill_from_samples(model, pairs[n_heldout:] + list(text_pairs or []), pairs[:n_heldout] or pairs,
                                         config, heads, progress)
    report.update(
        sampling_seconds=sampling_seconds,
        mean_completion_tokens=sum(len(c) for _, c in pairs) / len(pairs),
        samples=len(pairs),
        truncated=report["truncated"] or len(pairs) < min(len(prompt_ids), config.num_samples),
    )
    return heads, report


def save_distilled(heads: SpeculativeHeads, report: dict, folder) -> None:
    """Write distilled heads and their report (``REPORT_FILE``, JSON) into ``folder``."""
    from pathlib import Path

    heads.save_pretrained(folder)  # adapters only when LoRA-wrapped
    (Path(folder) / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n")


def format_hit_table(hit_rates: list[dict[int, float]], target_mass: list[dict] | None = None,
                     drawn_accept: list[float] | None = None) -> str:
    """Per head: top-k hit rates of the realised token, beside them (when given) the mean ``1 - TV(p, q)`` (what a
    child drawn from the head is accepted at) and the target's own top-k mass (the most a draft of k fixed candidates
    is accepted at, on average)."""
    ks = list(hit_rates[0])
    lines = ["head  " + "  ".join(f"top-{k:<3}" for k in ks) + ("  1-TV " if drawn_accept else "")
             + ("   target top-k mass" if target_mass else "")]
    for h, rates in enumerate(hit_rates, start=1):
        accept = f"  {100 * drawn_accept[h - 1]:5.1f}%" if drawn_accept else ""
        mass = ""
        if target_mass:
            mass = "   " + " / ".join(f"{100 * float(v):.0f}%" for v in target_mass[h - 1].values())
        lines.append(f"{h:>4}  " + "  ".join(f"{100 * rates[k]:5.1f}%" for k in ks) + accept + mass)
    return "\n".join(lines)
