"""Reflex, SpecRoll's fast path: gradient-free corrections of the heads' proposals along each trajectory.

This module owns the Reflex step hooks and their presets. Hooks compose in a list, the way transformers composes
logits processors; ``reflex_hooks(preset, **kwargs)`` builds the lists named in ``REFLEX_PRESETS``:

* :class:`HiddenStateReflex` (``"baseline"``): the baseline formulas of the method, a per-(row, head) memory of
  the heads' errors, added to their hidden states behind a reliability gate;
* :class:`TokenLookup` (``"lookup"``, the default): offers each head the token the row's own history continues
  with; :class:`GroupTokenLookup` (``"lookup-group"``) also searches the rows sharing the prompt (a GRPO group);
* ``"baseline+lookup"``: both, the memory moving ``z``, then the lookup mixing into the scores.

Both learn from delayed feedback (:class:`PendingProposals`). State lives per (row, head) for one ``generate``
call. Both work on either head kind: on independent heads they act on all heads at once, on path-conditioned heads
on each depth's frontier (the lookup's token goes to the frontier node whose path is the lookup's own continuation),
and feedback judges the proposal made at the accepted path's node. Hooks only change proposals: the verifier still
emits exactly what the target samples.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch.nn import functional as F

from ..engine.hooks import DraftSlots, GenerationContext, StepFeedback, StepHook


class PendingProposals:
    """Delayed feedback: head ``d`` (1-based) at a step whose root is completion index ``r`` proposed index ``r + d``;
    it is judged when a step (this one or a later one) commits that index.

    Per (row, head) the waiting proposals target distinct indices within the next ``H``, so ``H`` slots suffice.
    Each slot holds the proposal's target index (``-1``: free) and the payload the hook judges it with
    (``values[name]``: ``[B, H, H, ...]``, allocated at the first ``push``)."""

    def __init__(self, batch_size: int, num_heads: int, device: torch.device):
        self.index = torch.full((batch_size, num_heads, num_heads), -1, device=device, dtype=torch.long)
        self.values: dict[str, torch.Tensor] = {}

    def push(self, step: StepFeedback, **values: torch.Tensor) -> None:
        """Queue the proposals of a step that drafted (those ``step.proposed`` marks); ``values[name]`` is
        ``[B, H, ...]`` over ``step.rows``."""
        rows, heads = step.rows, self.index.shape[1]
        free = (self.index[rows] < 0).int().argmax(-1)  # [B, H]
        r = rows[:, None].expand(-1, heads)
        d = torch.arange(heads, device=rows.device).expand(len(rows), -1)
        target = step.root_index[:, None] + torch.arange(1, heads + 1, device=rows.device)
        proposed = step.proposed if step.proposed is not None else torch.ones_like(target, dtype=torch.bool)
        self.index[r, d, free] = torch.where(proposed, target, self.index[r, d, free])
        for name, value in values.items():
            if name not in self.values:
                self.values[name] = value.new_zeros((*self.index.shape, *value.shape[2:]))
            keep = proposed.view(*proposed.shape, *[1] * (value.dim() - 2))
            self.values[name][r, d, free] = torch.where(keep, value, self.values[name][r, d, free])

    def pop(self, step: StepFeedback) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, due)``, both ``[B, H, H]`` over ``step.rows``: the slots' target indices and which of them this
        step committed. Those slots are freed, and every slot of a finished row (payloads stay readable)."""
        index = self.index[step.rows]
        root = step.root_index[:, None, None]
        due = (index > root) & (index <= root + step.count[:, None, None])
        self.index[step.rows] = torch.where(due | step.finished[:, None, None], -1, index)
        return index, due


class ReflexHook(StepHook):
    """Base of the Reflex hooks: ``name`` ``"reflex"`` (the engine reports their time as ``reflex_seconds``) and a
    config dataclass ``config_class``. ``Hook(config, **overrides)``: ``config`` (default: ``config_class()``) with
    the given fields replaced, e.g. ``TokenLookup(prior=0.5)``."""

    name = "reflex"
    config_class: type

    def __init__(self, config=None, **overrides):
        if config is not None and not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = replace(config or self.config_class(), **overrides)


