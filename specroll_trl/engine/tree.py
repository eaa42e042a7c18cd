"""Sparse, concurrency-aware draft trees.

Candidates at depth ``d`` come from head ``d``'s top-k. A node's score is the product of the head probabilities
along its path; scores only shrink along a path (strictly, thanks to a tiny depth penalty), so the best ``N_t``
candidates of a row form a tree closed under parent (``tree_from_nodes``). Independent heads: every candidate
path up to depth ``H`` is enumerated once into a static table (``select_tree``). Path-conditioned heads: the
candidates are grown depth by depth, each depth's head run once over the best nodes of the depth above
(``grow_tree``). Node 0 of every tree is the root (the token sampled at the end of the previous step).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass
class PathTable:
    """All candidate paths of a ``depth x topk`` tree, parents before children.

    ``choice[p, j]`` is the top-k rank chosen at depth ``j+1`` (``-1`` past the path's depth);
    ``ancestors[p, q]`` is true when path ``q`` is a prefix of path ``p`` (itself included).
    """

    depth: torch.Tensor  # [P] in 1..H
    parent: torch.Tensor  # [P] path index, -1 for depth-1 paths (their parent is the root)
    choice: torch.Tensor  # [P, H]
    ancestors: torch.Tensor  # [P, P] bool

    @classmethod
    def build(cls, depth: int, topk: int, max_paths: int = 4096) -> PathTable:
        paths: list[tuple[int, ...]] = []
        for d in range(1, depth + 1):
            paths.extend(itertools.product(range(topk), repeat=d))
            if len(paths) > max_paths:
                raise ValueError(
                    f"a tree of depth {depth} with top-{topk} per head has over {max_paths} candidate paths; "
                    "lower spec top-k or the number of heads"
                )
        index = {p: i for i, p in enumerate(paths)}
        choice = torch.full((len(paths), depth), -1, dtype=torch.long)
        parent = torch.full((len(paths),), -1, dtype=torch.long)
        ancestors = torch.zeros((len(paths), len(paths)), dtype=torch.bool)
        for i, p in enumerate(paths):
            choice[i, : len(p)] = torch.tensor(p)
            if len(p) > 1:
                parent[i] = index[p[:-1]]
            for d in range(1, len(p) + 1):
                ancestors[i, index[p[:d]]] = True
        depths = torch.tensor([len(p) for p in paths], dtype=torch.long)
        return cls(depths, parent, choice, ancestors)

    def to(self, device) -> PathTable:
        return PathTable(*(t.to(device) for t in (self.depth, self.parent, self.choice, self.ancestors)))


@dataclass
class DraftTree:
    """Per-row trees of ``1 + N`` nodes (node 0 = root), parents listed before children.

    ``tokens [B, 1+N]``, ``depth [B, 1+N]``, ``parent [B, 1+N]`` (node index, -1 for the root),
    ``ancestors [B, 1+N, 1+N]`` (node ``i`` may attend to node ``j``), and ``path_tokens [B, 1+N, H+1]``
    (tokens from the root down to the node, right-padded with the root token).
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestors: torch.Tensor
    path_tokens: torch.Tensor
    path_scores: torch.Tensor | None = None  # [B, P] log-score of every candidate path (None: nothing drafted)
    source: torch.Tensor | None = None  # [B, 1+N] candidate index each node was picked from (-1: the root)
    max_depth: int | None = None  # a bound on ``depth``, known without reading it (None: read it)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def select_tree(root: torch.Tensor, topk_ids: torch.Tensor | None, topk_logp: torch.Tensor | None,
                table: PathTable | None, num_nodes: int, num_heads: int | None = None) -> DraftTree:
    """Best-first sparse tree per row.

    Args:
        root: ``[B]`` root tokens.
        topk_ids / topk_logp: ``[B, H, K]`` each head's top-k tokens and their log-probabilities (unused, and
            may be ``None``, when ``num_nodes`` is 0).
        table: the static path table for ``(H, K)`` (may be ``None`` when ``num_nodes`` is 0).
        num_nodes: draft nodes per row besides the root.
        num_heads: ``H`` (default: the table's depth).
    """
    batch, device = root.shape[0], root.device
    num_heads = table.choice.shape[1] if num_heads is None else num_heads
    if num_nodes == 0:
        empty = torch.zeros((batch, 1), dtype=torch.long, device=device)
        return DraftTree(tokens=root[:, None], depth=empty, parent=empty - 1,
                         ancestors=torch.ones((batch, 1, 1), dtype=torch.bool, device=device),
                         path_tokens=root[:, None, None].expand(batch, 1, num_heads + 1).clone(), max_depth=0)
    tokens, score = path_candidates(topk_ids, topk_logp, table)
    return tree_from_nodes(root, tokens, table.parent.expand(batch, -1), table.depth.expand(batch, -1), score,
                           num_nodes, num_heads)


