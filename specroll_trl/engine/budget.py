"""The node budget: how many draft nodes per row each decoding step verifies.

``OnlineBudget`` (the default) learns it from the engine's own steps, with no profiling pass:

* cost: per batch-size bucket, the step's wall time against draft nodes per row ``N``,
  ``t(B, N) = a + d [N > 0] + b N`` (``d``: the draft itself, heads and their vocabulary projection), fitted by
  exponentially weighted least squares on measured steps, starting from a prior that makes the first step draft;
* gain: expected committed tokens per row ``g(N) = 1 + k_N A(N)``, where ``A(N)`` is the mean over rows of the best
  ``N`` path scores of the tree (the heads' own estimate of each node's acceptance, summed) and ``k_N`` the observed
  ratio of realised to predicted accepted nodes at width ``N`` (or the nearest width drafted);
* the cost of a width already measured is mostly its own mean step time, the fit filling in the others;
* each step takes ``argmax_N g(N) / t(B, N)`` (committed tokens per second), and now and then a neighbour of it or
  a plain step, so that the cost of other widths keeps being measured (the less often the slower it is predicted);
  the second step of every batch-size bucket is a plain one (``N = 0``), the anchor of its costs.

``FixedBudget`` is the formula of the method's paper, ``N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max)``, for a
user-set hardware capacity ``C_hw``. Either way the budget changes speed, never what is emitted.
"""

from __future__ import annotations

import random

import torch