@dataclass
class HiddenStateConfig:
    """Parameters of :class:`HiddenStateReflex` (defaults: the method's baseline).

    Args:
        eta: correction step size (0: no correction).
        lam: memory EMA factor (``M <- lam M + (1 - lam) f``).
        rho_min: the gate opens only while the reliability EMA exceeds this.
        rho_decay: EMA factor of the reliability.
        kappa: bound on the correction norm relative to ``||z||``.
        dist_weight: weight ``a`` of the distribution error.
        cov_weight: weight ``b`` of the coverage error.
        support_k: top-K of ``p`` and of ``q`` forming the support ``S``.
    """

    eta: float = 1.0
    lam: float = 0.5
    rho_min: float = 0.2
    rho_decay: float = 0.8
    kappa: float = 0.5
    dist_weight: float = 1.0
    cov_weight: float = 1.0
    support_k: int = 8

    def __post_init__(self):
        if not 0 <= self.lam < 1:
            raise ValueError(f"reflex lam must be in [0, 1), got {self.lam}")
        if not -1 <= self.rho_min < 1:
            raise ValueError(f"reflex rho_min must be in [-1, 1), got {self.rho_min}")
        if not 0 <= self.rho_decay < 1:
            raise ValueError(f"reflex rho_decay must be in [0, 1), got {self.rho_decay}")
        if self.eta < 0 or self.kappa < 0:
            raise ValueError(f"reflex eta and kappa must be >= 0, got eta={self.eta}, kappa={self.kappa}")
        if not isinstance(self.support_k, int) or self.support_k < 1:
            raise ValueError(f"reflex support_k must be an int >= 1, got {self.support_k!r}")


