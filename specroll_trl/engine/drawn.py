"""Drafts drawn from the heads' distribution ``q``, verified by recursive rejection sampling (lossless).

The contract, per tree node ``v`` whose target distribution is ``p`` (``generate``'s processed distribution, as for
every rule) and whose children ``c_1 .. c_m`` were proposed, in that order, from distributions ``q_1 .. q_m``, each
known before its child is checked:

* ``p_1 = p``; child ``c_i`` is accepted with probability ``alpha_i = min(1, p_i(c_i) / q_i(c_i))``;
* on its rejection ``p_{i+1} = norm(max(p_i - q_i, 0))``; if every child is rejected, the step emits a sample of
  ``p_{m+1}``.

Each child is one single-draft rejection sample whose rejection branch produces ``p_{i+1}`` exactly (by induction
on the children left), so what is emitted at ``v`` is distributed as ``p`` whatever the ``q_i`` are, provided each
``c_i`` really is a draw of ``q_i`` given everything drawn before it. Two kinds of children satisfy that:

* *fixed* (the first ``fixed`` children: the top tokens of ``q``): ``q_i`` is a point mass, so ``alpha_i = p_i(c_i)``
  and the residual is ``p_i`` without ``c_i``: the first ``f`` fixed children are accepted with ``p``'s mass on
  them, exactly as sample-then-match accepts deterministic candidates;
* *drawn* (the others): without replacement from ``q`` with the earlier children removed and renormalised
  (Gumbel-top-k, i.e. one Plackett-Luce sample), ``q_i`` that restricted ``q``. One drawn child alone is accepted
  with ``sum_x min(p(x), q(x)) = 1 - TV(p, q)``, which no entropy of ``p`` caps. A rejected child has
  ``p_{i+1}(c_i) = 0``, so drawing the next one without it loses nothing (with replacement it could come again,
  and be rejected for sure: on the shipped SmolLM2 heads, four children with replacement are accepted 2-3 points
  less often at T=1.0 and 7-8 less at T=0.7, ``scripts/drawn_children_probe.py``).

``q`` is the heads' distribution at the run's temperature after the hooks' adjustments, over the draft vocabulary
and zero elsewhere (the residual covers the rest). A drawn child of ``q``-mass 0 (``q`` ran out of support) is no
child. Greedy decoding never draws: ``SpeculativeGenerator`` verifies top-k candidates by matching there.

Which children a tree holds must not depend on the drawn tokens (a child kept only when it looks likely is no
longer a draw of ``q``). The tree's *shape* is therefore chosen before drawing, from the verifier's measured
acceptance by depth and rank (``AcceptanceByRank``): node scores are ``P(the walk reaches the node)`` under those
rates, and the best ``N`` form the tree (``TreeShape``), the same for every row of a step.

Unlike sample-then-match, what is emitted depends on the drafts (the same seed with another tree gives another,
equally distributed, rollout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tree import DraftTree, GrownTree
from .verify import inverse_cdf

TINY = 1e-30


@dataclass
class TreeShape:
    """A tree of ``1 + N`` nodes fixed before drawing (node 0 = root, parents before children).

    ``parent [1+N]`` (-1 for the root), ``rank [1+N]`` (position among its siblings), ``depth [1+N]``,
    ``children [1+N, K]`` (node indices by rank, -1 padded), ``ancestor_at [1+N, H+1]`` (the node's ancestor at each
    depth, the root past its own depth), ``log_reach [1+N]`` (log-probability that the walk reaches the node).
    """

    parent: torch.Tensor
    rank: torch.Tensor
    depth: torch.Tensor
    children: torch.Tensor
    ancestor_at: torch.Tensor
    log_reach: torch.Tensor
    max_depth: int = 0
    # per depth d = 1..max_depth: (frontier node indices [f], children drawn per frontier node w, the tree's nodes
    # among those children [k], and their slots in the flattened [f * w] draws)
    levels: tuple = ()

    def __post_init__(self):
        if not self.levels and self.parent.device.type == "cpu":  # read once, here, never in the decoding loop
            self.max_depth = int(self.depth.max())
            levels = []
            for d in range(self.max_depth):
                frontier = ((self.depth == d) & (self.children[:, 0] >= 0)).nonzero().squeeze(1)
                width = int((self.children[frontier] >= 0).sum(1).max())
                kids = self.children[frontier, :width].flatten()
                slots = (kids >= 0).nonzero().squeeze(1)
                levels.append((frontier, width, kids[slots], slots))
            self.levels = tuple(levels)

    @property
    def size(self) -> int:
        return self.parent.shape[0]

    @classmethod
    def best_first(cls, edge: torch.Tensor, num_nodes: int) -> TreeShape:
        """The ``num_nodes`` nodes of highest reach probability, grown greedily: ``edge [H, K]`` is the probability
        that the walk, at a node of depth ``d``, moves into its child of rank ``r``. A child of rank ``r`` becomes a
        candidate once its parent and its rank ``r - 1`` sibling are in the tree (children are drawn in rank
        order), so the kept set is closed under parent and under earlier siblings."""
        num_heads, width = edge.shape
        log_edge = edge.double().clamp(min=TINY).log().tolist()
        parent, rank, depth, log_reach, kids = [-1], [0], [0], [0.0], [0]
        for _ in range(num_nodes):
            best, best_score = -1, -math.inf
            for node in range(len(parent)):
                if depth[node] < num_heads and kids[node] < width:
                    score = log_reach[node] + log_edge[depth[node]][kids[node]]
                    if score > best_score:
                        best, best_score = node, score
            if best < 0:
                break
            parent.append(best)
            rank.append(kids[best])
            depth.append(depth[best] + 1)
            log_reach.append(best_score)
            kids.append(0)
            kids[best] += 1
        size = len(parent)
        children = torch.full((size, width), -1, dtype=torch.long)
        ancestor_at = torch.zeros((size, num_heads + 1), dtype=torch.long)
        for node in range(1, size):
            children[parent[node], rank[node]] = node
            up = node
            while up > 0:
                ancestor_at[node, depth[up]] = up
                up = parent[up]
        return cls(torch.tensor(parent), torch.tensor(rank), torch.tensor(depth), children, ancestor_at,
                   torch.tensor(log_reach, dtype=torch.float64))

    def prefix(self, num_nodes: int) -> TreeShape:
        """The first ``num_nodes`` nodes after the root: greedy growth is incremental, so this is the best tree of
        that size."""
        n = min(num_nodes + 1, self.size)
        children = self.children[:n]
        return TreeShape(self.parent[:n], self.rank[:n], self.depth[:n], torch.where(children < n, children, -1),
                         self.ancestor_at[:n], self.log_reach[:n])

    def to(self, device) -> TreeShape:
        return TreeShape(*(t.to(device) for t in (self.parent, self.rank, self.depth, self.children,
                                                  self.ancestor_at, self.log_reach)),
                         self.max_depth, tuple((frontier.to(device), width, kept.to(device), slots.to(device))
                               for frontier, width, kept, slots in self.levels))


class AcceptanceByRank:
    """What the verifier accepts, by depth and rank: ``alpha[d, r]``, the mean chance that the rank-``r`` child of a
    node at depth ``d`` is accepted once its earlier siblings were rejected (exact per verified node, averaged with
    exponential forgetting), and the tree shapes it implies.

    Args:
        num_heads / width: ``H`` (deepest depth) and ``K`` (children per node at most).
        prior: ``alpha`` before anything was verified, for rank 0 and for the later ranks.
        prior_weight: how many verified nodes the prior counts as.
        forget: weight kept by older observations at each step.
        refresh: steps between two recomputations of the shapes (a shape is a short Python loop).
    """

    def __init__(self, num_heads: int, width: int, prior: tuple[float, float] = (0.4, 0.25),
                 prior_weight: float = 8.0, forget: float = 0.995, refresh: int = 16):
        alpha = torch.full((num_heads, width), prior[1], dtype=torch.float64)
        alpha[:, 0] = prior[0]
        self.weight = torch.full((num_heads, width), prior_weight, dtype=torch.float64)
        self.total = alpha * prior_weight
        self.forget, self.refresh = forget, refresh
        self._shape: TreeShape | None = None  # the widest tree asked for, on the CPU
        self._prefixes: dict[int, TreeShape] = {}  # its prefixes, on the device
        self._since = 0

    @property
    def alpha(self) -> torch.Tensor:
        return self.total / self.weight

    def edge(self) -> torch.Tensor:
        """``[H, K]``: probability that the walk moves from a node of depth ``d`` into its rank-``r`` child (on the
        CPU: read when a shape is recomputed, every ``refresh`` steps)."""
        return first_accepted(self.alpha).cpu()

    def shape(self, num_nodes: int, device=None) -> TreeShape:
        """The best tree of ``num_nodes`` nodes under the current rates (recomputed every ``refresh`` steps)."""
        widest = 0 if self._shape is None else self._shape.size - 1
        if self._shape is None or widest < num_nodes or self._since >= self.refresh:
            self._shape = TreeShape.best_first(self.edge(), max(num_nodes, widest))
            self._prefixes, self._since = {}, 0
        if num_nodes not in self._prefixes:
            self._prefixes[num_nodes] = self._shape.prefix(num_nodes).to(device)
        return self._prefixes[num_nodes]

    def observe(self, alpha_sum: torch.Tensor, tried: torch.Tensor) -> None:
        """One step: per ``(depth, rank)`` the summed acceptance chances of the children tried and their number."""
        if self.total.device != tried.device:  # kept where the walk counts: no host read per step
            self.total, self.weight = self.total.to(tried.device), self.weight.to(tried.device)
        depth = tried.shape[0]  # a shallow tree tells nothing of the deeper depths
        self.weight *= self.forget
        self.total *= self.forget
        self.weight[:depth] += tried
        self.total[:depth] += alpha_sum
        self._since += 1


def first_accepted(alpha: torch.Tensor) -> torch.Tensor:
    """``alpha [..., K]`` (each rank's acceptance once the earlier ones were rejected) -> the chance that rank ``r``
    is the child accepted."""
    rejected_before = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1 - alpha[..., :-1]], -1), -1)
    return rejected_before * alpha


def rank_acceptance(p: torch.Tensor, q: torch.Tensor, children: torch.Tensor, fixed: int):
    """The rejection chain at nodes with target ``p [..., V]``, heads' ``q [..., V]`` and children ``children [..., K]``
    (indices into the last axis, rank order, ``-1``: none).

    Returns ``alpha [..., K]`` (each child's acceptance chance once its earlier siblings were rejected; 0 for no
    child) and ``residual [..., V]`` (what is sampled when every child is rejected).
    """
    has, index = children >= 0, children.clamp(min=0)
    alphas = []
    for r in range(children.shape[-1]):
        at = index[..., r:r + 1]
        if r < fixed:
            q_r = torch.zeros_like(p).scatter_(-1, at, 1.0)
        else:
            q_r = q / q.sum(-1, keepdim=True).clamp(min=TINY)
        q_c, p_c = q_r.gather(-1, at), p.gather(-1, at)
        real = has[..., r:r + 1] & (q_c > 0)
        alphas.append(torch.where(real, (p_c / q_c.clamp(min=TINY)).clamp(max=1.0), 0.0))
        residual = (p - q_r).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # a residual of mass ~0 means p == q_r: that child is accepted surely, so its residual is never sampled
        p = torch.where(real & (mass > 1e-12), residual / mass.clamp(min=TINY), p)
        q = torch.where(real, q.scatter(-1, at, 0.0), q)
    return torch.cat(alphas, -1) if alphas else p.new_zeros(children.shape), p


@dataclass
class DrawnDraft:
    """A drawn tree: its ``DraftTree`` (for the forward and the cache), its shape, and the heads' ``q [B, F, V']`` at
    the ``F`` nodes that have children, over the heads' ``V'`` projection indices (``vocab [V']``: their target ids,
    ``None`` for the whole vocabulary), with ``slot [1+N]`` each node's index into it (leaves: 0, never read) and
    ``index [B, 1+N]`` each node's token as a projection index; and the ``GrownTree`` view hooks read."""

    tree: DraftTree
    shape: TreeShape
    q: torch.Tensor
    slot: torch.Tensor
    index: torch.Tensor
    vocab: torch.Tensor | None
    grown: GrownTree

    def target_at(self, probs: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """The target at ``nodes [B, ...]`` (node indices per row) in the projection's coordinates plus one last
        bucket for its mass outside them (where ``q`` is zero, so the chain only ever rescales it):
        ``[B, ..., V'+1]``."""
        if self.vocab is None:
            rows = torch.arange(nodes.shape[0], device=nodes.device).view(-1, *([1] * (nodes.dim() - 1)))
            p = probs[rows, nodes]
        else:  # one gather from the rows' flat distributions: `index_select` along the last axis loops over the
            # leading ones on CPU (0.44 ms at three nodes against 0.03 for a gather) and `probs[rows, nodes]` copies
            batch, n, vocab_size = probs.shape
            at = (nodes[..., None] * vocab_size + self.vocab).reshape(batch, -1)
            p = probs.reshape(batch, n * vocab_size).gather(1, at).view(*nodes.shape, -1)
        return torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp(min=0)], -1)

    def chain_inputs(self, probs: torch.Tensor, nodes: torch.Tensor, width: int | None = None):
        """What ``rank_acceptance`` needs at ``nodes [B, ...]``: ``target_at``, ``q [B, ..., V'+1]`` and the
        indices of the nodes' first ``width`` children (all by default) ``[B, ..., width]``."""
        rows = torch.arange(nodes.shape[0], device=nodes.device).view(-1, *([1] * (nodes.dim() - 1)))
        q = self.q[rows, self.slot[nodes]]
        q = torch.cat([q, torch.zeros_like(q[..., :1])], -1)
        kids = self.shape.children[nodes, :width]  # [B, ..., w]
        kid_index = self.index[rows[..., None], kids.clamp(min=0)]
        return self.target_at(probs, nodes), q, torch.where(kids >= 0, kid_index, -1)


