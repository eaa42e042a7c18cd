"""Ragged KV cache over a Hugging Face ``DynamicCache``.

Rows accept different numbers of tokens per step. After verification each row's accepted tree entries
are gathered to sit right after the physical end of the cache; rows that accepted fewer carry masked
holes. ``valid [B, S]`` says which physical slots hold a row's committed tokens; positions are always
logical (``lengths``), never physical. Holes are squeezed out when they grow, and finished rows leave.
Only the public ``keys``/``values`` tensors of each cache layer are touched.

``roomy_cache`` builds the ``DynamicCache`` with layers that keep room after their slots (``RoomyLayer``): a
``DynamicLayer`` appends a step's slots by concatenation, which copies every layer's whole cache at every step.
"""

from __future__ import annotations

import operator
from itertools import compress

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class RoomyLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` and ``values`` are views of buffers with room after them (at least ``room``
    slots, or a quarter of their length: the memory held beyond ``DynamicLayer``'s stays within that share): a step's
    slots are written in place. A view of the buffer's first rows starting at any slot stays in place too (rows
    leaving: ``RaggedCache.leave``; leading holes dropped; a prefix kept); whoever replaces ``keys`` or ``values`` by
    another tensor (a compaction) costs one copy into a new buffer at the next update."""

    def __init__(self, room: int = 64, **kwargs):
        super().__init__(**kwargs)
        self.room = room
        self.buffers: list[torch.Tensor | None] = [None, None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append(0, self.keys, key_states)
        self.values = self._append(1, self.values, value_states)
        return self.keys, self.values

    def _start(self, which: int, held: torch.Tensor) -> int | None:
        """The slot of its buffer where ``held`` begins, if ``held`` is that buffer's first rows from there on."""
        buffer = self.buffers[which]
        if (buffer is None or held.dim() != 4 or held.stride() != buffer.stride()
                or held.shape[0] > buffer.shape[0] or held.shape[1] != buffer.shape[1]):
            return None
        start, rest = divmod(held.data_ptr() - buffer.data_ptr(), buffer.stride(2) * buffer.element_size())
        # memory inside a live buffer is a view of it; past its first row and head a start exceeds the slots
        return start if rest == 0 and 0 <= start and start + held.shape[2] <= buffer.shape[2] else None

    def _append(self, which: int, held: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        length = held.shape[-2] if held.dim() == 4 else 0
        end = length + new.shape[-2]
        start = self._start(which, held)
        buffer = self.buffers[which]
        if start is None or start + end > buffer.shape[2]:
            buffer = self.buffers[which] = new.new_empty((*new.shape[:2], end + max(self.room, end // 4),
                                                          new.shape[3]))
            start = 0
            if length:
                buffer[:, :, :length] = held
        rows = new.shape[0]
        buffer[:rows, :, start + length:start + end] = new
        return buffer[:rows, :, start:start + end]

    def in_place(self) -> bool:
        """Whether ``keys`` and ``values`` are views of the buffers (rows can leave them in place)."""
        return self._start(0, self.keys) is not None and self._start(1, self.values) is not None


def roomy_cache(config, room: int = 64) -> DynamicCache:
    """``DynamicCache(config=config)`` with each plain ``DynamicLayer`` a ``RoomyLayer(room)`` (sliding-window and
    other layers as they are)."""
    cache = DynamicCache(config=config)
    cache.layers = [RoomyLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def _move_rows(tensors: list[torch.Tensor], to: list[int], source: list[int]) -> None:
    """Row ``source[i]`` of each tensor into its row ``to[i]``: one multi-tensor copy where no row is both read and
    written (the order ``RaggedCache.leave`` gives), else each tensor's rows gathered first."""
    if set(to).isdisjoint(source):
        torch._foreach_copy_([t[i] for t in tensors for i in to], [t[j] for t in tensors for j in source])
        return
    to_index, source_index = (torch.tensor(x, device=tensors[0].device) for x in (to, source))
    for t in tensors:
        t.index_copy_(0, to_index, t.index_select(0, source_index))


def displaced(accepted: torch.Tensor) -> torch.Tensor:
    """``[B, A]`` bool: where a row's ``j``-th accepted node (``accepted [B, A]``, ``-1`` = none) is not node ``j``,
    i.e. where ``RaggedCache.commit`` has to move a slot."""
    return (accepted >= 0) & (accepted != torch.arange(accepted.shape[1], device=accepted.device))


class RaggedCache:
    """A ``DynamicCache`` plus per-row slot validity and logical lengths."""

    def __init__(self, cache: DynamicCache, valid: torch.Tensor, lengths: torch.Tensor, compact_ratio: float = 0.25):
        self.cache = cache
        self.valid = valid  # [B, S] bool
        self.lengths = lengths  # [B] logical tokens in cache per row
        self.compact_ratio = compact_ratio

    @property
    def physical_length(self) -> int:
        return self.valid.shape[1]

    def _apply(self, fn) -> None:
        for layer in self.cache.layers:
            layer.keys = fn(layer.keys)
            layer.values = fn(layer.values)

    def _groups(self) -> list[list[tuple[object, str]]]:
        """Every layer's ``(layer, "keys" | "values")``, grouped by tensor shape and dtype: what one stacked kernel
        can move at once (the few slots a step appends; ``compact`` and ``keep_rows``, which move the whole cache
        now and then, stay per layer)."""
        groups: dict[tuple, list[tuple[object, str]]] = {}
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                groups.setdefault((t.shape, t.dtype), []).append((layer, name))
        return list(groups.values())

    def tree_attention_mask(self, ancestors: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive 4D mask ``[B, 1, n, S + n]``: valid past slots of the row + the node's tree ancestors."""
        batch, n, _ = ancestors.shape
        allowed = torch.cat([self.valid[:, None, :].expand(batch, n, -1), ancestors], dim=-1)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the current batch, in any order), then drop leading all-hole columns.
        Room-keeping layers move only the rows whose place changes (``rows[i] != i``) inside their buffers."""
        moved = (rows != torch.arange(rows.numel(), device=rows.device)).nonzero().squeeze(1)
        self._keep_moving(rows, moved.tolist(), rows[moved].tolist())

    def leave(self, alive: torch.Tensor) -> torch.Tensor:
        """Drop the rows not ``alive`` (``[B]`` bool): the rows that stay keep their places and the last ones move
        into those of the rows leaving, so room-keeping layers copy as many rows as leave, in one multi-tensor copy
        for every layer (kept in order, every row after the first leaver would move). Returns the rows kept, as
        indices into the former batch in their new order; one device-to-host read."""
        flags = alive.tolist()
        kept = list(compress(range(len(flags)), flags))
        count = len(kept)
        holes = list(compress(range(count), map(operator.not_, flags[:count])))
        movers = kept[count - len(holes):]  # the rows kept from past ``count``
        order = list(range(count))
        for hole, row in zip(holes, movers):
            order[hole] = row
        rows = torch.tensor(order, dtype=torch.long, device=alive.device)
        self._keep_moving(rows, holes, movers)
        return rows

    def _keep_moving(self, rows: torch.Tensor, to: list[int], source: list[int]) -> None:
        """``keep_rows`` with its moves known: row ``source[i]`` goes to ``to[i]``."""
        in_place = []
        for layer in self.cache.layers:
            if isinstance(layer, RoomyLayer) and layer.in_place():
                in_place.append(layer)
            else:
                layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        tensors = [t for layer in in_place for t in (layer.keys, layer.values)]
        if to and tensors:
            _move_rows(tensors, to, source)
        count = rows.numel()
        for layer in in_place:
            layer.keys, layer.values = layer.keys[:count], layer.values[:count]
        self.valid = self.valid.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self._trim_leading()

    def commit(self, accepted: torch.Tensor, width: int | None = None, longest: int | None = None,
               moved: bool | None = None) -> None:
        """After a tree forward appended ``n`` slots, keep each row's accepted ones, in path order.

        ``accepted [B, A]``: tree node indices (``-1`` = nothing, becomes a hole); ``width``, the most any row
        accepted, ``longest``, the most logical tokens any row holds after this commit, and ``moved``, whether any
        row accepted a node outside its own position (``accepted[b, j]`` neither ``j`` nor ``-1``), when the caller
        already read them (each is one device-to-host read otherwise). Where none moved, every accepted entry already
        sits in its slot and only the cache's end moves back: at one row most drafted steps (a 1-node step always,
        a 4-node drawn one ~85% of the time on SmolLM2).
        """
        past = self.physical_length
        if width is None:
            width = int((accepted >= 0).sum(1).max())
        accepted = accepted[:, :width]
        appended = self.cache.layers[0].keys.shape[2] - past
        if appended > 1:  # a lone root (no draft) is already in place
            if moved is None:
                moved = bool(displaced(accepted).any())
            if moved:
                self._gather_appended(past, appended, accepted.clamp(min=0))
            self._apply(lambda t: t.narrow(2, 0, past + width))  # a view: the next cache update copies anyway
        self.valid = torch.cat([self.valid, accepted >= 0], dim=1)
        self.lengths = self.lengths + (accepted >= 0).sum(1)
        holes = self.physical_length - (int(self.lengths.max()) if longest is None else longest)
        if holes > self.compact_ratio * self.physical_length:
            self.compact()

    def _gather_appended(self, past: int, appended: int, kept: torch.Tensor) -> None:
        """Copy each row's ``kept [B, width]`` appended slots to the ``width`` slots after ``past``: one stacked
        gather and one multi-tensor copy per tensor shape, not two kernels per layer (on a GPU each is a launch: 120
        of them for a 30-layer policy's keys and values)."""
        width = kept.shape[1]
        for group in self._groups():
            tensors = [getattr(layer, name) for layer, name in group]
            batch, heads, _, dim = tensors[0].shape
            block = torch.stack([t.narrow(2, past, appended) for t in tensors])
            chosen = block.gather(3, kept[None, :, None, :, None].expand(len(tensors), batch, heads, width, dim))
            torch._foreach_copy_([t.narrow(2, past, width) for t in tensors], list(chosen.unbind(0)))

    def compact(self) -> None:
        """Move every row's valid slots to the right end (order kept) and drop all-hole columns."""
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices  # holes first

        def gather(t):  # per layer: stacking the whole cache first would copy it twice
            return t.gather(2, order[:, None, :, None].expand(t.shape[0], t.shape[1], -1, t.shape[3]))

        self._apply(gather)
        self.valid = self.valid.gather(1, order)
        self._trim_leading()

    def _trim_leading(self) -> None:
        used = self.valid.any(0)
        if used.all() or not used.any():
            return
        first = int(used.int().argmax())
        if first:
            self._apply(lambda t: t[:, :, first:])
            self.valid = self.valid[:, first:]
