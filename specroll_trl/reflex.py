"""Reflex: gradient-free, trajectory-local correction of the heads' hidden states (SPEC 2.5).

Head ``d`` at step ``s`` proposed for completion index ``root + d`` from ``z_d``. When that index is committed
(this step or a later one) the verifier knows the target distribution ``p`` there and the realised token.
Through the shared vocabulary projection ``W`` (the ``lm_head`` weight), restricted to a top-K support ``S``:

* distribution error ``r_dist = W_S^T (p_S - q_S)`` (the gradient of ``E_p[log q]`` w.r.t. ``z``);
* coverage error ``r_cov = W_M^T m - (sum m) W_S^T q_S``, ``m`` = target mass on ``p``'s top-K tokens the
  head did not offer as candidates;
* feedback ``f = a r_dist + b r_cov``; memory ``M <- lam M + (1 - lam) f`` per (row, head);
* reliability ``rho <- EMA(cos(M_before, f))``; correction ``z' = z + eta g M`` with
  ``g = clip((rho - rho_min) / (1 - rho_min), 0, 1)`` and ``||eta g M|| <= kappa ||z||``.

State lives per (row, head) for one ``generate`` call only; everything is vectorised over rows and heads.
Reflex only changes proposals, never what the verifier emits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .hooks import StepFeedback, StepHook


@dataclass
class ReflexConfig:
    """Reflex parameters.

    Args:
        eta: correction step size.
        lam: memory EMA factor (``M <- lam M + (1 - lam) f``).
        rho_min: the gate opens only while the reliability EMA exceeds this.
        rho_decay: EMA factor of the reliability score.
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
            raise ValueError(f"reflex eta and kappa must be >= 0, got {self.eta}, {self.kappa}")
        if self.support_k < 1:
            raise ValueError(f"reflex support_k must be >= 1, got {self.support_k}")


class Reflex(StepHook):
    """The Reflex hook; pass it to ``SpeculativeGenerator(..., hooks=[Reflex()])``."""

    def __init__(self, config: ReflexConfig | None = None):
        self.config = config or ReflexConfig()

    def start(self, batch_size, num_heads, hidden_size, lm_head):
        device, dtype = lm_head.weight.device, torch.float32
        self.weight = lm_head.weight
        slots = num_heads  # a head's unresolved proposals target distinct indices within the next H
        self.memory = torch.zeros((batch_size, num_heads, hidden_size), device=device, dtype=dtype)
        self.rho = torch.zeros((batch_size, num_heads), device=device, dtype=dtype)
        self.pending_index = torch.full((batch_size, num_heads, slots), -1, device=device, dtype=torch.long)
        self.pending_z = torch.zeros((batch_size, num_heads, slots, hidden_size), device=device, dtype=dtype)
        self.pending_cand = None
        self._gate_sum = self._norm_sum = 0.0
        self._gate_n = self._feedback_n = 0
        self._seconds = 0.0

    def gate(self, rows: torch.Tensor) -> torch.Tensor:
        c = self.config
        return ((self.rho[rows] - c.rho_min) / (1 - c.rho_min)).clamp(0, 1)

    @torch.no_grad()
    def adjust(self, rows, z):
        start = time.perf_counter()
        g = self.gate(rows)
        step = self.config.eta * g[..., None] * self.memory[rows]
        z_norm = z.float().norm(dim=-1, keepdim=True)
        step_norm = step.norm(dim=-1, keepdim=True)
        step = step * (self.config.kappa * z_norm / step_norm.clamp(min=1e-12)).clamp(max=1.0)
        self._gate_sum += float(g.sum())
        self._norm_sum += float((step.norm(dim=-1) / z_norm.squeeze(-1).clamp(min=1e-12)).sum())
        self._gate_n += g.numel()
        out = (z.float() + step).to(z.dtype)
        self._seconds += time.perf_counter() - start
        return out

    @torch.no_grad()
    def feedback(self, step: StepFeedback):
        start = time.perf_counter()
        self._feedback(step)
        self._seconds += time.perf_counter() - start

    def _feedback(self, step: StepFeedback):
        rows, heads = step.rows, self.memory.shape[1]
        if self.pending_cand is None and step.candidates is not None:
            self.pending_cand = torch.full((*self.pending_index.shape, step.candidates.shape[-1]), -1,
                                           device=self.pending_index.device, dtype=torch.long)
        # 1. queue this step's proposals (if it drafted): head d proposed index root + d
        if step.z is not None:
            target = step.root_index[:, None] + torch.arange(1, heads + 1, device=rows.device)  # [B, H]
            free = (self.pending_index[rows] < 0).int().argmax(-1)  # [B, H]
            r_idx = rows[:, None].expand(-1, heads)
            h_idx = torch.arange(heads, device=rows.device).expand(len(rows), -1)
            self.pending_index[r_idx, h_idx, free] = target
            self.pending_z[r_idx, h_idx, free] = step.z.float()
            self.pending_cand[r_idx, h_idx, free] = step.candidates
        # 2. resolve every pending proposal whose index was committed this step, oldest first
        end = (step.root_index + step.count)[:, None, None]
        pending = self.pending_index[rows]  # [B, H, S]
        order = torch.where(pending >= 0, pending, torch.iinfo(torch.long).max).argsort(-1)
        for s in range(pending.shape[-1]):
            slot = order[..., s]  # [B, H]
            index = pending.gather(-1, slot[..., None]).squeeze(-1)
            due = (index > step.root_index[:, None]) & (index <= end[..., 0])
            if not due.any():
                continue
            b, d = due.nonzero(as_tuple=True)
            j = index[b, d] - step.root_index[b] - 1  # position in this step's emitted tokens
            node = step.accepted[b, j]
            p = step.probs[b, node].float()
            orig, sl = rows[b], slot[b, d]
            self._update(orig, d, self.pending_z[orig, d, sl], self.pending_cand[orig, d, sl], p)
            self.pending_index[orig, d, sl] = -1
        self.pending_index[rows[step.finished]] = -1

    def _update(self, rows, heads, z, candidates, p):
        """Feedback for ``N`` resolved proposals (row, head, stored ``z [N, D]``, candidates, target ``p``)."""
        c = self.config
        weight = self.weight.float()
        q = torch.softmax(F.linear(z, weight), dim=-1)
        k = min(c.support_k, p.shape[-1])
        p_top = torch.zeros_like(p, dtype=torch.bool).scatter_(1, p.topk(k, -1).indices, True)
        support = p_top.clone().scatter_(1, q.topk(k, -1).indices, True)
        r_dist = ((p - q) * support) @ weight
        offered = torch.zeros_like(p_top).scatter_(1, candidates.clamp(min=0), candidates >= 0)
        missed = p * (p_top & ~offered)
        r_cov = missed @ weight - missed.sum(-1, keepdim=True) * ((q * support) @ weight)
        f = c.dist_weight * r_dist + c.cov_weight * r_cov
        before = self.memory[rows, heads]
        agreement = F.cosine_similarity(before, f, dim=-1)
        agreement = torch.where(before.norm(dim=-1) > 0, agreement, torch.zeros_like(agreement))
        self.rho[rows, heads] = c.rho_decay * self.rho[rows, heads] + (1 - c.rho_decay) * agreement
        self.memory[rows, heads] = c.lam * before + (1 - c.lam) * f
        self._feedback_n += len(rows)

    def metrics(self):
        return {
            "reflex_gate": self._gate_sum / max(1, self._gate_n),
            "reflex_norm": self._norm_sum / max(1, self._gate_n),
            "reflex_feedback": float(self._feedback_n),
            "reflex_seconds": self._seconds,
        }