def draw_tree(root: torch.Tensor, shape: TreeShape, propose, draft_ids: torch.Tensor | None, fixed: int,
              embed=None, num_heads: int | None = None) -> DrawnDraft:
    """Draw every node of ``shape`` for each row, depth by depth.

    Args:
        root: ``[B]`` root tokens.
        propose: ``(depth, frontier [f] node indices, path [B, f, depth, D] or None, path_tokens [B, f, depth])
            -> (z [B, f, D], logq [B, f, V'])``: the proposal distribution of head ``depth`` at each frontier node
            (log-probabilities over the projection's ``V'`` indices, after the hooks).
        draft_ids: ``[V']`` the target id of each projection index (a draft vocabulary), ``None`` for the whole
            vocabulary (told, not found out: comparing the indices with the ids each step would be a host read).
        fixed: children per node taken as the top tokens of ``q`` instead of drawn.
        embed: the input embedding (path heads read their path through it); ``None`` for independent heads.
    """
    batch, device, size = root.shape[0], root.device, shape.size
    num_heads = num_heads or shape.ancestor_at.shape[1] - 1
    tokens = root[:, None].repeat(1, size)
    index = torch.zeros((batch, size), dtype=torch.long, device=device)
    slot = torch.zeros(size, dtype=torch.long, device=device)
    q = []
    frontier_z, frontier_ids, frontier_source = [], [], []
    for d, (frontier, width, kept, slots) in enumerate(shape.levels, start=1):
        path_tokens = tokens[:, shape.ancestor_at[frontier, :d]]  # [B, f, d]
        path = embed(path_tokens) if embed is not None else None
        z, logq = propose(d, frontier, path, path_tokens)
        logq = torch.log_softmax(logq.float(), dim=-1)  # q is exactly what the children are drawn from
        keys = logq.clone()
        top = keys.topk(fixed, dim=-1).indices if fixed else None
        if top is not None:
            keys.scatter_(-1, top, -math.inf)
        if width > fixed:
            gumbel = -torch.log(-torch.log(torch.rand_like(keys).clamp(min=1e-20)))
            drawn = (keys + gumbel).topk(width - fixed, dim=-1).indices
            picked = drawn if top is None else torch.cat([top[..., :width], drawn], -1)
        else:
            picked = top[..., :width]
        ids = picked if draft_ids is None else draft_ids[picked]  # [B, f, width]
        has = shape.children[frontier, :width] >= 0  # [f, width]
        tokens[:, kept] = ids.flatten(1)[:, slots]
        index[:, kept] = picked.flatten(1)[:, slots]
        q.append(logq.exp())
        slot[frontier] = sum(part.shape[1] for part in q[:-1]) + torch.arange(frontier.numel(), device=device)
        frontier_z.append(z)
        frontier_ids.append(torch.nn.functional.pad(torch.where(has, ids, -1), (0, shape.children.shape[1] - width),
                                                    value=-1))
        frontier_source.append((frontier - 1).expand(batch, -1))
    depth = shape.depth.expand(batch, -1)
    ancestors = (shape.ancestor_at[:, :, None] == torch.arange(size, device=device)).any(1)
    ancestors[:, 0] = True
    path_tokens = torch.where(torch.arange(num_heads + 1, device=device) <= shape.depth[:, None],
                              tokens[:, shape.ancestor_at], root[:, None, None])
    tree = DraftTree(tokens=tokens, depth=depth, parent=shape.parent.expand(batch, -1),
                     ancestors=ancestors.expand(batch, -1, -1), path_tokens=path_tokens,
                     path_scores=shape.log_reach[1:].float().expand(batch, -1),
                     source=(torch.arange(size, device=device) - 1).expand(batch, -1), max_depth=shape.max_depth)
    return DrawnDraft(tree, shape, torch.cat(q, 1), slot, index, draft_ids,
                      GrownTree(tree, frontier_z, frontier_ids, frontier_source, num_heads))


