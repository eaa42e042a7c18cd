"""``DriftMonitor``: decides when the heads have gone stale for good.

One window is one generation round. Per head it smooths the acceptance rate and the candidate regret
(``1 - sum_{c in candidates} p(c)`` at verified nodes) with an EMA, and keeps a reference: the best smoothed
value since the last consolidation. A window is *drifted* when some head's smoothed acceptance is more than
``delta`` below its reference, or its smoothed regret more than ``delta_r`` above. The monitor fires after
``patience`` consecutive drifted windows, then stays quiet for ``cooldown`` windows. Isolated dips do not
fire: the EMA damps them and a single clean window resets the count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class DriftMonitor:
    """Per-head drift detector over generation rounds; ``update`` returns True when heads should be re-fitted.

    Args:
        num_heads: heads monitored.
        delta: acceptance drop below the reference that counts as drift.
        delta_r: regret rise above the reference that counts as drift.
        patience: consecutive drifted windows before firing.
        cooldown: windows ignored after firing (the consolidation needs time to show).
        smoothing: EMA factor of the per-window values (0 = no smoothing).
    """

    def __init__(self, num_heads: int, delta: float = 0.05, delta_r: float = 0.05, patience: int = 3,
                 cooldown: int = 5, smoothing: float = 0.5):
        if num_heads < 1:
            raise ValueError(f"DriftMonitor needs at least one head, got {num_heads}")
        if delta <= 0 or delta_r <= 0:
            raise ValueError(f"delta and delta_r must be > 0, got {delta} and {delta_r}")
        if patience < 1 or cooldown < 0:
            raise ValueError(f"patience must be >= 1 and cooldown >= 0, got {patience} and {cooldown}")
        if not 0 <= smoothing < 1:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.num_heads, self.delta, self.delta_r = num_heads, delta, delta_r
        self.patience, self.cooldown, self.smoothing = patience, cooldown, smoothing
        self.accept: list[float | None] = [None] * num_heads
        self.regret: list[float | None] = [None] * num_heads
        self.reset_reference()
        self.windows = self.fired = self.cooldown_left = 0

    def reset_reference(self) -> None:
        """Forget the references and the drift streak (call after the heads were re-fitted)."""
        self.ref_accept: list[float | None] = [None] * self.num_heads
        self.ref_regret: list[float | None] = [None] * self.num_heads
        self.accept = [None] * self.num_heads
        self.regret = [None] * self.num_heads
        self.streak = 0

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.smoothing * old + (1 - self.smoothing) * new

    def _track(self, smoothed: list, refs: list, h: int, value: float, best) -> float:
        """Smooth ``value`` into ``smoothed[h]`` and move the reference ``refs[h]`` to the ``best`` seen."""
        smoothed[h] = s = self._smooth(smoothed[h], float(value))
        refs[h] = s if refs[h] is None else best(refs[h], s)
        return s

    def update(self, accept: Sequence[float] | None, regret: Sequence[float] | None = None) -> bool:
        """Feed one window: per-head acceptance rates and candidate regrets (either may be ``None``, and NaN
        entries are skipped, e.g. a round that drafted nothing). Returns True when the monitor fires."""
        drifted = False
        seen = False
        for h in range(self.num_heads):
            a = None if accept is None else accept[h]
            if a is not None and not math.isnan(a):
                seen = True
                drifted |= self._track(self.accept, self.ref_accept, h, a, max) < self.ref_accept[h] - self.delta
            r = None if regret is None else regret[h]
            if r is not None and not math.isnan(r):
                seen = True
                drifted |= self._track(self.regret, self.ref_regret, h, r, min) > self.ref_regret[h] + self.delta_r
        if not seen:
            return False
        self.windows += 1
        self.streak = self.streak + 1 if drifted else 0
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            return False
        if self.streak >= self.patience:
            self.fired += 1
            self.cooldown_left = self.cooldown
            self.streak = 0
            return True
        return False

    def drop(self) -> float:
        """Largest acceptance drop below reference over heads (0 when none is known): the ``spec/drift`` metric."""
        drops = [r - a for a, r in zip(self.accept, self.ref_accept) if a is not None and r is not None]
        return max(drops, default=0.0)

    def state_dict(self) -> dict:
        keys = ("accept", "regret", "ref_accept", "ref_regret", "streak", "windows", "fired", "cooldown_left")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if not hasattr(self, key):
                raise KeyError(f"unknown DriftMonitor state key {key!r}")
            if isinstance(value, list) and len(value) != self.num_heads:
                raise ValueError(f"DriftMonitor state {key!r} has {len(value)} heads, expected {self.num_heads}")
            setattr(self, key, list(value) if isinstance(value, list) else value)
