"""Reflex: gradient-free, trajectory-local correction of the heads' proposals (SPEC 2.5).

Head ``d`` at step ``s`` proposed for completion index ``root + d`` from ``z_d``. When that index is committed
(this step or a later one) the verifier knows the target distribution ``p`` there and the realised token.
Through the shared vocabulary projection ``W`` (the ``lm_head`` weight), restricted to a top-K support ``S``:

* distribution error ``r_dist = W_S^T (p_S - q_S)`` (the gradient of ``E_p[log q]`` w.r.t. ``z``);
* coverage error ``r_cov = W_M^T m - (sum m) W_S^T q_S``, ``m`` = target mass on ``p``'s top-K tokens the
  head did not offer as candidates;
* feedback ``f = a r_dist + b r_cov``; memory ``M <- lam M + (1 - lam) f`` per (row, head);
* reliability ``rho <- EMA(cos(M_before, f))``; correction ``z' = z + eta g M`` with
  ``g = clip((rho - rho_min) / (1 - rho_min), 0, 1)`` and ``||eta g M|| <= kappa ||z||``.

That is the SPEC's baseline (``ReflexConfig()``). Both error terms are ``u @ W`` for a vocabulary-space
residual ``u = a (p - q)_S + b (m - (sum m) q_S)``, which the variants reuse:

* ``step="relative"``: the correction is ``kappa g ||z|| M / ||M||`` (sized by ``||z||``, not by ``||M||``);
* ``gate="vocab"`` / ``"open"``: reliability from ``cos(U_before, u)`` in vocabulary space (``U`` = EMA of
  ``u``), or no gate (``g = 1``);
* ``signal="token"``: ``u = onehot(x) - q`` (the cross-entropy gradient of the realised token ``x``);
* ``share_heads``: one memory per row, fed by all its heads (drift is shared by the heads);
* ``num_heads``: only heads ``1..n`` are corrected and fed back (cheaper);
* ``bias``: a vocabulary-level memory: the heads' log-probabilities get ``bias * g * U`` added (renormalised),
  so tokens the target recently wanted and the head under-predicted come back as candidates;
* ``lookup``: a trajectory-local token memory (the row's prompt and committed completion). Head ``d`` is offered
  the token that followed, ``d`` places on, the latest earlier occurrence of the current root (bigram match
  preferred): ``q' = (1 - w) q + w onehot(lookup)``, ``w`` = that (row, head)'s observed lookup hit rate (EMA of
  the feedback: was the looked-up token the realised one). A number being copied comes back as a candidate.
  ``lookup_cyclic`` continues a too-recent match periodically; ``lookup_group`` also searches the rows that share
  the prompt (a GRPO group); ``lookup_chain`` weights deeper heads by conditional hit rates;
* ``calibrate="head"`` / ``"rank"``: per (row, head) [and candidate rank] the tree scores are shifted by
  ``log(EMA p(candidates) / EMA q(candidates))`` (capped at log-prob 0), so a head that is confidently wrong
  gets fewer deep nodes. Changes tree shape, not candidates.

Named combinations: :meth:`ReflexConfig.preset`. State lives per (row, head) for one ``generate`` call only;
everything is vectorised over rows and heads. Reflex only changes proposals, never what the verifier emits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch.nn import functional as F

from ..engine.hooks import StepFeedback, StepHook

STEPS = ("absolute", "relative")
GATES = ("hidden", "vocab", "open")
SIGNALS = ("distribution", "token")
CALIBRATIONS = ("none", "head", "rank")


@dataclass
class ReflexConfig:
    """Reflex parameters. Defaults: the ``"lookup-cyclic"`` variant (it accepted the most in the ablation);
    ``ReflexConfig.preset("baseline")`` is the SPEC 2.5 baseline (hidden-state memory, ``eta=1``, no lookup).

    Args:
        eta: correction step size of the hidden-state memory (0 disables it; the baseline uses 1).
        lam: memory EMA factor (``M <- lam M + (1 - lam) f``).
        rho_min: the gate opens only while the reliability EMA exceeds this.
        rho_decay: EMA factor of the reliability score.
        kappa: bound on the correction norm relative to ``||z||`` (with ``step="relative"``: its size).
        dist_weight: weight ``a`` of the distribution error.
        cov_weight: weight ``b`` of the coverage error.
        support_k: top-K of ``p`` and of ``q`` forming the support ``S``.
        step: ``"absolute"`` (``eta g M``, capped) or ``"relative"`` (``kappa g ||z|| M / ||M||``).
        gate: reliability from cosines in ``"hidden"`` space, in ``"vocab"`` space, or ``"open"`` (``g = 1``).
        signal: ``"distribution"`` (``a r_dist + b r_cov``) or ``"token"`` (``W[x] - W^T q``).
        share_heads: one memory (and reliability) per row, pooled over its heads.
        num_heads: correct only heads ``1..num_heads`` (0: all).
        bias: weight of the vocabulary-level memory added to the heads' log-probabilities (0: off).
        calibrate: ``"none"``, ``"head"`` (one score shift per row and head) or ``"rank"`` (per candidate rank).
        calib_decay: EMA factor of the calibration statistics.
        lookup: offer each head the token the row's own history continues with (see the module docstring).
        lookup_prior: initial hit rate (mixing weight) of the lookup token, per (row, head).
        lookup_decay: EMA factor of the lookup hit rate.
        lookup_ngram: longest key (tokens ending at the root) the lookup matches; the longest match wins, the
            latest among equals.
        lookup_per_length: keep one hit rate per match length (a longer match is usually more reliable).
        lookup_cyclic: when the match is too recent for a continuation ``d`` places on, assume the span from the
            match to the root repeats (period ``root - match``) instead of offering nothing.
        lookup_chain: weight head ``d``'s lookup token by ``min(1, w_d / w_{d-1})`` (its hit rate given the
            previous head's lookup hit, when hits nest as along a copied span), so the lookup path's tree score is
            ``w_d``, not ``w_1 ... w_d``.
        lookup_group: also look up in the other rows of the call that share the row's prompt (GRPO's group of
            ``num_generations`` completions), finished ones included. Reads other rows' committed tokens, so the
            state is per group rather than strictly per trajectory.
        lookup_group_size: sibling rows searched per row (the nearest in batch order), bounding the cost.
        lookup_second: also offer the continuation of the best match whose next token differs from the first's,
            with its own learnt hit rate (own-row lookup only).
    """

    eta: float = 0.0
    lam: float = 0.5
    rho_min: float = 0.2
    rho_decay: float = 0.8
    kappa: float = 0.5
    dist_weight: float = 1.0
    cov_weight: float = 1.0
    support_k: int = 8
    step: str = "absolute"
    gate: str = "hidden"
    signal: str = "distribution"
    share_heads: bool = False
    num_heads: int = 0
    bias: float = 0.0
    calibrate: str = "none"
    calib_decay: float = 0.9
    lookup: bool = True
    lookup_prior: float = 0.3
    lookup_decay: float = 0.8
    lookup_ngram: int = 2
    lookup_per_length: bool = False
    lookup_cyclic: bool = True
    lookup_chain: bool = False
    lookup_group: bool = False
    lookup_group_size: int = 8
    lookup_second: bool = False

    def __post_init__(self):
        if not 0 <= self.lam < 1:
            raise ValueError(f"reflex lam must be in [0, 1), got {self.lam}")
        if not -1 <= self.rho_min < 1:
            raise ValueError(f"reflex rho_min must be in [-1, 1), got {self.rho_min}")
        if not 0 <= self.rho_decay < 1:
            raise ValueError(f"reflex rho_decay must be in [0, 1), got {self.rho_decay}")
        if self.eta < 0 or self.kappa < 0 or self.bias < 0:
            raise ValueError(f"reflex eta, kappa and bias must be >= 0, got {self.eta}, {self.kappa}, {self.bias}")
        if self.support_k < 1:
            raise ValueError(f"reflex support_k must be >= 1, got {self.support_k}")
        if self.num_heads < 0:
            raise ValueError(f"reflex num_heads must be >= 0, got {self.num_heads}")
        if not 0 <= self.lookup_prior <= 1 or not 0 <= self.lookup_decay < 1:
            raise ValueError(f"reflex lookup_prior must be in [0, 1] and lookup_decay in [0, 1), got "
                             f"{self.lookup_prior}, {self.lookup_decay}")
        if self.lookup_group_size < 1:
            raise ValueError(f"reflex lookup_group_size must be >= 1, got {self.lookup_group_size}")
        if self.lookup_ngram < 1:
            raise ValueError(f"reflex lookup_ngram must be >= 1, got {self.lookup_ngram}")
        if not 0 <= self.calib_decay < 1:
            raise ValueError(f"reflex calib_decay must be in [0, 1), got {self.calib_decay}")
        for name, allowed in (("step", STEPS), ("gate", GATES), ("signal", SIGNALS), ("calibrate", CALIBRATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"reflex {name} must be one of {allowed}, got {getattr(self, name)!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> ReflexConfig:
        """A named variant (see ``PRESETS``), optionally with fields overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown reflex preset {name!r}; choose from {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


PRESETS: dict[str, ReflexConfig] = {
    # the SPEC 2.5 baseline and its variants (hidden-state or vocabulary memory, no lookup)
    "baseline": ReflexConfig(eta=1.0, lookup=False, lookup_cyclic=False),
    "open": ReflexConfig(eta=1.0, gate="open", lookup=False),
    "relative": ReflexConfig(eta=1.0, step="relative", kappa=0.1, lookup=False),
    "relative-open": ReflexConfig(eta=1.0, step="relative", kappa=0.1, gate="open", lookup=False),
    "vocab-gate": ReflexConfig(eta=1.0, step="relative", kappa=0.1, gate="vocab", rho_min=0.1, lookup=False),
    "token": ReflexConfig(eta=1.0, signal="token", step="relative", kappa=0.1, gate="open", lookup=False),
    "shared": ReflexConfig(eta=1.0, share_heads=True, step="relative", kappa=0.1, gate="open", lookup=False),
    "bias": ReflexConfig(bias=2.0, gate="open", lookup=False),
    "calib-head": ReflexConfig(calibrate="head", lookup=False),
    "calib-rank": ReflexConfig(calibrate="rank", lookup=False),
    # the token lookup
    "lookup": ReflexConfig(lookup_cyclic=False),
    "lookup-calib": ReflexConfig(lookup_cyclic=False, calibrate="head"),
    "lookup-bias": ReflexConfig(lookup_cyclic=False, bias=2.0, gate="open"),
    "lookup1": ReflexConfig(lookup_cyclic=False, lookup_ngram=1),
    "lookup3": ReflexConfig(lookup_cyclic=False, lookup_ngram=3),
    "lookup3-len": ReflexConfig(lookup_cyclic=False, lookup_ngram=3, lookup_per_length=True),
    "lookup4-len": ReflexConfig(lookup_cyclic=False, lookup_ngram=4, lookup_per_length=True),
    "lookup-cyclic": ReflexConfig(),
    "lookup-chain": ReflexConfig(lookup_chain=True),
    "lookup1-chain": ReflexConfig(lookup_ngram=1, lookup_chain=True),
    "lookup-group": ReflexConfig(lookup_group=True),
    "lookup-second": ReflexConfig(lookup_second=True),
}


class Reflex(StepHook):
    """The Reflex hook; pass it to ``SpeculativeGenerator(..., hooks=[Reflex()])``."""

    def __init__(self, config: ReflexConfig | None = None):
        self.config = config or ReflexConfig()

    @property
    def _uses_vocab_memory(self) -> bool:
        return self.config.gate == "vocab" or self.config.bias > 0

    @property
    def _uses_memory(self) -> bool:
        """Whether the error memory (and its reliability gate) is used at all."""
        return self.config.eta > 0 or self.config.bias > 0

    def start(self, batch_size, num_heads, hidden_size, lm_head):
        c = self.config
        device, dtype = lm_head.weight.device, torch.float32
        self.weight = lm_head.weight
        self.heads = min(c.num_heads or num_heads, num_heads)  # heads corrected and fed back
        state = 1 if c.share_heads else self.heads  # memories per row
        slots = num_heads  # a head's unresolved proposals target distinct indices within the next H
        self.memory = torch.zeros((batch_size, state, hidden_size), device=device, dtype=dtype)
        vocab = lm_head.weight.shape[0] if self._uses_vocab_memory else 0
        self.vocab_memory = torch.zeros((batch_size, state, vocab), device=device, dtype=dtype)
        self.rho = torch.zeros((batch_size, state), device=device, dtype=dtype)
        self.pending_index = torch.full((batch_size, self.heads, slots), -1, device=device, dtype=torch.long)
        self.pending_z = torch.zeros((batch_size, self.heads, slots, hidden_size), device=device, dtype=dtype)
        self.pending_cand = self.pending_score = None
        self.calib = None  # [B, heads, K, 2]: EMA of target and head mass on the candidates of each rank
        self._last_logp = None
        self._gate_sum = self._norm_sum = 0.0
        self._gate_n = self._feedback_n = 0
        self._seconds = 0.0
        self._agree_sum, self._agree_n = 0.0, 0
        self.history = None  # [B, L] prompt (left-padded, pads -1) + completion tokens, -1 where unknown
        self.known = torch.zeros(batch_size, device=device, dtype=torch.long)  # history positions filled
        lengths = c.lookup_ngram if c.lookup_per_length else 1
        self.lookup_rate = torch.full((batch_size, self.heads, lengths), c.lookup_prior, device=device, dtype=dtype)
        self.pending_lookup = torch.full_like(self.pending_index, -1)
        self.pending_lookup_len = torch.zeros_like(self.pending_index)
        self._last_lookup = None
        self.second_rate = torch.full((batch_size, self.heads, 1), c.lookup_prior / 2, device=device, dtype=dtype)
        self.pending_second = torch.full_like(self.pending_index, -1)
        self._second = None
        self._lookup_hits = self._lookup_n = 0

    def observe_prompts(self, input_ids, attention_mask):
        if not self.config.lookup:
            return
        prompt = torch.where(attention_mask.bool(), input_ids, -1)
        self.offset = prompt.shape[1]  # completion index i lives at history position offset + i
        self.history = torch.cat([prompt, torch.full_like(prompt[:, :1], -1).expand(-1, 256)], dim=1).clone()
        if self.config.lookup_group:  # up to lookup_group_size rows sharing the prompt, nearest in index, self first
            group = torch.unique(prompt, dim=0, return_inverse=True)[1]
            order = torch.argsort(group * len(group) + torch.arange(len(group), device=group.device))
            rank = torch.empty_like(order)
            rank[order] = torch.arange(len(order), device=order.device)
            start = torch.searchsorted(group[order], group, right=False)
            stop = torch.searchsorted(group[order], group, right=True) - 1
            k = self.config.lookup_group_size
            offsets = torch.tensor([0] + [o for i in range(1, k + 1) for o in (-i, i)][:k], device=group.device)
            self.siblings = order[torch.minimum(torch.maximum(rank[:, None] + offsets, start[:, None]), stop[:, None])]

    def _record(self, step: StepFeedback):
        """Write this step's root and committed tokens into the rows' histories."""
        width = step.emitted.shape[1]
        need = self.offset + int((step.root_index + step.count).max()) + 1
        if need > self.history.shape[1]:
            grow = max(need - self.history.shape[1], self.history.shape[1])
            self.history = torch.cat([self.history, self.history.new_full((self.history.shape[0], grow), -1)], 1)
        pos = self.offset + step.root_index
        tokens = torch.cat([step.tree.tokens[:, :1], step.emitted], 1)  # root, then this step's tokens
        j = torch.arange(width + 1, device=pos.device)
        write = j[None] <= step.count[:, None]
        self.history[step.rows[:, None].expand(-1, width + 1)[write], (pos[:, None] + j[None])[write]] = tokens[write]
        self.known[step.rows] = pos + step.count + 1

    def _lookup(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, heads]`` the token each head's lookup offers (``-1``: none) and ``[B]`` the match length
        (0-based index into the per-length rates), or ``None`` with one rate for all lengths.

        Sources: the row's own history, and with ``lookup_group`` also every row of the call with the same prompt
        (finished ones included). Longest match wins, then the row's own history, then the latest position."""
        c, n = self.config, self.heads
        if not c.lookup_group:
            return self._lookup_own(rows)
        known = self.known[rows]
        last = (known - 1).clamp(min=0)  # the root's position
        src = self.siblings[rows]  # [B, S] source rows, own row first
        hist = self.history[src]  # [B, S, W]
        width = hist.shape[-1]
        own = src == rows[:, None]
        src_last = torch.where(own, last[:, None], self.known[src] - 1)  # last known position of each source
        pos = torch.arange(width, device=hist.device)
        # match positions: strictly before the root in the own row, with a known successor in the others
        end = torch.where(own, last[:, None], src_last)
        ok = (known > 0)[:, None].expand_as(src)
        row_hist = self.history[rows]
        run = (hist == row_hist.gather(1, last[:, None])[..., None]) & (pos < end[..., None]) & ok[..., None]
        length = run.long()
        for i in range(1, c.lookup_ngram):  # extend the match backwards: hist[j - i] == the row's [last - i]
            key = torch.where(last >= i, row_hist.gather(1, (last - i).clamp(min=0)[:, None])[:, 0], -2)
            run = torch.cat([run[..., :i] & False, run[..., i:] & (hist[..., :-i] == key[:, None, None])], -1)
            length += run
        score = (length * 2 + own[..., None]) * width + pos  # [B, S, W]
        best = score.flatten(1).max(1)
        s_best, j_best = best.indices // width, best.indices % width
        ahead = torch.arange(n, device=hist.device)[None]  # head d looks d places past the match
        own_best = own.gather(1, s_best[:, None])[:, 0]
        if c.lookup_cyclic:  # in the own row: the span from the match to the root repeats
            cyc = ahead % (last - j_best).clamp(min=1)[:, None]
            ahead = torch.where(own_best[:, None], cyc, ahead)
        at = j_best[:, None] + 1 + ahead  # [B, n]
        found = best.values >= 2 * width
        ok = found[:, None] & (at <= src_last.gather(1, s_best[:, None]))
        seq = hist[torch.arange(len(rows), device=rows.device), s_best]  # [B, W]
        offer = torch.where(ok, seq.gather(1, at.clamp(max=width - 1)), -1)
        if not c.lookup_per_length:
            return offer, None
        return offer, ((best.values // width) // 2 - 1).clamp(min=0)

    def _lookup_own(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_lookup`` over the row's own history only (fewer operations)."""
        c, n = self.config, self.heads
        hist = self.history[rows]  # [B, W]
        width = hist.shape[1]
        last = self.known[rows][:, None] - 1  # the root's position; -1 before the first root is recorded
        pos = torch.arange(width, device=hist.device)[None]
        run = (hist == hist.gather(1, last.clamp(min=0))) & (pos < last)
        length = run.long()
        for i in range(1, c.lookup_ngram):  # extend the match backwards: hist[j - i] == hist[last - i]
            key = torch.where(last >= i, hist.gather(1, (last - i).clamp(min=0)), -2)
            run = torch.cat([run[:, :i] & False, run[:, i:] & (hist[:, :-i] == key)], 1)
            length += run
        best = (length * width + pos).max(1)
        j = best.indices[:, None]
        ahead = torch.arange(n, device=hist.device)[None]  # head d looks d places past the match
        if c.lookup_cyclic:  # the span from the match to the root repeats
            ahead = ahead % (last - j).clamp(min=1)
        at = j + 1 + ahead  # [B, n]
        ok = (best.values >= width)[:, None] & (at <= last)
        offer = torch.where(ok, hist.gather(1, at.clamp(max=width - 1)), -1)
        if c.lookup_second:  # the best match continuing differently from the first
            nxt = torch.cat([hist[:, 1:], hist[:, -1:]], 1)
            other = (nxt != nxt.gather(1, j)) & (length > 0)
            best2 = torch.where(other, length * width + pos, -1).max(1)
            at2 = best2.indices[:, None] + 1 + torch.arange(n, device=hist.device)[None]
            ok2 = (best2.values >= width)[:, None] & (at2 <= last)
            self._second = torch.where(ok2, hist.gather(1, at2.clamp(max=width - 1)), -1)
        if not c.lookup_per_length:
            return offer, None
        return offer, (best.values // width - 1).clamp(min=0)

    def gate(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), heads]`` gate of each (row, corrected head)."""
        c = self.config
        rho = self.rho[rows]
        if c.gate == "open":
            g = torch.ones_like(rho)
        else:
            g = ((rho - c.rho_min) / (1 - c.rho_min)).clamp(0, 1)
        return g.expand(-1, self.heads) if c.share_heads else g

    def _state(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        out = tensor[rows]
        return out.expand(-1, self.heads, *out.shape[2:]) if self.config.share_heads else out

    @torch.no_grad()
    def adjust(self, rows, z):
        c = self.config
        if c.eta == 0:
            return z
        start = time.perf_counter()
        n = self.heads
        g = self.gate(rows)
        memory = self._state(self.memory, rows)
        z_head = z[:, :n].float()
        z_norm = z_head.norm(dim=-1, keepdim=True)
        if c.step == "relative":
            step = (c.kappa * g[..., None]) * z_norm * memory / memory.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        else:
            step = c.eta * g[..., None] * memory
            step_norm = step.norm(dim=-1, keepdim=True)
            step = step * (c.kappa * z_norm / step_norm.clamp(min=1e-12)).clamp(max=1.0)
        self._gate_sum += float(g.sum())
        self._norm_sum += float((step.norm(dim=-1) / z_norm.squeeze(-1).clamp(min=1e-12)).sum())
        self._gate_n += g.numel()
        out = z.clone()
        out[:, :n] = (z_head + step).to(z.dtype)
        self._seconds += time.perf_counter() - start
        return out

    @torch.no_grad()
    def adjust_logprobs(self, rows, logp):
        c = self.config
        if c.bias == 0 and c.calibrate == "none" and not c.lookup:
            return logp
        start = time.perf_counter()
        n = self.heads
        head_logp = logp[:, :n]
        if c.bias > 0:
            if c.eta == 0:  # otherwise adjust() already counted the gate
                g = self.gate(rows)
                self._gate_sum += float(g.sum())
                self._gate_n += g.numel()
            else:
                g = self.gate(rows)
            head_logp = torch.log_softmax(head_logp + (c.bias * g[..., None]) * self._state(self.vocab_memory, rows),
                                          dim=-1)
        if c.lookup and self.history is not None:
            offer, match = self._lookup(rows)  # [B, n], [B] or None (one rate for all lengths)
            self._last_lookup = offer, match
            rate = self.lookup_rate[rows]
            rate = rate[..., 0] if match is None else rate.gather(2, match[:, None, None].expand(-1, n, 1))[..., 0]
            if c.lookup_chain and n > 1:
                rate = torch.cat([rate[:, :1], (rate[:, 1:] / rate[:, :-1].clamp(min=1e-6)).clamp(max=1.0)], 1)
            w = (rate * (offer >= 0))[..., None]  # [B, n, 1]
            idx = offer.clamp(min=0)[..., None]
            if self._second is not None:  # mix both offers: (1 - w - w2) q + w e1 + w2 e2
                second = self._second
                w2 = (self.second_rate[rows][..., 0] * (second >= 0))[..., None].clamp(max=(1 - w) / 2)
                idx = torch.cat([idx, second.clamp(min=0)[..., None]], -1)
                w = torch.cat([w, w2], -1)
            keep = 1 - w.sum(-1, keepdim=True)
            # log(keep q + sum_i w_i onehot_i), touching only the looked-up tokens besides the uniform log(keep)
            first = (idx[..., None] == idx[..., None, :]).int().argmax(-1)  # offers naming the same token add up
            boost = torch.zeros_like(w).scatter_add_(-1, first, w).gather(-1, first)
            at = (head_logp.gather(-1, idx).exp() * keep + boost).clamp(min=1e-30).log()
            head_logp = (head_logp + keep.clamp(min=1e-6).log()).scatter(-1, idx, at)
        self._last_logp = head_logp  # scores before calibration: what the head claims
        if c.calibrate != "none" and self.calib is not None:
            stats = self.calib[rows]  # [B, n, K, 2]
            if c.calibrate == "head":
                stats = stats.sum(2, keepdim=True)
            shift = (stats[..., 0].clamp(min=1e-6) / stats[..., 1].clamp(min=1e-6)).log()  # [B, n, K or 1]
            k = self.calib.shape[2]
            top_logp, top_ids = head_logp.topk(k, dim=-1)
            head_logp = head_logp.scatter(-1, top_ids, (top_logp + shift).clamp(max=0.0))
        out = head_logp
        if n < logp.shape[1]:
            out = torch.cat([head_logp, logp[:, n:]], dim=1)
        self._seconds += time.perf_counter() - start
        return out

    @torch.no_grad()
    def feedback(self, step: StepFeedback):
        start = time.perf_counter()
        self._feedback(step)
        self._seconds += time.perf_counter() - start

    def _feedback(self, step: StepFeedback):
        c = self.config
        rows, heads = step.rows, self.heads
        if self.pending_cand is None and step.candidates is not None:
            k = step.candidates.shape[-1]
            self.pending_cand = torch.full((*self.pending_index.shape, k), -1, device=self.pending_index.device,
                                           dtype=torch.long)
            self.pending_score = torch.zeros((*self.pending_index.shape, k), device=self.pending_index.device)
            if c.calibrate != "none":
                self.calib = torch.ones((self.rho.shape[0], heads, k, 2), device=self.pending_index.device)
        if self.history is not None:
            self._record(step)
        # 1. queue this step's proposals (if it drafted): head d proposed index root + d
        if step.z is not None:
            target = step.root_index[:, None] + torch.arange(1, heads + 1, device=rows.device)  # [B, H]
            free = (self.pending_index[rows] < 0).int().argmax(-1)  # [B, H]
            r_idx = rows[:, None].expand(-1, heads)
            h_idx = torch.arange(heads, device=rows.device).expand(len(rows), -1)
            self.pending_index[r_idx, h_idx, free] = target
            if self._uses_memory:
                self.pending_z[r_idx, h_idx, free] = step.z[:, :heads].float()
            if self._uses_memory or self.calib is not None:
                cand = step.candidates[:, :heads]
                self.pending_cand[r_idx, h_idx, free] = cand
                if self.calib is not None and self._last_logp is not None:
                    self.pending_score[r_idx, h_idx, free] = self._last_logp.gather(-1, cand).exp()
            if self._last_lookup is not None:
                self.pending_lookup[r_idx, h_idx, free] = self._last_lookup[0]
                if self._second is not None:
                    self.pending_second[r_idx, h_idx, free] = self._second
                if self._last_lookup[1] is not None:
                    self.pending_lookup_len[r_idx, h_idx, free] = self._last_lookup[1][:, None]
        # 2. resolve every pending proposal whose index was committed this step
        root = step.root_index[:, None, None]
        pending = self.pending_index[rows]  # [B, H, S]
        due = (pending > root) & (pending <= root + step.count[:, None, None])
        if self.config.lookup:
            self._resolve_lookup(step, rows, pending, due)
        if self._uses_memory or self.calib is not None:
            self._resolve(step, rows, pending)
        else:
            self._feedback_n += int(due.sum())
        self.pending_index[rows] = torch.where(due | step.finished[:, None, None], -1, pending)

    def _resolve(self, step: StepFeedback, rows, pending):
        """Memory and calibration feedback, oldest proposal first per (row, head) (the EMAs are sequential)."""
        end = step.root_index + step.count
        order = torch.where(pending >= 0, pending, torch.iinfo(torch.long).max).argsort(-1)
        for s in range(pending.shape[-1]):
            slot = order[..., s]  # [B, H]
            index = pending.gather(-1, slot[..., None]).squeeze(-1)
            due = (index > step.root_index[:, None]) & (index <= end[:, None])
            if not due.any():
                continue
            b, d = due.nonzero(as_tuple=True)
            j = index[b, d] - step.root_index[b] - 1  # position in this step's emitted tokens
            node = step.accepted[b, j]
            p = step.probs[b, node].float()
            orig, sl = rows[b], slot[b, d]
            self._feedback_n += len(b)
            self._update(orig, d, self.pending_z[orig, d, sl], self.pending_cand[orig, d, sl], p,
                         step.emitted[b, j], self.pending_score[orig, d, sl])

    def _resolve_lookup(self, step: StepFeedback, rows, pending, due, second=False):
        """Hit-rate feedback of the lookup: was the token it offered the one the target sampled there."""
        if not second and self._second is not None:
            self._resolve_lookup(step, rows, pending, due, second=True)
        offered = (self.pending_second if second else self.pending_lookup)[rows]  # [B, H, S]
        has = due & (offered >= 0)
        width = step.emitted.shape[1]
        j = (pending - step.root_index[:, None, None] - 1).clamp(0, width - 1)
        token = step.emitted.gather(1, j.flatten(1)).view_as(j)
        hit = has & (offered == token)
        lengths = self.lookup_rate.shape[2]
        if second:
            count, hits = has.sum(-1, keepdim=True), hit.sum(-1, keepdim=True)
            rate, decay = self.second_rate[rows], self.config.lookup_decay
            self.second_rate[rows] = torch.where(count > 0, decay * rate + (1 - decay) * hits / count.clamp(min=1),
                                                 rate)
            return
        if lengths == 1:
            count, hits = has.sum(-1, keepdim=True), hit.sum(-1, keepdim=True)
        else:
            which = F.one_hot(self.pending_lookup_len[rows], lengths).bool()  # [B, H, S, L]
            count, hits = (has[..., None] & which).sum(2), (hit[..., None] & which).sum(2)
        rate, decay = self.lookup_rate[rows], self.config.lookup_decay
        self.lookup_rate[rows] = torch.where(count > 0, decay * rate + (1 - decay) * hits / count.clamp(min=1), rate)
        self._lookup_hits = self._lookup_hits + hits.sum()
        self._lookup_n = self._lookup_n + count.sum()

    def _ema(self, tensor, keys_row, keys_state, values, decay):
        """``tensor[row, state] <- decay * tensor + (1 - decay) * mean(values of that key)`` (keys may repeat)."""
        flat = tensor.view(-1, *tensor.shape[2:])
        key = keys_row * tensor.shape[1] + keys_state
        uniq, inverse = key.unique(return_inverse=True)
        total = torch.zeros((len(uniq), *values.shape[1:]), device=values.device, dtype=values.dtype)
        total.index_add_(0, inverse, values)
        count = torch.zeros(len(uniq), device=values.device, dtype=values.dtype).index_add_(
            0, inverse, torch.ones_like(inverse, dtype=values.dtype))
        mean = total / count.view(-1, *([1] * (values.dim() - 1)))
        flat[uniq] = decay * flat[uniq] + (1 - decay) * mean

    def _update(self, rows, heads, z, candidates, p, token, score):
        """Feedback for ``N`` resolved proposals (row, head, stored ``z [N, D]``, candidates, target ``p``,
        realised token, the candidates' scores when proposed)."""
        c = self.config
        if self.calib is not None:
            target = p.gather(-1, candidates.clamp(min=0)) * (candidates >= 0)
            self._ema(self.calib, rows, heads, torch.stack([target, score], dim=-1), c.calib_decay)
        if not self._uses_memory:
            return
        weight = self.weight.float()
        q = torch.softmax(F.linear(z, weight), dim=-1)
        offered = torch.zeros_like(p, dtype=torch.bool).scatter_(1, candidates.clamp(min=0), candidates >= 0)
        if c.signal == "token":
            u = F.one_hot(token, p.shape[-1]).to(q.dtype) - q
        else:
            k = min(c.support_k, p.shape[-1])
            p_top = torch.zeros_like(p, dtype=torch.bool).scatter_(1, p.topk(k, -1).indices, True)
            support = p_top.clone().scatter_(1, q.topk(k, -1).indices, True)
            missed = p * (p_top & ~offered)
            u = c.dist_weight * (p - q) * support + c.cov_weight * (missed - missed.sum(-1, keepdim=True) * q * support)
        f = u @ weight
        state = torch.zeros_like(heads) if c.share_heads else heads
        if c.gate == "vocab":
            before, new = self.vocab_memory[rows, state], u
        else:
            before, new = self.memory[rows, state], f
        agreement = F.cosine_similarity(before, new, dim=-1)
        agreement = torch.where(before.norm(dim=-1) > 0, agreement, torch.zeros_like(agreement))
        self._agree_sum += float(agreement.sum())
        self._agree_n += len(rows)
        self._ema(self.rho, rows, state, agreement, c.rho_decay)
        self._ema(self.memory, rows, state, f, c.lam)
        if self._uses_vocab_memory:
            self._ema(self.vocab_memory, rows, state, u, c.lam)

    def metrics(self):
        return {
            "reflex_gate": self._gate_sum / max(1, self._gate_n),
            "reflex_norm": self._norm_sum / max(1, self._gate_n),
            "reflex_agreement": self._agree_sum / max(1, self._agree_n),
            "reflex_feedback": float(self._feedback_n),
            "reflex_seconds": self._seconds,
            "reflex_lookup_hit": float(self._lookup_hits) / max(1, int(self._lookup_n)),
        }