@dataclass
class RejectionOutcome:
    """``accepted [B, D+1]`` (node indices of the accepted path, root first, ``-1`` past its end), ``next_root [B]``,
    per ``(depth, rank)`` the summed acceptance chances of the children tried (``alpha_sum``) and their number
    (``tried``), and ``reach [B, 1+N]``: each node's chance of being accepted given the drawn tokens (``node_reach``).
    """

    accepted: torch.Tensor
    next_root: torch.Tensor
    alpha_sum: torch.Tensor
    tried: torch.Tensor
    reach: torch.Tensor


def node_reach(draft: DrawnDraft, alpha: torch.Tensor) -> torch.Tensor:
    """``[B, 1+N]``: the chance that the walk reaches (accepts) each node, given the drawn tokens, from ``alpha [B, F,
    w]``, ``rank_acceptance``'s chances at the nodes with children (indexed by ``draft.slot``). Its sum over the
    nodes is the expected accepted length; over a prefix of the nodes (best first), that of the tree of that size:
    one step prices every narrower tree at the variance of a conditional expectation, not of one walk."""
    shape, tree = draft.shape, draft.tree
    edge = torch.ones(tree.tokens.shape, dtype=torch.float64, device=alpha.device)
    if tree.size > 1:
        edge[:, 1:] = first_accepted(alpha.double())[:, draft.slot[shape.parent[1:]], shape.rank[1:]]
    log_path = torch.bmm(tree.ancestors.double(), edge.clamp(min=TINY).log()[..., None]).squeeze(-1)
    return log_path.exp()