def path_candidates(topk_ids: torch.Tensor, topk_logp: torch.Tensor, table: PathTable):
    """Every path of the table, per row: its last token ``[B, P]`` and its score ``[B, P]``, the sum of its head
    log-probabilities less a tiny depth penalty (so a child always scores strictly below its parent)."""
    num_heads = table.choice.shape[1]
    on_path, rank = table.choice >= 0, table.choice.clamp(min=0)  # [P, H]
    head = torch.arange(num_heads, device=topk_ids.device)[None, :]
    score = (topk_logp[:, head, rank] * on_path).sum(-1) - 1e-6 * table.depth
    last = topk_ids[:, head, rank].gather(2, (table.depth - 1)[None, :, None].expand(topk_ids.shape[0], -1, 1))
    return last.squeeze(2), score


@dataclass
class GrownTree:
    """A tree grown depth by depth (path heads) and, per depth ``d`` (0-based head ``d``), what that head proposed
    from at every frontier node of depth ``d``: ``frontier_z[d] [B, f, D]`` (after the hooks' ``adjust``),
    ``frontier_ids[d] [B, f, K]`` (its top-k) and ``frontier_source[d] [B, f]`` (the candidate index of each frontier
    node; ``-1``: the root)."""

    tree: DraftTree
    frontier_z: list[torch.Tensor]
    frontier_ids: list[torch.Tensor]
    frontier_source: list[torch.Tensor]
    num_heads: int

    def along(self, accepted: torch.Tensor):
        """The proposals made along each row's accepted path (``accepted [B, >= H]`` node indices, root first, ``-1``
        past its end): per head ``d``, the ``z`` and candidates of the head run at the path's node of depth ``d``, and
        whether it ran there (``proposed``; a path node outside the frontier of its depth had no head run on it, and
        the heads below the tree's depth limit ran nowhere)."""
        batch, grown = accepted.shape[0], len(self.frontier_z)
        rows = torch.arange(batch, device=accepted.device)
        z, candidates, proposed = [], [], []
        for d in range(grown):
            node = accepted[:, d] if d < accepted.shape[1] else torch.full_like(accepted[:, 0], -1)
            source = self.tree.source.gather(1, node.clamp(min=0)[:, None])  # [B, 1]
            match = self.frontier_source[d] == source  # [B, f]
            slot = match.int().argmax(1)
            z.append(self.frontier_z[d][rows, slot])
            candidates.append(self.frontier_ids[d][rows, slot])
            proposed.append((node >= 0) & match.any(1))
        for _ in range(grown, self.num_heads):
            z.append(torch.zeros_like(z[0]))
            candidates.append(torch.zeros_like(candidates[0]))
            proposed.append(torch.zeros_like(proposed[0]))
        return torch.stack(z, 1), torch.stack(candidates, 1), torch.stack(proposed, 1)


