"""The one record type heads are fitted on, and the one loss that fits them.

A ``HeadRecords`` batch holds, per anchor ``t``: the target's final hidden state ``h_t``, the path tokens
``x_{t+1..t+H}`` (head ``k`` of a path-conditioned head set reads the first ``k``), and for every head ``k`` the
top-K of the target's distribution of ``x_{t+1+k}`` (ids, probabilities), the realised ``x_{t+1+k}`` and whether it
exists (``valid``). The offline distillation stream (``distill.TokenStream.records``) and the slow path's online
buffer (``buffer.HeadBuffer.take``) both produce it; ``head_fit_loss`` is the loss both fit it with, on either head
kind.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..engine.heads import VocabProjection


@dataclass
class HeadRecords:
    """``N`` anchors of head-training data (see the module docstring)."""

    hidden: torch.Tensor  # [N, D]
    path: torch.Tensor  # [N, H] x_{t+1..t+H}
    target_ids: torch.Tensor  # [N, H, K]
    target_probs: torch.Tensor  # [N, H, K]
    tokens: torch.Tensor  # [N, H] x_{t+2..t+H+1}
    valid: torch.Tensor  # [N, H] bool

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def to(self, device, dtype=None) -> HeadRecords:
        """On ``device``, the hidden states in ``dtype`` (the heads' dtype)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)}
        if dtype is not None:
            moved["hidden"] = moved["hidden"].to(dtype)
        return HeadRecords(**moved)


def record_states(heads, records: HeadRecords, embed=None) -> torch.Tensor:
    """``z [N, H, D]`` of the heads on the records; given ``embed`` (the target's input embedding), the heads are also
    handed the embeddings of the records' path tokens, which path heads read and independent heads ignore."""
    heads.check_path_source(embed, "train or evaluate them")
    if embed is None:
        return heads(records.hidden)
    with torch.no_grad():  # the policy's embedding is read, never trained here (nor given a gradient)
        path = embed(records.path.to(embed.weight.device)).to(records.hidden.dtype)
    return heads(records.hidden, path)


def head_fit_loss(heads, projection: VocabProjection, records: HeadRecords, embed=None, kl_weight: float = 1.0,
                  nll_weight: float = 1.0, tv_weight: float = 0.0) -> torch.Tensor:
    """Per head (``[H]``), the mean over valid anchors of ``kl_weight * KL(p || q) + nll_weight * CE(x_{t+1+k}) +
    tv_weight * TV(p, q)``: ``p`` the target's top-K renormalised within the heads' vocabulary, ``q`` the head's
    distribution over it. ``TV(p, q) = 1 - sum min(p, q)`` is one minus what a child drawn from ``q`` is accepted at
    by rejection sampling."""
    logq = torch.log_softmax(projection(record_states(heads, records, embed)).float(), dim=-1)  # [N, H, V]
    index = projection.index_of(records.target_ids)
    p = records.target_probs * (index >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
    logq_at = logq.gather(-1, index.clamp(min=0))
    kl = (p * (p.clamp(min=1e-12).log() - logq_at)).sum(-1)
    realised = projection.index_of(records.tokens)
    nll = -logq.gather(-1, realised.clamp(min=0)[..., None]).squeeze(-1) * (realised >= 0)
    loss = kl_weight * kl + nll_weight * nll
    if tv_weight:
        loss = loss + tv_weight * (1 - torch.minimum(p, logq_at.exp() * (index >= 0)).sum(-1))
    valid = records.valid.float()
    return (loss * valid).sum(0) / valid.sum(0).clamp(min=1)
