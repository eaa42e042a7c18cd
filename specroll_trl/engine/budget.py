"""The node budget: how many draft nodes per row each decoding step verifies.

``OnlineBudget`` (the default) learns it from the engine's own steps, with no profiling pass:

* cost: per batch-size bucket, the step's wall time against draft nodes per row ``N``,
  ``t(B, N) = a + d [N > 0] + b N`` (``d``: the draft itself, heads and their vocabulary projection), fitted by
  exponentially weighted least squares on measured steps, starting from a prior that makes the first step draft
  (or, for a bucket met after another, from the line measured at the nearest one), plus each verification rule's
  own mean excess over it (top-k trees grow wider frontiers than drawn ones: at one row a 4-node top-k draft took
  11.3 ms, a drawn one 6.5);
* gain: expected committed tokens per row ``g(N) = 1 + k_N A(N)``, where ``A(N)`` is the mean over rows of the best
  ``N`` path scores of the tree (each node's estimated acceptance, summed: the heads' own probabilities for top-k
  trees, reach probabilities under the measured acceptance by depth and rank for drawn ones) and ``k_N`` the observed
  ratio of realised to predicted accepted nodes at width ``N`` (or the nearest width drafted), kept per verification
  rule (``AcceptanceByWidth``). "Realised" is what the engine reports for every width up to the step's own: the
  expected accepted nodes of the step's tree cut to its best ``1 .. N`` nodes, given the drafted tokens and the
  target's distributions (a narrower tree is the wider one's best nodes), which one step measures without the
  variance of one accept-or-reject walk;
* the cost of a width already measured is mostly its own mean step time, the fit filling in the others;
* each step takes the rule and width of ``argmax g(N) / t(B, N)`` (committed tokens per second), and now and then a
  neighbouring width, a plain step or the other rule, so that what is not chosen keeps being measured (the less
  often the slower it is predicted); the second step of every batch-size bucket is a plain one (``N = 0``), the
  anchor of its costs.

``FixedBudget`` is the formula of the method's paper, ``N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max)``, for a
user-set hardware capacity ``C_hw`` (among several rules, the one predicted to accept most at that width). Either
way the budget changes speed, never the distribution of what is emitted.
"""

from __future__ import annotations

import random

import torch