def grow_tree(root: torch.Tensor, hidden: torch.Tensor, head_step, embed, num_heads: int, topk: int,
              num_nodes: int) -> GrownTree:
    """Best-first tree of path-conditioned heads, one head call per depth, batched over rows and the frontier.

    Depth ``d``'s head reads ``hidden`` and the embeddings of the path down to each frontier node; the ``topk``
    children of every frontier node are candidates, and the best ``min(topk, num_nodes)`` of them (by path score,
    the product of head probabilities) form the next frontier. The tree keeps the best ``num_nodes`` candidates
    (closed under parent: a child scores below its parent), so it is at most ``num_nodes`` deep and the heads below
    that depth are not run.

    Args:
        root: ``[B]`` root tokens; hidden: ``[B, D]`` the hidden state that produced them.
        head_step: ``(depth, hidden [B, f, D], path [B, f, depth, D], path_tokens [B, f, depth]) -> (z [B, f, D],
            logp [B, f, V], ids)``, where ``ids(index)`` maps indices of ``logp``'s last axis to target token ids.
        embed: the target's input embedding (token ids -> ``[..., D]``).
    """
    batch, width = root.shape[0], min(topk, num_nodes)
    path = embed(root)[:, None, None]  # [B, f=1, 1, D]
    path_tokens = root[:, None, None]  # [B, f=1, 1]
    front_score = torch.zeros((batch, 1), device=root.device)
    front_index = torch.full((batch, 1), -1, dtype=torch.long, device=root.device)  # candidate index, -1: root
    tokens, parents, depths, scores, frontier_z, frontier_ids, frontier_source = [], [], [], [], [], [], []
    offset, depth = 0, min(num_heads, num_nodes)
    for d in range(1, depth + 1):
        f = path.shape[1]
        z, logp, to_ids = head_step(d, hidden[:, None].expand(-1, f, -1), path, path_tokens)
        top_logp, top_index = logp.topk(topk, dim=-1)  # [B, f, K]
        ids = to_ids(top_index)
        frontier_z.append(z)
        frontier_ids.append(ids)
        frontier_source.append(front_index)
        score = (front_score[..., None] + top_logp - 1e-6).reshape(batch, f * topk)  # strict decrease along a path
        tokens.append(ids.reshape(batch, f * topk))
        parents.append(front_index[..., None].expand(-1, -1, topk).reshape(batch, f * topk))
        depths.append(torch.full((batch, f * topk), d, dtype=torch.long, device=root.device))
        scores.append(score)
        if d == depth:
            break
        keep = score.topk(min(width, f * topk), dim=-1).indices  # [B, f'], best first
        grown = tokens[-1].gather(1, keep)
        parent_slot = keep // topk
        path = torch.cat([path.gather(1, parent_slot[..., None, None].expand(-1, -1, *path.shape[2:])),
                          embed(grown)[:, :, None]], 2)
        path_tokens = torch.cat([path_tokens.gather(1, parent_slot[..., None].expand(-1, -1, d)), grown[..., None]], 2)
        front_score, front_index = score.gather(1, keep), offset + keep
        offset += f * topk
    tree = tree_from_nodes(root, torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(depths, 1),
                           torch.cat(scores, 1), num_nodes, num_heads)
    return GrownTree(tree, frontier_z, frontier_ids, frontier_source, num_heads)


def tree_from_nodes(root: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                    score: torch.Tensor, num_nodes: int, num_heads: int) -> DraftTree:
    """The best ``num_nodes`` of ``M`` candidate nodes per row as a ``DraftTree``.

    ``tokens / parent / depth / score``: ``[B, M]``, parents listed before children (``parent``: candidate index,
    ``-1`` for a child of the root), scores strictly lower than the parent's, so the kept set is closed under
    parent.
    """
    batch, device = root.shape[0], root.device
    num_nodes = min(num_nodes, tokens.shape[1])
    picked = score.topk(num_nodes, dim=-1).indices.sort(dim=-1).values  # candidate order keeps parents first
    node_of = torch.zeros_like(tokens)
    node_of.scatter_(1, picked, torch.arange(1, num_nodes + 1, device=device).expand(batch, -1))
    up = parent.gather(1, picked)
    zero = torch.zeros((batch, 1), dtype=torch.long, device=device)
    parent_node = torch.cat([zero - 1, torch.where(up >= 0, node_of.gather(1, up.clamp(min=0)), 0)], 1)
    node_tokens = torch.cat([root[:, None], tokens.gather(1, picked)], 1)
    node_depth = torch.cat([zero, depth.gather(1, picked)], 1)
    # walk every node up to the root: its ancestors, and its path's tokens by depth (right-padded with the root)
    step_up = parent_node.clamp(min=0)
    node = torch.arange(num_nodes + 1, device=device).expand(batch, -1)
    ancestors = torch.zeros((batch, num_nodes + 1, num_nodes + 1), dtype=torch.bool, device=device)
    path_tokens = root[:, None, None].expand(batch, num_nodes + 1, num_heads + 1).clone()
    for _ in range(num_heads + 1):
        ancestors.scatter_(2, node[..., None], True)
        path_tokens.scatter_(2, node_depth.gather(1, node)[..., None], node_tokens.gather(1, node)[..., None])
        node = step_up.gather(1, node)
    return DraftTree(tokens=node_tokens, depth=node_depth, parent=parent_node, ancestors=ancestors,
                     path_tokens=path_tokens, path_scores=score, source=torch.cat([zero - 1, picked], 1),
                     max_depth=min(num_heads, num_nodes))