def rejection_walk(draft: DrawnDraft, probs: torch.Tensor, fixed: int, uniforms: torch.Tensor) -> RejectionOutcome:
    """Walk each row's drawn tree from the root by recursive rejection sampling.

    The rejection chain runs once over every node that has children, all at once (a chain step per rank, none per
    depth or node). The walk needs no loop either: the uniform that decides child ``r`` of a node at depth ``d`` is
    ``uniforms[:, d, r]`` wherever the row stands, so every child's accept-or-reject is decided at once, a child is
    entered when it is the first of its siblings accepted, and a row reaches a node when it entered every node on its
    path (what a walk depth by depth would do, decision for decision).

    Args:
        probs: ``[B, 1+N, V]`` the target's processed distribution at every node.
        uniforms: ``[B, D+2, K]`` fresh uniforms (``D``: the shape's depth); the last row's first samples the next
            root.
    """
    shape = draft.shape
    batch, device = probs.shape[0], probs.device
    rows = torch.arange(batch, device=device)
    width = max((w for _, w, _, _ in shape.levels), default=0)
    alpha_sum = torch.zeros((shape.max_depth, shape.children.shape[1]), dtype=torch.float64, device=device)
    tried = torch.zeros_like(alpha_sum)
    stop = torch.zeros(batch, dtype=torch.long, device=device)  # where each row stops (a lone root: there)
    if width:
        alpha, residual = rank_acceptance(*draft.chain_inputs(probs, parents_of(shape, batch), width), fixed)
        exists = shape.children[:, :width] >= 0  # [1+N, w]
        chance = torch.where(exists, alpha[:, draft.slot], 0.0)  # [B, 1+N, w]; a leaf's slot is never read
        hit = uniforms[:, shape.depth, :width] < chance
        after_a_hit = hit.cumsum(-1) > hit.long()  # an earlier sibling was accepted: this one is never tried
        entered = torch.ones((batch, shape.size), dtype=torch.bool, device=device)
        entered[:, 1:] = (hit & ~after_a_hit)[:, shape.parent[1:], shape.rank[1:]]
        reached = entered[:, shape.ancestor_at].all(-1)  # [B, 1+N]: entered every node of its path (the root's too)
        stop = torch.where(reached, torch.arange(shape.size, device=device), 0).amax(1)  # they form one path
        was_tried = exists & ~after_a_hit & reached[..., None]  # [B, 1+N, w]: the children tried where rows stood
        depth = shape.depth.clamp(max=max(shape.max_depth - 1, 0))  # a leaf of the deepest depth tries nothing
        alpha_sum[:, :width].index_add_(0, depth, (chance.double() * was_tried).sum(0))
        tried[:, :width].index_add_(0, depth, was_tried.sum(0).double())
    depths = torch.arange(shape.max_depth + 1, device=device)
    accepted = torch.where(depths <= shape.depth[stop][:, None], shape.ancestor_at[stop, :shape.max_depth + 1], -1)
    # where a row stopped: past its children's rejections, the chain's residual; at a leaf, p itself
    final = draft.target_at(probs, stop)
    if width:
        inner = shape.children[stop, 0] >= 0
        final = torch.where(inner[:, None], residual[rows, draft.slot[stop]], final)
    next_root = inverse_cdf(final, uniforms[:, -1, 0])
    if draft.vocab is not None:  # the last bucket: a token outside the heads' vocabulary, drawn from p restricted there
        outside = probs[rows, stop].index_fill(-1, draft.vocab, 0.0)
        off = inverse_cdf(outside, torch.rand(batch, dtype=torch.float64, device=probs.device))
        next_root = torch.where(next_root == draft.vocab.numel(), off, draft.vocab[next_root.clamp(
            max=draft.vocab.numel() - 1)])
    reach = node_reach(draft, alpha) if width else torch.ones((batch, 1), dtype=torch.float64, device=device)
    return RejectionOutcome(accepted, next_root, alpha_sum, tried, reach)


def parents_of(shape: TreeShape, batch: int) -> torch.Tensor:
    """``[B, F]``: the nodes with children, in the order of the heads' ``q`` (``DrawnDraft.slot``)."""
    return torch.cat([frontier for frontier, _, _, _ in shape.levels]).expand(batch, -1)


def expected_accepted_drawn(draft: DrawnDraft, probs: torch.Tensor, fixed: int) -> torch.Tensor:
    """``[B]``: expected accepted draft nodes of the drawn trees under the target ``probs [B, 1+N, V]``, given the
    drawn tokens: ``sum_v P(reach v)`` with each edge's chance from the rejection chain at its parent, computed in
    float64 apart from the walk (a bias detector for it)."""
    if draft.tree.size == 1:
        return torch.zeros(probs.shape[0], dtype=torch.float64, device=probs.device)
    p, q, kids = draft.chain_inputs(probs.double(), parents_of(draft.shape, probs.shape[0]))
    alpha, _ = rank_acceptance(p, q.double(), kids, fixed)
    return node_reach(draft, alpha)[:, 1:].sum(1)