class HiddenStateReflex(ReflexHook):
    """The baseline formulas of the method. When head ``d``'s proposal from ``z_d`` is resolved, the verifier knows
    the target distribution ``p`` at its index. With ``q = softmax(W z_d)`` (``W``: the ``lm_head`` weight) and the
    support ``S`` = top-K of ``p`` and of ``q``:

    * distribution error ``r_dist = W_S^T (p_S - q_S)`` (the gradient of ``E_p[log q]`` w.r.t. ``z``);
    * coverage error ``r_cov = W_M^T m - (sum m) W_S^T q_S``, ``m`` = target mass on ``p``'s top-K tokens the
      head did not offer as candidates;
    * feedback ``f = a r_dist + b r_cov``; memory ``M <- lam M + (1 - lam) f`` per (row, head), oldest proposal first;
    * reliability ``rho <- rho_decay rho + (1 - rho_decay) cos(M_before, f)``; correction ``z' = z + eta g M`` with
      gate ``g = clip((rho - rho_min) / (1 - rho_min), 0, 1)``, scaled down so that ``||eta g M|| <= kappa ||z||``.
    """

    config_class = HiddenStateConfig

    def start(self, context: GenerationContext) -> None:
        b, h, device = context.batch_size, context.num_heads, context.lm_head.weight.device
        self.weight = context.lm_head.weight
        self.memory = torch.zeros((b, h, context.hidden_size), device=device)
        self.rho = torch.zeros((b, h), device=device)
        self.queue = PendingProposals(b, h, device)
        zero = torch.zeros((), device=device, dtype=torch.float64)
        self._gate_sum, self._norm_sum, self._agree_sum = zero.clone(), zero.clone(), zero.clone()
        self._gate_n = self._agree_n = 0

    def gate(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), H]`` the gate ``g`` of each (row, head)."""
        c = self.config
        return ((self.rho[rows] - c.rho_min) / (1 - c.rho_min)).clamp(0, 1)

    @torch.no_grad()
    def adjust(self, rows, z, slots: DraftSlots):
        c = self.config
        if c.eta == 0:
            return z
        g = self.gate(rows)[:, slots.head]  # [B, F]
        z32 = z.float()
        z_norm = z32.norm(dim=-1, keepdim=True)
        step = c.eta * g[..., None] * self.memory[rows][:, slots.head]
        step = step * (c.kappa * z_norm / step.norm(dim=-1, keepdim=True).clamp(min=1e-12)).clamp(max=1.0)
        self._gate_sum += g.sum().double()
        self._norm_sum += (step.norm(dim=-1) / z_norm.squeeze(-1).clamp(min=1e-12)).sum().double()
        self._gate_n += g.numel()
        return (z32 + step).to(z.dtype)

    @torch.no_grad()
    def feedback(self, step: StepFeedback) -> None:
        if step.z is not None:
            self.queue.push(step, z=step.z.float(), candidates=step.candidates)
        index, due = self.queue.pop(step)
        if not self.queue.values:  # nothing was ever queued
            return
        z, candidates = self.queue.values["z"], self.queue.values["candidates"]
        # oldest proposal first per (row, head): the EMAs are sequential; due slots sort before the others
        order = torch.where(index >= 0, index, torch.iinfo(torch.long).max).argsort(-1)
        for s in range(index.shape[-1]):
            slot = order[..., s:s + 1]  # [B, H, 1]
            now = due.gather(-1, slot).squeeze(-1)
            if not now.any():
                continue
            b, d = now.nonzero(as_tuple=True)
            j = index.gather(-1, slot).squeeze(-1)[b, d] - step.root_index[b] - 1  # position in this step's tokens
            p = step.probs[b, step.accepted[b, j]].float()
            rows, sl = step.rows[b], slot[b, d, 0]
            self._learn(rows, d, z[rows, d, sl], candidates[rows, d, sl], p)

    def _learn(self, rows, heads, z, candidates, p):
        """Feedback of ``N`` resolved proposals: ``(rows, heads)`` distinct, the stored ``z`` ``[N, D]``, the
        candidates offered ``[N, K]`` and the target distribution ``p`` ``[N, V]`` at the proposed index."""
        c = self.config
        weight = self.weight.float()
        q = torch.softmax(F.linear(z, weight), dim=-1)
        vocab = p.shape[-1]  # -1 (no candidate) goes to a spare last column
        offered = torch.zeros((p.shape[0], vocab + 1), dtype=torch.bool, device=p.device).scatter_(
            1, torch.where(candidates >= 0, candidates, vocab), True)[:, :vocab]
        k = min(c.support_k, p.shape[-1])
        p_top = torch.zeros_like(p, dtype=torch.bool).scatter_(1, p.topk(k, -1).indices, True)
        support = p_top.clone().scatter_(1, q.topk(k, -1).indices, True)
        missed = p * (p_top & ~offered)
        u = c.dist_weight * (p - q) * support + c.cov_weight * (missed - missed.sum(-1, keepdim=True) * q * support)
        f = u @ weight  # a r_dist + b r_cov
        before = self.memory[rows, heads]
        agreement = F.cosine_similarity(before, f, dim=-1)
        agreement = torch.where(before.norm(dim=-1) > 0, agreement, torch.zeros_like(agreement))
        self._agree_sum += agreement.sum().double()
        self._agree_n += len(rows)
        self.rho[rows, heads] = c.rho_decay * self.rho[rows, heads] + (1 - c.rho_decay) * agreement
        self.memory[rows, heads] = c.lam * before + (1 - c.lam) * f

    def metrics(self):
        return {
            "reflex_gate": float(self._gate_sum) / max(1, self._gate_n),
            "reflex_norm": float(self._norm_sum) / max(1, self._gate_n),
            "reflex_agreement": float(self._agree_sum) / max(1, self._agree_n),
            "reflex_feedback": float(self._agree_n),
        }


@dataclass
class LookupConfig:
    """Parameters of :class:`TokenLookup`.

    Args:
        prior: initial hit rate (mixing weight) of the looked-up token, per (row, head).
        decay: EMA factor of the hit rate.
        ngram: longest key (tokens ending at the root) matched; the longest match wins, the latest among equals.
        cyclic: when the match is too recent for a continuation ``d`` places on, assume the span from the match to
            the root repeats (period ``root - match``) instead of offering nothing.
    """

    prior: float = 0.3
    decay: float = 0.8
    ngram: int = 2
    cyclic: bool = True

    def __post_init__(self):
        if not 0 <= self.prior <= 1:
            raise ValueError(f"reflex prior must be in [0, 1], got {self.prior}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"reflex decay must be in [0, 1), got {self.decay}")
        if not isinstance(self.ngram, int) or self.ngram < 1:
            raise ValueError(f"reflex ngram must be an int >= 1, got {self.ngram!r}")
        if not isinstance(self.cyclic, bool):
            raise ValueError(f"reflex cyclic must be a bool, got {self.cyclic!r}")


class TokenLookup(ReflexHook):
    """A trajectory-local token memory: the row's prompt and committed completion. Head ``d`` is offered the token
    that followed, ``d`` places on, the latest earlier occurrence of the root (with its preceding tokens, up to
    ``ngram`` of them; longer matches win): its scores become ``q' = (1 - w) q + w onehot(lookup)``, ``w`` the
    (row, head)'s observed hit rate (EMA of: was the looked-up token the one the target sampled there). A number
    being copied comes back as a candidate."""

    config_class = LookupConfig

    def start(self, context: GenerationContext) -> None:
        prompt = torch.where(context.attention_mask.bool(), context.input_ids, -1)
        b, h, device = context.batch_size, context.num_heads, context.lm_head.weight.device
        self.heads = h
        self.projection = context.projection
        self.offset = prompt.shape[1]  # completion index i lives at history position offset + i
        # [B, L] prompt (its padding -1) + completion, -1 where unknown; grows on demand
        self.history = torch.cat([prompt, torch.full_like(prompt[:, :1], -1).expand(-1, 256)], dim=1).clone()
        self.known = torch.zeros(b, device=device, dtype=torch.long)  # history positions filled
        self.rate = torch.full((b, h), self.config.prior, device=device)
        self.queue = PendingProposals(b, h, device)
        # The lookup's chain this step ([B, H], -1: none; set by the step's first adjust_logprobs, queued by
        # feedback) and whether the heads read their path (then a head's offer goes to the chain's own node only).
        self._offered: torch.Tensor | None = None
        self._on_path = False
        self._hits = self._tried = self._resolved = 0  # hits / resolved offers / resolved proposals

    def offers(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), H]`` the token each head is offered (``-1``: none), from the row's own history."""
        c, n = self.config, self.heads
        hist = self.history[rows]  # [B, W]
        width = hist.shape[1]
        last = self.known[rows][:, None] - 1  # the root's position; -1 before the first root is recorded
        pos = torch.arange(width, device=hist.device)[None]
        run = (hist == hist.gather(1, last.clamp(min=0))) & (pos < last)
        length = run.long()
        for i in range(1, c.ngram):  # extend the match backwards: hist[j - i] == hist[last - i]
            key = torch.where(last >= i, hist.gather(1, (last - i).clamp(min=0)), -2)
            run = torch.cat([run[:, :i] & False, run[:, i:] & (hist[:, :-i] == key)], 1)
            length += run
        best = (length * width + pos).max(1)
        j = best.indices[:, None]
        ahead = torch.arange(n, device=hist.device)[None]  # head d looks d places past the match
        if c.cyclic:
            ahead = ahead % (last - j).clamp(min=1)
        at = j + 1 + ahead  # [B, n]
        ok = (best.values >= width)[:, None] & (at <= last)
        return torch.where(ok, hist.gather(1, at.clamp(max=width - 1)), -1)

    @torch.no_grad()
    def adjust_logprobs(self, rows, logp, slots: DraftSlots):
        if self._offered is None:  # once per step: path heads call once per depth
            chain = self.offers(rows)
            self._offered = torch.where(self.projection.index_of(chain) >= 0, chain, -1)
        offer = self._offered[:, slots.head]  # [B, F]
        self._on_path = slots.path is not None
        if self._on_path:  # the node's path below the root must be the lookup's chain so far
            below = slots.path.shape[-1] - 1
            on_chain = (slots.path[..., 1:] == self._offered[:, None, :below]).all(-1)
            offer = torch.where(on_chain, offer, -1)
        index = self.projection.index_of(offer)  # where logp holds it (-1: outside the heads' draft vocabulary)
        w = (self.rate[rows][:, slots.head] * (offer >= 0))[..., None]  # [B, F, 1]
        idx = index.clamp(min=0)[..., None]
        keep = 1 - w
        # log((1 - w) q + w onehot): the looked-up token's score, log(1 - w) added to every other one
        at = (logp.gather(-1, idx).exp() * keep + w).clamp(min=1e-30).log()
        return (logp + keep.clamp(min=1e-6).log()).scatter(-1, idx, at)

    @torch.no_grad()
    def feedback(self, step: StepFeedback) -> None:
        self._record(step)
        if step.z is not None and self._offered is not None:
            offered = self._offered
            if self._on_path:  # head d's offer was made only if the accepted path so far is the chain
                heads, width = offered.shape[1], min(offered.shape[1] - 1, step.emitted.shape[1])
                same = (step.emitted[:, :width] == offered[:, :width]).cumprod(1).bool()
                on_chain = torch.cat([same.new_ones((len(same), 1)), same,
                                      same.new_zeros((len(same), heads - 1 - width))], 1)
                offered = torch.where(on_chain, offered, -1)
            self.queue.push(step, token=offered)
        self._offered = None
        index, due = self.queue.pop(step)
        if not self.queue.values:  # nothing was ever queued
            return
        offered = self.queue.values["token"][step.rows]  # [B, H, H]
        has = due & (offered >= 0)
        width = step.emitted.shape[1]
        j = (index - step.root_index[:, None, None] - 1).clamp(0, width - 1)
        hit = has & (offered == step.emitted.gather(1, j.flatten(1)).view_as(j))
        count, hits = has.sum(-1), hit.sum(-1)  # [B, H]
        rate, decay = self.rate[step.rows], self.config.decay
        self.rate[step.rows] = torch.where(count > 0, decay * rate + (1 - decay) * hits / count.clamp(min=1), rate)
        self._hits = self._hits + hits.sum()
        self._tried = self._tried + count.sum()
        self._resolved = self._resolved + due.sum()

    def _record(self, step: StepFeedback) -> None:
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

    def metrics(self):
        return {"reflex_lookup_hit": float(self._hits) / max(1, int(self._tried)),
                "reflex_feedback": float(self._resolved)}


