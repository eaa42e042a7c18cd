"""Training records for the slow path, captured from verification.

``BufferCapture`` is a step hook. Every step it records, per row, the heads' input ``h_t``, the root token and, for
every token committed, the top-K of the target distribution it was sampled from plus the token itself. When the
``generate`` call ends it pairs them: the anchor of a step whose root is completion index ``r`` gets the path tokens
``x_{r..r+H-1}`` and, for head ``d``, the target and realised token of index ``r + d`` (resolved later than the step
that proposed it, exactly as Reflex's delayed feedback), as ``records.HeadRecords`` pushed into a bounded ring,
``HeadBuffer``; the slow path fits them with the offline distillation's loss, on either head kind. Anchors are
recorded whether or not the step drafted, so heads too weak to be drafted with still get data. It also measures,
per ``generate`` call, each head's acceptance and candidate regret ``1 - sum_{c in candidates} p(c)`` at verified
nodes: the drift monitor's two signals. Everything is detached; nothing here needs gradients.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from ..engine.hooks import GenerationContext, StepFeedback, StepHook
from .records import HeadRecords


class HeadBuffer:
    """A bounded ring of detached ``HeadRecords``; the oldest are overwritten first. ``data`` holds every slot
    (the first ``len(self)`` are filled); ``added`` counts every record ever added; ``round[slot]`` numbers the
    ``add`` call (one per ``generate`` call: a generation round) each record came in with; ``temperature`` the
    sampling temperature its targets are at (the latest round's; ``None`` for greedy or not known)."""

    def __init__(self, capacity: int, num_heads: int, hidden_size: int, topk: int):
        if capacity < 1 or topk < 1:
            raise ValueError(f"buffer capacity and topk must be >= 1, got {capacity} and {topk}")
        self.capacity, self.num_heads, self.topk = capacity, num_heads, topk
        self.temperature: float | None = None
        self.data = HeadRecords(
            hidden=torch.zeros((capacity, hidden_size)), path=torch.zeros((capacity, num_heads), dtype=torch.long),
            target_ids=torch.zeros((capacity, num_heads, topk), dtype=torch.long),
            target_probs=torch.zeros((capacity, num_heads, topk)),
            tokens=torch.zeros((capacity, num_heads), dtype=torch.long),
            valid=torch.zeros((capacity, num_heads), dtype=torch.bool))
        self.round = torch.zeros(capacity, dtype=torch.long)
        self.size = self.cursor = 0
        self.added = self.rounds = 0

    def __len__(self) -> int:
        return self.size

    def add(self, records: HeadRecords) -> None:
        n = len(records)
        if n == 0:
            return
        if n > self.capacity:  # keep the newest
            records = HeadRecords(**{f.name: getattr(records, f.name)[-self.capacity:] for f in fields(records)})
            n = self.capacity
        slots = (self.cursor + torch.arange(n)) % self.capacity
        for f in fields(records):
            store = getattr(self.data, f.name)
            store[slots] = getattr(records, f.name).detach().to(store.dtype).cpu()
        self.round[slots] = self.rounds
        self.rounds += 1
        self.cursor = int((self.cursor + n) % self.capacity)
        self.size = min(self.capacity, self.size + n)
        self.added += n

    def newest_first(self) -> torch.Tensor:
        """The filled slots, newest record first."""
        return (self.cursor - 1 - torch.arange(self.size)) % self.capacity

    def sample(self, n: int, generator: torch.Generator | None = None, among: torch.Tensor | None = None):
        """``n`` records drawn uniformly with replacement (from the slots ``among``, default all)."""
        if self.size == 0:
            raise ValueError("the head buffer is empty")
        if among is None:
            return self.take(torch.randint(self.size, (n,), generator=generator))
        return self.take(among[torch.randint(len(among), (n,), generator=generator)])

    def take(self, index: torch.Tensor) -> HeadRecords:
        """The records at slots ``index``."""
        return HeadRecords(**{f.name: getattr(self.data, f.name)[index] for f in fields(self.data)})

    def clear(self) -> None:
        self.size = self.cursor = 0


class BufferCapture(StepHook):
    """Fills a ``HeadBuffer`` from the engine's verification feedback and measures candidate regret."""

    def __init__(self, buffer: HeadBuffer):
        self.buffer = buffer
        self.rounds: list[tuple[list[float] | None, list[float] | None]] = []  # (accept per head, regret) per call
        self.regret_sum = torch.zeros(buffer.num_heads, dtype=torch.float64)
        self.regret_count = torch.zeros(buffer.num_heads, dtype=torch.float64)

    name = "capture"

    def start(self, context: GenerationContext):
        if context.num_heads != self.buffer.num_heads:
            raise ValueError(f"buffer holds {self.buffer.num_heads} heads, the engine runs {context.num_heads}")
        self._batch = context.batch_size
        self.buffer.temperature = context.temperature
        self._steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, root_index, hidden)
        # per row and completion index: the target's top-K there and the committed token (roots included)
        self._ids = self._probs = self._tokens = None
        self.regret_sum.zero_()
        self.regret_count.zero_()
        self.accepted = torch.zeros(self.buffer.num_heads, dtype=torch.float64)
        self.drafted = 0

    def _grow(self, length: int, device) -> None:
        k = self.buffer.topk
        if self._ids is not None and self._ids.shape[1] >= length:
            return
        size = max(length, 2 * (0 if self._ids is None else self._ids.shape[1]), 64)
        ids = torch.zeros((self._batch, size, k), dtype=torch.long, device=device)
        probs = torch.zeros((self._batch, size, k), device=device)
        tokens = torch.zeros((self._batch, size), dtype=torch.long, device=device)
        if self._ids is not None:
            old = self._ids.shape[1]
            ids[:, :old], probs[:, :old], tokens[:, :old] = self._ids, self._probs, self._tokens
        self._ids, self._probs, self._tokens = ids, probs, tokens

    @torch.no_grad()
    def feedback(self, step: StepFeedback):
        rows, width = step.rows, step.accepted.shape[1]
        if step.hidden is not None:
            self._steps.append((rows, step.root_index, step.hidden.detach().float()))
        # Token j of this step (completion index root + 1 + j) was sampled from the probs at accepted[j].
        node = step.accepted.clamp(min=0)
        p = step.probs.gather(1, node[..., None].expand(-1, -1, step.probs.shape[-1])).float()  # [B, W, V]
        k = min(self.buffer.topk, p.shape[-1])
        top_p, top_ids = p.topk(k, dim=-1)
        self._grow(int((step.root_index + width).max()) + 2, p.device)
        j = torch.arange(width, device=rows.device)
        write = j[None] < step.count[:, None]
        index = step.root_index[:, None] + 1 + j[None]
        r = rows[:, None].expand(-1, width)
        self._ids[r[write], index[write], :k] = top_ids[write]
        self._probs[r[write], index[write], :k] = top_p[write]
        self._tokens[r[write], index[write]] = step.emitted[write]
        self._tokens[rows, step.root_index] = step.tree.tokens[:, 0]  # the anchor's path starts at its root
        if step.candidates is not None:
            depth = min(width - 1, self.buffer.num_heads)  # rows whose accepted path reaches depth d + 1
            self.accepted[:depth] += (step.accepted[:, 1 : depth + 1] >= 0).sum(0).double().cpu()
            self.drafted += len(rows)
            heads = min(step.candidates.shape[1], width)  # head d's target is this step's token d-1, if any
            candidates = step.candidates[:, :heads]  # -1: no candidate (a drawn node with fewer children)
            covered = (p[:, :heads].gather(2, candidates.clamp(min=0)) * (candidates >= 0)).sum(-1)  # [B, heads]
            seen = torch.arange(heads, device=rows.device)[None] < step.count[:, None]
            if step.proposed is not None:  # path heads: only where a head ran on the accepted path
                seen = seen & step.proposed[:, :heads]
            self.regret_sum[:heads] += ((1 - covered) * seen).sum(0).double().cpu()
            self.regret_count[:heads] += seen.sum(0).double().cpu()

    @torch.no_grad()
    def finish(self, lengths):
        drafted = self.drafted > 0
        self.rounds.append(((self.accepted / max(1, self.drafted)).tolist() if drafted else None,
                            self.regret() if drafted else None))
        if not self._steps or self._ids is None:
            return
        rows = torch.cat([s[0] for s in self._steps])
        roots = torch.cat([s[1] for s in self._steps])
        hidden = torch.cat([s[2] for s in self._steps])
        heads = self.buffer.num_heads
        target = roots[:, None] + torch.arange(1, heads + 1, device=roots.device)  # [N, H]
        valid = target < lengths.to(roots.device)[rows][:, None]
        target = target.clamp(max=self._ids.shape[1] - 1)
        r = rows[:, None].expand(-1, heads)
        self.buffer.add(HeadRecords(hidden=hidden, path=self._tokens[r, target - 1], target_ids=self._ids[r, target],
                                    target_probs=self._probs[r, target], tokens=self._tokens[r, target], valid=valid))
        self._steps = []

    def pop_rounds(self) -> list[tuple[list[float] | None, list[float] | None]]:
        """The ``(accept_per_head, regret)`` of each ``generate`` call since the last pop (``None`` for a call that
        drafted nothing), for the drift monitor."""
        rounds, self.rounds = self.rounds, []
        return rounds

    def regret(self) -> list[float]:
        """Mean candidate regret per head over the last ``generate`` call (NaN where a head was never verified)."""
        return (self.regret_sum / self.regret_count).tolist()  # 0/0 -> NaN

    def metrics(self):
        return {"candidate_regret": self.regret()}