def node_budget(capacity: int, active_rows: int, max_nodes: int) -> int:
    """``N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max)``: draft nodes per row besides the root."""
    if active_rows <= 0:
        return 0
    return max(0, min(capacity // active_rows - 1, max_nodes))


class NodeBudget:
    """Chooses each step's draft nodes per row; the engine reports every step back."""

    def choose(self, active_rows: int) -> int:
        raise NotImplementedError

    def observe(self, active_rows: int, num_nodes: int, seconds: float, accepted: float,
                path_scores: torch.Tensor | None) -> None:
        """One step: its nodes per row, wall seconds, mean accepted draft nodes per row, and (when it drafted) the
        ``[B, P]`` log-scores of every candidate path (what the tree was chosen from)."""


class FixedBudget(NodeBudget):
    """``node_budget`` with a fixed ``C_hw``."""

    def __init__(self, capacity: int, max_nodes: int):
        self.capacity, self.max_nodes = capacity, max_nodes

    def choose(self, active_rows: int) -> int:
        return node_budget(self.capacity, active_rows, self.max_nodes)


class OnlineBudget(NodeBudget):
    """Maximises expected committed tokens per second from measured step times and verified acceptance.

    Args:
        max_nodes: ``N_max``.
        prior_capacity: query tokens per forward the prior assumes cost like one (sets the first steps' budget).
        prior_draft_cost: the prior's cost of drafting, as a share of a plain step.
        prior_accept: the prior's acceptance of the tree's ``j``-th best node is ``prior_accept ** log2(j + 1)``.
        forget: weight kept by older measurements at each new one (exponential forgetting).
        explore: probability of trying a neighbouring width instead of the best one when the two are predicted as
            fast; one predicted at ``r`` times the best's rate is tried ``r ** 4`` as often (on 2 CPU cores a
            drafted node costs 2x a plain step at 32-64 rows: tried as often as a near tie, it cost ~2% of speed).
        trust: measurements of one width needed before its own mean counts as much as the models' prediction.
        seed: seeds the exploration draws (a generator of its own: the sampling stream is untouched).
    """

    def __init__(self, max_nodes: int, prior_capacity: int = 64, prior_draft_cost: float = 0.1,
                 prior_accept: float = 0.6, forget: float = 0.97, explore: float = 0.1, trust: float = 2.0,
                 seed: int = 0):
        self.max_nodes = max_nodes
        self.prior_capacity, self.prior_draft_cost = prior_capacity, prior_draft_cost
        self.forget, self.explore, self.trust = forget, explore, trust
        self.rng = random.Random(seed)
        nodes = torch.arange(1, max_nodes + 1, dtype=torch.float64)
        self.gain = torch.cat([torch.zeros(1, dtype=torch.float64), prior_accept ** torch.log2(nodes + 1)]).cumsum(0)
        self.fits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (X^T W X, X^T W t)
        self.width_seconds: dict[int, torch.Tensor] = {}  # bucket -> [2, N_max + 1]: (weight, weighted seconds)
        self.width_accept = torch.zeros(3, max_nodes + 1, dtype=torch.float64)  # weight, realised, predicted

    @staticmethod
    def _bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _features(self, nodes: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.ones_like(nodes), (nodes > 0).double(), nodes], dim=-1)

    def cost(self, active_rows: int) -> torch.Tensor:
        """Predicted step seconds (relative, when nothing was measured yet) for ``N = 0..N_max``: each width's own
        mean step time where it was measured, shrunk towards the linear fit of all widths (which alone covers the
        widths not measured yet)."""
        nodes = torch.arange(self.max_nodes + 1, dtype=torch.float64)
        bucket = self._bucket(active_rows)
        fit = self.fits.get(bucket)
        prior = torch.tensor([1.0, self.prior_draft_cost, active_rows / self.prior_capacity], dtype=torch.float64)
        if fit is None:
            return self._features(nodes) @ prior
        gram, moment = fit
        scale = moment[0] / gram[0, 0]  # mean measured seconds: the prior acts in those units
        ridge = 1e-2 * torch.eye(3, dtype=torch.float64)
        model = (self._features(nodes) @ torch.linalg.solve(gram + ridge, moment + ridge @ (prior * scale)))
        weight, seconds = self.width_seconds[bucket]
        return ((seconds + self.trust * model.clamp(min=1e-9)) / (weight + self.trust)).clamp(min=1e-9)

    def accepted(self) -> torch.Tensor:
        """Expected accepted draft nodes per row for ``N = 0..N_max``: the heads' own estimate (their best ``N``
        path scores), scaled by the realised / predicted ratio measured at that width or, for a width never
        drafted, at the nearest one that was (heads trained at another temperature misjudge deep nodes more
        than shallow ones, so one ratio for all widths misprices both)."""
        weight, realised, predicted = self.width_accept
        seen = (weight > 0).nonzero().squeeze(1)
        if not len(seen):
            return self.gain
        nodes = torch.arange(self.max_nodes + 1)
        nearest = seen[(nodes[:, None] - seen[None]).abs().argmin(1)]
        ratio = realised[nearest] / predicted[nearest].clamp(min=1e-9)
        return self.gain * ratio

    def choose(self, active_rows: int) -> int:
        if active_rows <= 0:
            return 0
        measured = self.width_seconds.get(self._bucket(active_rows))
        if measured is not None and measured[0, 0] == 0:
            return 0  # a plain step anchors the cost model: without one, every width looks as dear as the first tried
        rate = (1.0 + self.accepted()) / self.cost(active_rows)
        best = int(rate.argmax())
        if self.rng.random() < self.explore:
            other = self.rng.choice([0, max(0, best // 2), min(self.max_nodes, max(1, 2 * best))])
            if self.rng.random() < float(rate[other] / rate[best]) ** 4:
                return other
        return best

    def observe(self, active_rows, num_nodes, seconds, accepted, path_scores):
        bucket = self._bucket(active_rows)
        x = self._features(torch.tensor(float(num_nodes), dtype=torch.float64))
        gram, moment = self.fits.get(bucket, (torch.zeros(3, 3, dtype=torch.float64),
                                              torch.zeros(3, dtype=torch.float64)))
        self.fits[bucket] = (self.forget * gram + torch.outer(x, x), self.forget * moment + x * seconds)
        width = self.width_seconds.get(bucket, torch.zeros(2, self.max_nodes + 1, dtype=torch.float64))
        width *= self.forget
        width[:, num_nodes] += torch.tensor([1.0, seconds], dtype=torch.float64)
        self.width_seconds[bucket] = width
        if path_scores is None or num_nodes == 0:
            return
        k = min(self.max_nodes, path_scores.shape[-1])
        best = path_scores.double().topk(k, dim=-1).values.exp().cumsum(-1).mean(0)  # A(N) for N = 1..k
        curve = torch.cat([torch.zeros(1, dtype=torch.float64), best,
                           best[-1].expand(self.max_nodes - k)])  # no more candidates past k
        self.gain = 0.8 * self.gain + 0.2 * curve
        self.width_accept *= self.forget
        self.width_accept[:, num_nodes] += torch.tensor([1.0, accepted, float(curve[num_nodes])], dtype=torch.float64)

    @property
    def calibration(self) -> float:
        """Realised over predicted accepted nodes, over every width drafted (recent steps weigh more)."""
        _, realised, predicted = self.width_accept.sum(1)
        return float(realised / predicted) if predicted > 0 else 1.0

    def state(self) -> dict:
        """What the budget currently believes (for logging and tests)."""
        return {"calibration": self.calibration, "gain": self.gain.tolist(), "accepted": self.accepted().tolist(),
                "buckets": sorted(self.fits), "prior_capacity": self.prior_capacity}


__all__ = ["FixedBudget", "NodeBudget", "OnlineBudget", "node_budget"]