@dataclass
class GroupLookupConfig(LookupConfig):
    """Parameters of :class:`GroupTokenLookup`: those of :class:`LookupConfig`, and

    Args:
        group_size: rows searched per row (itself and the nearest in batch order sharing its prompt), bounding
            the cost.
    """

    group_size: int = 8

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"reflex group_size must be an int >= 1, got {self.group_size!r}")


class GroupTokenLookup(TokenLookup):
    """:class:`TokenLookup` that also searches the other rows of the call sharing the row's prompt (GRPO's group of
    ``num_generations`` completions), finished ones included. It reads other rows' committed tokens, so its state
    is per group rather than strictly per trajectory (opt-in)."""

    config_class = GroupLookupConfig

    def start(self, context: GenerationContext) -> None:
        super().start(context)
        # up to group_size rows sharing the prompt, nearest in batch order, the row itself first
        prompt = torch.where(context.attention_mask.bool(), context.input_ids, -1)
        group = torch.unique(prompt, dim=0, return_inverse=True)[1]
        order = torch.argsort(group * len(group) + torch.arange(len(group), device=group.device))
        rank = torch.empty_like(order)
        rank[order] = torch.arange(len(order), device=order.device)
        start = torch.searchsorted(group[order], group, right=False)
        stop = torch.searchsorted(group[order], group, right=True) - 1
        k = self.config.group_size
        offsets = torch.tensor([0] + [o for i in range(1, k + 1) for o in (-i, i)][:k], device=group.device)
        self.siblings = order[torch.minimum(torch.maximum(rank[:, None] + offsets, start[:, None]), stop[:, None])]

    def offers(self, rows: torch.Tensor) -> torch.Tensor:
        """Like :meth:`TokenLookup.offers`, over the row's siblings too: the longest match wins, then the row's
        own history, then the latest position; cyclic continuation applies to own-row matches only."""
        c, n = self.config, self.heads
        known = self.known[rows]
        last = (known - 1).clamp(min=0)  # the root's position
        src = self.siblings[rows]  # [B, S] source rows, own row first
        hist = self.history[src]  # [B, S, W]
        width = hist.shape[-1]
        own = src == rows[:, None]
        src_last = torch.where(own, last[:, None], self.known[src] - 1)  # last known position of each source
        pos = torch.arange(width, device=hist.device)
        # match positions: strictly before the root in the own row, with a known successor in the others
        ok = (known > 0)[:, None, None]
        row_hist = self.history[rows]
        run = (hist == row_hist.gather(1, last[:, None])[..., None]) & (pos < src_last[..., None]) & ok
        length = run.long()
        for i in range(1, c.ngram):  # extend the match backwards: hist[j - i] == the row's [last - i]
            key = torch.where(last >= i, row_hist.gather(1, (last - i).clamp(min=0)[:, None])[:, 0], -2)
            run = torch.cat([run[..., :i] & False, run[..., i:] & (hist[..., :-i] == key[:, None, None])], -1)
            length += run
        best = ((length * 2 + own[..., None]) * width + pos).flatten(1).max(1)
        s_best, j_best = best.indices // width, best.indices % width
        ahead = torch.arange(n, device=hist.device)[None]  # head d looks d places past the match
        if c.cyclic:  # in the own row: the span from the match to the root repeats
            own_best = own.gather(1, s_best[:, None])
            ahead = torch.where(own_best, ahead % (last - j_best).clamp(min=1)[:, None], ahead)
        at = j_best[:, None] + 1 + ahead  # [B, n]
        found = (best.values >= 2 * width)[:, None] & (at <= src_last.gather(1, s_best[:, None]))
        seq = hist[torch.arange(len(rows), device=rows.device), s_best]  # [B, W]
        return torch.where(found, seq.gather(1, at.clamp(max=width - 1)), -1)