def node_budget(capacity: int, active_rows: int, max_nodes: int) -> int:
    """``N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max)``: draft nodes per row besides the root."""
    if active_rows <= 0:
        return 0
    return max(0, min(capacity // active_rows - 1, max_nodes))


class AcceptanceByWidth:
    """Expected accepted draft nodes per row for ``N = 0..N_max`` under one verification rule: the trees' own
    estimate (the best ``N`` path scores), scaled by the realised / predicted ratio measured at that width or, for a
    width never drafted, at the nearest one that was (heads trained at another temperature misjudge deep nodes more
    than shallow ones, so one ratio for all widths misprices both).

    Args:
        max_nodes: ``N_max``.
        prior_accept: before any tree was seen, the acceptance of the ``j``-th best node is
            ``prior_accept ** log2(j + 1)``.
        forget: weight kept by older measurements at each new one.
        per_width: one ratio per width, the nearest width's for one not drafted (top-k trees, priced by the heads' own
            probabilities), or each width's own ratio shrunk towards one ratio pooled over all widths by ``width_prior``
            steps' worth, the pooled one shrunk towards 1 by two steps' worth of belief in the trees (drawn trees,
            priced by the acceptance measured by depth and rank, nearly calibrated already). The pooled ratio's weight
            is counted in steps, not in the widths they report (a step reports every width up to its own): summed over
            widths, three 16-node steps on a truncated prompt (an engine's warm-up) that accepted 0.30 of what their
            trees predicted weighed 48 times the two steps' belief and priced drawn trees at 0.31 of their estimate (now
            0.59); at one row, one thread, T=0.7, the budget then drafted top-k trees only, where 2 drawn nodes every
            step ran 1.47x of ``generate`` against its 1.24x. With ratios per width alone, one step with nothing
            accepted priced a width and its neighbours at nothing (at one row, two threads, the budget stopped drafting:
            1.03x of ``generate`` where 2-4 nodes every step ran at 1.20-1.40x); with the pooled ratio alone, the reach
            overrated wide trees against narrow ones (one row, T=0.7: 0.99 / 1.04 accepted at 5 / 6 nodes predicted,
            0.80 / 0.85 realised; 0.68 at 2 predicted, 0.73 realised) and the budget drafted 5-6 nodes where 2 ran 10%
            faster.
        width_prior: see ``per_width``.
    """

    def __init__(self, max_nodes: int, prior_accept: float = 0.6, forget: float = 0.97, per_width: bool = True,
                 width_prior: float = 4.0):
        self.max_nodes, self.forget, self.per_width, self.width_prior = max_nodes, forget, per_width, width_prior
        self.prior_steps = 0.0 if per_width else 2.0
        nodes = torch.arange(1, max_nodes + 1, dtype=torch.float64)
        self.gain = torch.cat([torch.zeros(1, dtype=torch.float64), prior_accept ** torch.log2(nodes + 1)]).cumsum(0)
        self.width_accept = torch.zeros(3, max_nodes + 1, dtype=torch.float64)  # weight, realised, predicted
        self.steps = 0.0  # steps observed (faded like the rest): the pooled ratio's weight

    def accepted(self, prior_steps: float = 0.0) -> torch.Tensor:
        """Per width, the trees' estimate times the realised / predicted ratio measured at that width (or the nearest
        width measured; shrunk towards the ratio pooled over every width when not ``per_width``), shrunk towards 1
        by ``prior_steps`` more steps' worth of belief in the trees."""
        weight, realised, predicted = self.width_accept
        seen = (weight > 0).nonzero().squeeze(1)
        if not len(seen):
            return self.gain
        belief = self.prior_steps + prior_steps  # steps' worth of belief in the trees' own estimate
        if self.per_width:
            nodes = torch.arange(self.max_nodes + 1)
            nearest = seen[(nodes[:, None] - seen[None]).abs().argmin(1)]
            realised, predicted = realised[nearest], predicted[nearest]
            return self.gain * (realised + belief * self.gain) / (predicted + belief * self.gain).clamp(min=1e-9)
        pooled = (self.steps * realised.sum() / predicted.sum().clamp(min=1e-9) + belief) / (self.steps + belief)
        own = self.width_prior * self.gain
        return self.gain * (realised + own * pooled) / (predicted + own).clamp(min=1e-9)

    def observe(self, num_nodes: int, accepted: float | list[float], path_scores: torch.Tensor) -> None:
        """One step that drafted ``num_nodes`` per row: ``accepted``, the mean accepted nodes per row, or per width
        ``0 .. num_nodes`` the expected accepted nodes per row of the step's tree cut to its best that many nodes (a
        narrower tree is the wider one's best nodes, so one step measures every width up to its own); and the
        log-scores of every candidate path ``[B, P]``."""
        k = min(self.max_nodes, path_scores.shape[-1])
        best = path_scores.double().topk(k, dim=-1).values.exp().cumsum(-1).mean(0).cpu()  # A(N) for N = 1..k
        curve = torch.cat([torch.zeros(1, dtype=torch.float64), best,
                           best[-1].expand(self.max_nodes - k)])  # no more candidates past k
        self.gain = 0.8 * self.gain + 0.2 * curve
        self.width_accept *= self.forget
        self.steps = self.forget * self.steps + 1.0
        realised = torch.as_tensor(accepted, dtype=torch.float64).reshape(-1)
        widths = torch.arange(1, len(realised)) if len(realised) > 1 else torch.tensor([num_nodes])
        realised = realised[1:] if len(realised) > 1 else realised
        self.width_accept[:, widths] += torch.stack([torch.ones_like(realised), realised, curve[widths]])


class NodeBudget:
    """Chooses each step's verification rule (among ``rules``) and draft nodes per row; the engine reports every step
    back.

    Args:
        max_nodes: ``N_max``.
        rules: the verification rules it may choose from (the engine's ``candidates`` names), the first preferred.
        prior_accept, forget: of each rule's ``AcceptanceByWidth``.
        explore: probability of trying something other than the best choice (see the subclasses).
        seed: seeds those draws (a generator of its own: the sampling stream is untouched).
    """

    def __init__(self, max_nodes: int, rules: tuple[str, ...] = ("top-k",), prior_accept: float = 0.6,
                 forget: float = 0.97, explore: float = 0.1, seed: int = 0):
        self.max_nodes, self.rules, self.forget, self.explore = max_nodes, tuple(rules), forget, explore
        self.rng = random.Random(seed)
        self.prior_accept = prior_accept
        self.by_rule = {rule: self._acceptance(rule) for rule in self.rules}

    def _acceptance(self, rule: str) -> AcceptanceByWidth:
        return AcceptanceByWidth(self.max_nodes, self.prior_accept, self.forget, per_width=rule != "drawn")

    def plan(self, active_rows: int, rules: tuple[str, ...] | None = None) -> tuple[str, int]:
        """``(rule, nodes per row)`` for the next step, the rule among ``rules`` (default: the budget's own; greedy
        decoding can only match top-k candidates)."""
        raise NotImplementedError

    def _usable(self, rules: tuple[str, ...] | None) -> tuple[str, ...]:
        """``rules`` (default: the budget's own), each with an acceptance model from now on."""
        rules = rules or self.rules
        for rule in rules:
            if rule not in self.by_rule:
                self.by_rule[rule] = self._acceptance(rule)
        return rules

    def choose(self, active_rows: int) -> int:
        """Draft nodes per row for the next step (its rule: ``plan``)."""
        return self.plan(active_rows)[1]

    def accepted(self, rule: str | None = None, prior_steps: float = 0.0) -> torch.Tensor:
        """Expected accepted draft nodes per row for ``N = 0..N_max`` under ``rule`` (default: the first); with
        ``prior_steps``, an optimistic estimate (``AcceptanceByWidth.accepted``)."""
        return self.by_rule[rule or self.rules[0]].accepted(prior_steps)

    def observe(self, active_rows: int, num_nodes: int, seconds: float | None, accepted: float | list[float],
                path_scores: torch.Tensor | None, rule: str | None = None) -> None:
        """One step: its nodes per row, wall seconds (``None``: not a typical step's, not timed), its acceptance
        (``AcceptanceByWidth.observe``), (when it drafted) the ``[B, P]`` log-scores of every candidate path (what the
        tree was chosen from) and its rule."""
        if path_scores is not None and num_nodes:
            rule = self._usable((rule or self.rules[0],))[0]  # may be one the budget was not built with
            self.by_rule[rule].observe(num_nodes, accepted, path_scores)

    @property
    def calibration(self) -> float:
        """Realised over predicted accepted nodes, over every rule and width drafted (recent steps weigh more)."""
        _, realised, predicted = sum(r.width_accept for r in self.by_rule.values()).sum(1)
        return float(realised / predicted) if predicted > 0 else 1.0


class FixedBudget(NodeBudget):
    """``node_budget`` with a fixed ``C_hw``; among several rules, the one predicted to accept most at that width
    (another one now and then, so that its acceptance keeps being measured)."""

    def __init__(self, capacity: int, max_nodes: int, rules: tuple[str, ...] = ("top-k",), **options):
        super().__init__(max_nodes, rules, **options)
        self.capacity = capacity

    def plan(self, active_rows: int, rules: tuple[str, ...] | None = None) -> tuple[str, int]:
        rules = self._usable(rules)
        nodes = node_budget(self.capacity, active_rows, self.max_nodes)
        if not nodes:
            return rules[0], 0
        best = max(rules, key=lambda rule: float(self.accepted(rule)[nodes]))
        if len(rules) > 1 and nodes and self.rng.random() < self.explore:
            best = self.rng.choice(rules)
        return best, nodes


class OnlineBudget(NodeBudget):
    """Maximises expected committed tokens per second from measured step times and verified acceptance.

    Args:
        max_nodes: ``N_max``.
        rules: the verification rules to choose from (the first preferred on a tie).
        prior_capacity: query tokens per forward the prior assumes cost like one (sets the first steps' budget).
        prior_draft_cost: the prior's cost of drafting, as a share of a plain step.
        prior_accept: the prior's acceptance of the tree's ``j``-th best node is ``prior_accept ** log2(j + 1)``.
        forget: weight kept by older measurements at each new one (exponential forgetting).
        explore: probability of trying a neighbouring width (or the other rule at the best width) instead of the best
            choice when the two are predicted as fast; one predicted at ``r`` times the best's rate is tried ``r ** 4``
            as often (on 2 CPU cores a drafted node costs 2x a plain step at 32-64 rows: tried as often as a near
            tie, it cost ~2% of speed). ``r`` is optimistic: the other choice's acceptance shrunk towards the trees'
            own estimate by ``optimism`` steps (else one unlucky step, a width tried once with nothing accepted,
            priced it and its neighbours at nothing and they were never tried again: at one row, two threads, the
            budget stopped drafting, 1.03x of ``generate`` where 2-4 nodes every step ran at 1.20-1.40x).
        trust: measurements of one width needed before its own mean counts as much as the models' prediction.
        optimism: steps' worth of belief in the trees' own acceptance estimate when deciding what to explore.
        seed: seeds the exploration draws (a generator of its own: the sampling stream is untouched).
    """

    def __init__(self, max_nodes: int, rules: tuple[str, ...] = ("top-k",), prior_capacity: int = 64,
                 prior_draft_cost: float = 0.1, prior_accept: float = 0.6, forget: float = 0.97, explore: float = 0.1,
                 trust: float = 2.0, optimism: float = 0.5, seed: int = 0):
        super().__init__(max_nodes, rules, prior_accept, forget, explore, seed)
        self.prior_capacity, self.prior_draft_cost, self.trust = prior_capacity, prior_draft_cost, trust
        self.optimism = optimism
        self.fits: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (X^T W X, X^T W t)
        self.width_seconds: dict[int, torch.Tensor] = {}  # bucket -> [2, N_max + 1]: (weight, weighted seconds)
        self.rule_excess: dict[int, dict[str, torch.Tensor]] = {}  # bucket -> rule -> (weight, weighted excess)
        self.pooled: dict[int, torch.Tensor] = {}  # active rows -> pooled cost, until the next step is measured

    @staticmethod
    def _bucket(rows: int) -> int:
        return 1 << max(0, rows - 1).bit_length()

    def _features(self, nodes: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.ones_like(nodes), (nodes > 0).double(), nodes], dim=-1)

    def cost(self, active_rows: int, rule: str | None = None) -> torch.Tensor:
        """Predicted seconds of a step (relative, when nothing was measured yet) for ``N = 0..N_max``, drafting
        with ``rule`` (``None``: any, their steps pooled): the pooled cost plus the rule's mean excess over it at the
        widths it drafted, shrunk towards none by ``trust`` steps. The pooled cost: each width's own
        mean step time where it was measured, shrunk towards the linear fit of all widths (which alone covers the
        widths not measured yet), or towards the line between the measured widths on either side where that is
        cheaper (a fit to a plain step and wide trees only puts every narrow width near the wide ones' cost, and a
        width predicted too dear is never tried, so never corrected: at one row, two threads, 145 ms predicted for
        one node against 93 measured). Past the widest width measured, no cheaper than the chord from the plain step
        through it, extended (a fit to a plain step and two noisy narrow widths can slope down: at eight rows, two
        threads, it priced 16 nodes below 2, and the budget spent steps of 693 ms where plain ones took 116)."""
        pooled = self.pooled.get(active_rows)
        if pooled is None:
            pooled = self.pooled[active_rows] = self._pooled_cost(active_rows)
        excess = self.rule_excess.get(self._bucket(active_rows), {}).get(rule)
        if excess is None:
            return pooled
        extra = torch.full_like(pooled, float(excess[1] / (excess[0] + self.trust)))
        extra[0] = 0.0  # a plain step drafts nothing
        return (pooled + extra).clamp(min=1e-9)

    def _pooled_cost(self, active_rows: int) -> torch.Tensor:
        nodes = torch.arange(self.max_nodes + 1, dtype=torch.float64)
        bucket = self._bucket(active_rows)
        fit = self.fits.get(bucket)
        prior = self._prior(active_rows)
        if fit is None:
            return self._features(nodes) @ prior
        model = self._features(nodes) @ self._line(fit, prior)
        weight, seconds = self.width_seconds[bucket]
        seen = (weight > 0).nonzero().squeeze(1)
        if len(seen) > 1:
            means = seconds[seen] / weight[seen]
            right = torch.searchsorted(seen, nodes.long()).clamp(1, len(seen) - 1)
            x0, x1, y0, y1 = seen[right - 1], seen[right], means[right - 1], means[right]
            between = y0 + (y1 - y0) * (nodes - x0) / (x1 - x0)
            inside = (nodes >= seen[0]) & (nodes <= seen[-1])
            model = torch.where(inside, torch.minimum(model, between), model)
            if seen[0] == 0:  # past the widest width measured, no cheaper than the chord from the plain step to it
                chord = means[-1] + (nodes - seen[-1]) * (means[-1] - means[0]).clamp(min=0) / seen[-1]
                model = torch.where(nodes > seen[-1], torch.maximum(model, chord), model)
        return ((seconds + self.trust * model.clamp(min=1e-9)) / (weight + self.trust)).clamp(min=1e-9)

    @staticmethod
    def _line(fit: tuple[torch.Tensor, torch.Tensor], prior: torch.Tensor) -> torch.Tensor:
        """``[a, d, b]`` fitted to one bucket's steps, shrunk towards ``prior`` (relative to a plain step)."""
        gram, moment = fit
        scale = moment[0] / gram[0, 0]  # mean measured seconds: the prior acts in those units
        ridge = 1e-2 * torch.eye(3, dtype=torch.float64)
        return torch.linalg.solve(gram + ridge, moment + ridge @ (prior * scale))

    def _prior(self, active_rows: int) -> torch.Tensor:
        """``[a, d, b]`` relative to a plain step (``a = 1``) for a bucket of ``active_rows``: the line measured at the
        nearest other bucket (the one of more rows between two as near: on CPU a node costs a larger share of a step
        with more rows, so a borrowed line errs towards drafting less), else ``prior_capacity``'s. A bucket met late
        in a call (the last rows of a batch) then starts from what the batch measured, not from wide trees: at
        eight rows, two threads, the prior's 6-12 node trees were a call's last steps, call after call."""
        own = self._bucket(active_rows)
        prior = torch.tensor([1.0, self.prior_draft_cost, active_rows / self.prior_capacity], dtype=torch.float64)
        others = [b for b in self.fits if b != own]
        if not others:
            return prior
        near = min(others, key=lambda b: (abs(b.bit_length() - own.bit_length()), -b))
        line = self._line(self.fits[near], torch.tensor([1.0, self.prior_draft_cost, near / self.prior_capacity],
                                                        dtype=torch.float64))
        return (line / line[0].clamp(min=1e-12)).clamp(min=0.0).index_fill(0, torch.tensor([0]), 1.0)

    def plan(self, active_rows: int, rules: tuple[str, ...] | None = None) -> tuple[str, int]:
        rules = self._usable(rules)
        if active_rows <= 0 or self.max_nodes == 0:  # nothing to draft (exploring the other rule would ask width 1)
            return rules[0], 0
        measured = self.width_seconds.get(self._bucket(active_rows))
        if measured is not None and measured[0, 0] == 0:
            return rules[0], 0  # a plain step anchors the cost model: else every width looks as dear as the first
        cost = torch.stack([self.cost(active_rows, rule) for rule in rules])  # [rules, N_max + 1]
        rate = torch.stack([1.0 + self.accepted(rule) for rule in rules]) / cost
        flat = int(rate.argmax())
        rule, best = divmod(flat, rate.shape[1])
        if self.rng.random() < self.explore:
            others = [(rule, 0), (rule, max(0, best // 2)), (rule, min(self.max_nodes, max(1, 2 * best)))]
            others += [(r, max(1, best)) for r in range(len(rules)) if r != rule]
            other = self.rng.choice(others)
            hope = (1.0 + self.accepted(rules[other[0]], self.optimism)[other[1]]) / cost[other]
            if self.rng.random() < float(hope / rate[rule, best]) ** 4:
                rule, best = other
        return rules[rule], best

    def observe(self, active_rows, num_nodes, seconds, accepted, path_scores, rule=None):
        super().observe(active_rows, num_nodes, seconds, accepted, path_scores, rule)
        if seconds is None:
            return
        bucket = self._bucket(active_rows)
        excess = self.rule_excess.setdefault(bucket, {})
        for measured in excess.values():
            measured *= self.forget
        if num_nodes and bucket in self.fits:  # against the pooled cost before this step counts in it
            rule = rule or self.rules[0]
            gap = seconds - float(self.cost(active_rows)[num_nodes])
            excess[rule] = excess.get(rule, torch.zeros(2, dtype=torch.float64)) + torch.tensor(
                [1.0, gap], dtype=torch.float64)
        x = self._features(torch.tensor(float(num_nodes), dtype=torch.float64))
        gram, moment = self.fits.get(bucket, (torch.zeros(3, 3, dtype=torch.float64),
                                              torch.zeros(3, dtype=torch.float64)))
        self.fits[bucket] = (self.forget * gram + torch.outer(x, x), self.forget * moment + x * seconds)
        width = self.width_seconds.get(bucket, torch.zeros(2, self.max_nodes + 1, dtype=torch.float64))
        width *= self.forget
        width[:, num_nodes] += torch.tensor([1.0, seconds], dtype=torch.float64)
        self.width_seconds[bucket] = width
        self.pooled.clear()

    def state(self) -> dict:
        """What the budget currently believes (for logging and tests)."""
        return {"calibration": self.calibration, "accepted": {r: self.accepted(r).tolist() for r in self.rules},
                "buckets": sorted(self.fits), "prior_capacity": self.prior_capacity}


__all__ = ["AcceptanceByWidth", "FixedBudget", "NodeBudget", "OnlineBudget", "node_budget"]
