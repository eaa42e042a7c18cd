"""``DriftMonitor``: decides when the heads have gone stale for good.

One window is one generation round. The monitor follows the acceptance as ``tau = 1 + sum_d a_d`` (``a_d``: the
share of drafted row-steps accepting at least ``d`` nodes, so ``tau`` is the mean accepted length of a drafted
step) and, per head, the candidate regret (``1 - sum_{c in candidates} p(c)`` at verified nodes). Each signal is
averaged over the last ``window`` windows, and its reference is the best such block mean since the last
consolidation. A window is *drifted* when the block mean of tau is more than ``delta`` (relative) below its
reference, or some head's block-mean regret more than ``delta_r`` above its own. The monitor fires after
``patience`` consecutive drifted windows, then stays quiet for ``cooldown`` windows.

Why block means and tau: with the online node budget a round may draft only 50-150 row-steps, so one round's
acceptance is noisy, and the best of single (or exponentially smoothed) values is biased upward by that noise
and fires on it. Replayed on rounds drawn around the acceptance measured on SmolLM2 with that noise (40 seeds):
at 150 drafted row-steps per round, block means of 4 rounds with ``patience`` 2 caught every sustained 5% drop
of tau (in about 5 rounds; an 8% drop in about 2) and never fired in the first 10 steady rounds, though 38% of
the steady runs fired once in the 30 rounds after (5% at 300 row-steps per round; the best single smoothed value
fired in 47% of runs within 10 rounds at 50 row-steps). A needless re-fit costs seconds, and its held-out check
undoes it if it does not help. ``tests/test_consolidation.py`` replays the 300 row-steps case.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence


class DriftMonitor:
    """Drift detector over generation rounds; ``update`` returns True when the heads should be re-fitted.

    Args:
        num_heads: heads monitored.
        delta: relative drop of tau's block mean below its reference that counts as drift (0.05: 5%).
        delta_r: rise of a head's block-mean regret above its reference that counts as drift.
        patience: consecutive drifted windows before firing.
        cooldown: windows ignored after firing (the consolidation needs time to show).
        window: windows averaged into one block mean (1: each window alone).
    """

    def __init__(self, num_heads: int, delta: float = 0.05, delta_r: float = 0.08, patience: int = 2,
                 cooldown: int = 3, window: int = 4):
        if num_heads < 1:
            raise ValueError(f"DriftMonitor needs at least one head, got {num_heads}")
        if not 0 < delta < 1 or delta_r <= 0:
            raise ValueError(f"delta must be in (0, 1) and delta_r > 0, got {delta} and {delta_r}")
        if patience < 1 or cooldown < 0:
            raise ValueError(f"patience must be >= 1 and cooldown >= 0, got {patience} and {cooldown}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.num_heads, self.delta, self.delta_r = num_heads, delta, delta_r
        self.patience, self.cooldown, self.window = patience, cooldown, window
        self.reset_reference()
        self.windows = self.fired = self.cooldown_left = 0

    def reset_reference(self) -> None:
        """Forget the recent windows, the references and the drift streak (call after the heads were re-fitted)."""
        self.taus: deque[float] = deque(maxlen=self.window)
        self.regrets: list[deque[float]] = [deque(maxlen=self.window) for _ in range(self.num_heads)]
        self.ref_tau: float | None = None
        self.ref_regret: list[float | None] = [None] * self.num_heads
        self.streak = 0

    def _block(self, values: deque, value: float) -> float | None:
        """Append ``value``; the block mean once ``window`` values are in, else ``None``."""
        values.append(value)
        return sum(values) / len(values) if len(values) == self.window else None

    def update(self, accept: Sequence[float] | None, regret: Sequence[float] | None = None) -> bool:
        """Feed one window: per-head acceptance rates and candidate regrets (either may be ``None``, and NaN
        entries are skipped, e.g. a round that drafted nothing). Returns True when the monitor fires."""
        drifted = seen = False
        if accept is not None and not any(math.isnan(a) for a in accept):
            seen = True
            tau = self._block(self.taus, 1.0 + sum(accept))
            if tau is not None:
                self.ref_tau = tau if self.ref_tau is None else max(self.ref_tau, tau)
                drifted = tau < (1 - self.delta) * self.ref_tau
        for h in range(self.num_heads):
            r = None if regret is None else regret[h]
            if r is not None and not math.isnan(r):
                seen = True
                block = self._block(self.regrets[h], float(r))
                if block is not None:
                    self.ref_regret[h] = block if self.ref_regret[h] is None else min(self.ref_regret[h], block)
                    drifted |= block > self.ref_regret[h] + self.delta_r
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
        """Relative drop of tau's latest block mean below its reference (0 until a block is complete): the
        ``spec/drift`` metric."""
        if self.ref_tau is None or len(self.taus) < self.window:
            return 0.0
        return 1.0 - sum(self.taus) / len(self.taus) / self.ref_tau

    def state_dict(self) -> dict:
        return {"taus": list(self.taus), "regrets": [list(r) for r in self.regrets], "ref_tau": self.ref_tau,
                "ref_regret": self.ref_regret, "streak": self.streak, "windows": self.windows, "fired": self.fired,
                "cooldown_left": self.cooldown_left}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; keys of monitors before the block-mean criterion (EMA values) are ignored,
        so an older checkpoint resumes with fresh references."""
        known = set(self.state_dict())
        for key, value in state.items():
            if key not in known:
                if key in ("accept", "ref_accept", "regret", "tau"):
                    continue
                raise KeyError(f"unknown DriftMonitor state key {key!r}")
            if key in ("regrets", "ref_regret") and len(value) != self.num_heads:
                raise ValueError(f"DriftMonitor state {key!r} has {len(value)} heads, expected {self.num_heads}")
            if key == "taus":
                value = deque(value, maxlen=self.window)
            elif key == "regrets":
                value = [deque(r, maxlen=self.window) for r in value]
            elif key == "ref_regret":
                value = list(value)
            setattr(self, key, value)
