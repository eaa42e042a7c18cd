"""Per-step hooks of the speculative engine: adjust proposals before drafting, receive verifier feedback after.

Per ``generate`` call the engine calls ``start(context)`` once; then every decoding step ``adjust`` (it may change
the heads' hidden states ``z`` before candidates are taken from ``lm_head(z)``), ``adjust_logprobs`` (it may change
the heads' log-probabilities the candidates and their tree scores are taken from) and ``feedback`` (what the
verifier learnt this step); and ``finish`` when the call ends. Hooks run in list order, like logits processors,
and the engine times each one (``stats.hook_seconds[hook.name]``). Hooks can only change *proposals*: what is
emitted stays exactly distributed as the target samples it. Reflex (``specroll_trl.adapt.reflex``) and the slow
path's ``BufferCapture`` (``specroll_trl.adapt.buffer``) are hooks.

Hooks act where the heads act, on every head kind. ``adjust`` and ``adjust_logprobs`` see one *draft call* at a
time, described by its ``DraftSlots``: independent heads draft once per step, all ``H`` heads at once (slot ``j`` is
head ``j``); path-conditioned heads draft once per depth, head ``d`` over that depth's frontier (every slot is head
``d``, each reading its own path, given as ``slots.path``). ``feedback`` pairs every proposal that stands for the
committed text with what the verifier sampled there (``StepFeedback.proposed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .heads import VocabProjection, lm_head_shape
from .tree import DraftTree


@dataclass
class GenerationContext:
    """What hooks are told when a ``generate`` call starts.

    Attributes:
        input_ids: ``[B, T]`` the call's left-padded prompts.
        attention_mask: ``[B, T]`` their mask (0 on padding).
        num_heads: heads proposing (``H``).
        lm_head: the target's output projection (shared by the heads; read-only).
        projection: the heads' vocabulary projection. With a draft vocabulary, position ``j`` of the
            ``[B, H, V]`` log-probabilities ``adjust_logprobs`` sees is token ``projection.target_ids(j)``, and
            ``projection.index_of(ids)`` maps target ids there (``-1``: not in the draft vocabulary).
        temperature: the call's sampling temperature (``None``: greedy); the projection drafts at it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    num_heads: int
    lm_head: torch.nn.Module
    projection: VocabProjection | None = None
    temperature: float | None = None

    def __post_init__(self):
        if self.projection is None:
            self.projection = VocabProjection(self.lm_head, None)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def hidden_size(self) -> int:
        return lm_head_shape(self.lm_head)[1]  # the full shape, also under ZeRO-3 partitioning


@dataclass
class DraftSlots:
    """What the ``F`` slots of one draft call are (the middle axis of the ``z [B, F, D]`` and ``logp [B, F, V]`` the
    hooks adjust).

    Attributes:
        head: ``[F]`` the (0-based) head proposing in each slot; its candidates are for completion index
            ``root_index + 1 + head``.
        path: ``[B, F, head + 1]`` for path-conditioned heads: the tokens from the root down to the frontier node each
            slot's head reads (its candidates are that node's children); ``None`` for independent heads, which read
            only the hidden state.
    """

    head: torch.Tensor
    path: torch.Tensor | None = None

    @classmethod
    def all_heads(cls, num_heads: int, device=None) -> DraftSlots:
        """The slots of independent heads: slot ``j`` is head ``j``."""
        return cls(torch.arange(num_heads, device=device))


@dataclass
class StepFeedback:
    """One verified step, for the rows still generating (``B`` of them).

    Attributes:
        rows: ``[B]`` indices of the rows in the caller's batch.
        root_index: ``[B]`` completion index of each row's root token (head ``d`` proposed index
            ``root_index + d``); this step committed indices ``root_index + 1 .. root_index + count``.
        z: ``[B, H, D]`` per head, the hidden state its proposal was taken from (after ``adjust``): independent heads'
            own; for path heads, head ``d``'s at the accepted path's node of depth ``d - 1`` (the node whose children
            it proposed, where the committed token was sampled). ``None`` when the step drafted nothing.
        candidates: ``[B, H, K]`` the candidates of those proposals (target ids): the heads' top-k; for a drawn tree of
            path heads, the children drawn at that node (``-1`` past the last).
        proposed: ``[B, H]`` which of those proposals stand for the committed text: all for independent heads (head
            ``d`` proposed for index ``root_index + d`` from ``h_t``, resolved now or by a later step); for path heads
            those made at a node of the accepted path (head ``d`` ran there), all resolved this step.
        tree: the verified draft trees.
        probs: ``[B, n, V]`` the target's sampling distribution at every tree node.
        accepted: ``[B, D+1]`` node indices of the accepted path (root first, ``-1`` past its end).
        emitted: ``[B, W]`` tokens committed this step after the root; the first ``count`` are real. Token ``j``
            was sampled from ``probs[accepted[j]]``.
        count: ``[B]`` number of committed tokens.
        finished: ``[B]`` rows that finished this step (they leave the batch after the hooks ran).
        hidden: ``[B, D]`` the target's final hidden state ``h_t`` the heads read this step (independent heads' ``z``
            is ``heads(hidden)`` before ``adjust``); given even when the step drafted nothing.
        next_root: ``[B]`` the token sampled after the accepted path (the next step's root, not yet committed).
    """

    rows: torch.Tensor
    root_index: torch.Tensor
    z: torch.Tensor
    candidates: torch.Tensor
    tree: DraftTree
    probs: torch.Tensor
    accepted: torch.Tensor
    emitted: torch.Tensor
    count: torch.Tensor
    finished: torch.Tensor
    hidden: torch.Tensor | None = None
    proposed: torch.Tensor | None = None
    next_root: torch.Tensor | None = None


class StepHook:
    """Base class: every method is a no-op, override what you need. ``name`` keys the hook's time in the stats."""

    name = "hook"

    def start(self, context: GenerationContext) -> None:
        """A new ``generate`` call: reset all per-row state for ``context.batch_size`` fresh rows."""

    def adjust(self, rows: torch.Tensor, z: torch.Tensor, slots: DraftSlots) -> torch.Tensor:
        """Return the hidden states (``[B, F, D]``, one per slot of this draft call) the candidates are taken from."""
        return z

    def adjust_logprobs(self, rows: torch.Tensor, logp: torch.Tensor, slots: DraftSlots) -> torch.Tensor:
        """Return the scores (``[B, F, V]``, the slots' log-probabilities from ``lm_head(z)``) whose top-k become
        the tree's candidates; the kept values are the candidates' scores (tree selection multiplies them
        along a path, so they must stay <= 0)."""
        return logp

    def feedback(self, step: StepFeedback) -> None:
        """Consume one step's verification results."""

    def finish(self, lengths: torch.Tensor) -> None:
        """The ``generate`` call ended; ``lengths[b]`` = completion tokens of row ``b`` (all rows)."""

    def metrics(self) -> dict[str, float]:
        """Aggregates since ``start`` (merged into the engine's stats)."""
        return {}