# Named hook lists (templates: ``reflex_hooks`` builds fresh copies).
REFLEX_PRESETS: dict[str, list[ReflexHook]] = {
    "lookup": [TokenLookup()],
    "lookup-group": [GroupTokenLookup()],
    "baseline": [HiddenStateReflex()],
    "baseline+lookup": [HiddenStateReflex(), TokenLookup()],
}


def reflex_hooks(preset: str = "lookup", **kwargs) -> list[StepHook]:
    """Fresh hooks of a preset in ``REFLEX_PRESETS``; each keyword replaces the config field of that name in every
    hook of the preset that has one (e.g. ``reflex_hooks("lookup", prior=0.5)``). Raises ``ValueError`` for an
    unknown preset, a keyword no hook of the preset takes, or an invalid value (so it also validates settings)."""
    if preset not in REFLEX_PRESETS:
        raise ValueError(f"unknown reflex preset {preset!r}; choose from {sorted(REFLEX_PRESETS)}")
    templates = REFLEX_PRESETS[preset]
    names = [{f.name for f in fields(hook.config)} for hook in templates]
    accepted = set().union(*names)
    if unknown := sorted(set(kwargs) - accepted):
        raise ValueError(f"reflex preset {preset!r} takes no {unknown}; it takes {sorted(accepted)}")
    return [type(hook)(hook.config, **{k: v for k, v in kwargs.items() if k in own})
            for hook, own in zip(templates, names)]
