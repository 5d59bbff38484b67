"""A tree re-shaped every round from the heads' own confidence (EAGLE-2's dynamic tree).

A fixed tree spends its nodes where the heads are right *on average*; in any one round
the heads know better: after ``def`` their first guess is near-certain, after a comma
four guesses share the mass. So each round the tree is grown from the heads'
probabilities and the round verifies its ``n`` likeliest nodes, the same number a fixed
tree would (the pass's, or the adaptive tree's choice: ``runtime.decoding.tree.adapt``).

A node is a path of ranks, as in ``rewriter.drafts.tree``; its *score* is the probability the
heads give its whole path, the product of each step's probability (Hydra's head ``d``
scores the children of a path it was run on; Medusa's heads score every path at depth
``d`` alike), summed over the batch's rows: one shape serves every row (one mask per
verification), each row with its own tokens at each rank. Growing goes level by level:

1. the root's children are head 0's ``ranks`` best tokens;
2. at each level the ``expand`` best new nodes whose score is still among the best
   ``n - 2`` of all nodes so far (a child scores at most its parent, so a node outside
   them can have no child in the final tree) are expanded: Hydra runs head ``d + 1`` on
   their paths, one call for all of them;
3. the round verifies the ``n - 1`` best nodes (ancestors first on ties: a tree), laid
   out by depth as every tree is.

The output is unchanged: acceptance (greedy, sampled or typical) reads only the tree it
is given, and the shape depends on the heads alone, never on the model's verification.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from rewriter.drafts.tree import Tree

# (level d, the expanded paths' tokens [B, P, d + 1]) -> (log-probabilities [B, P, R]
# sorted best first, their token ids [B, P, R])
HeadCall = Callable[[int, Tensor], tuple[Tensor, Tensor]]


def grow(call: HeadCall, root: Tensor, nodes: int, depth: int, expand: int,
         weight: Optional[Tensor] = None, ranks: Optional[int] = None):
    """The tree of ``nodes`` tokens (the root included) grown from ``call``'s guesses after
    ``root`` ``[B]``: ``(tree, tokens [B, nodes] in the tree's order, levels)``, ``levels``
    holding, per level that ran, the expanded paths and their ranked token ids
    ``[B, P, R]`` (for counting what the heads got right: ``shape.Counts.observe``).
    ``weight`` ``[B]``: each row's say in the shape (0: a row that is done); ``ranks``: a
    node's candidates, its first ``ranks`` guesses (default: all ``call`` gives; ``levels``
    keeps all of them)."""
    b = root.shape[0]
    if weight is None:
        weight = torch.ones(b, device=root.device)
    scores: dict[tuple, float] = {}  # path -> summed probability
    where: dict[tuple, tuple] = {}  # path -> (level, slot of its parent, rank)
    levels = []
    frontier: list[tuple] = [()]
    chains = root[:, None, None]  # [B, P, d + 1]: each expanded path's tokens, root first
    logs = torch.zeros(b, 1, device=root.device)  # [B, P] each expanded path's log-probability
    for d in range(depth):
        logp, ids = call(d, chains)  # [B, P, R]
        levels.append((list(frontier), ids))
        logp, ids = logp[..., :ranks], ids[..., :ranks]  # [B, P, r] the candidates
        total = logs[..., None] + logp.float()  # [B, P, r]
        summed = (total.exp() * weight[:, None, None]).sum(0)  # [P, R]
        for slot, (p, row) in enumerate(zip(frontier, summed.tolist())):
            for r, s in enumerate(row):
                scores[p + (r,)] = s
                where[p + (r,)] = (d, slot, r)
        if d + 1 == depth or nodes <= 2:
            break
        best = set(_ranked(scores)[:nodes - 2])
        level = sorted((p for p in scores if len(p) == d + 1 and p in best), key=_key(scores))
        chosen = [where[p][1:] for p in level[:expand]]
        if not chosen:
            break
        slot = torch.tensor([s for s, _ in chosen], device=root.device)
        rank = torch.tensor([r for _, r in chosen], device=root.device)
        chains = torch.cat([chains[:, slot], ids[:, slot, rank][..., None]], -1)  # [B, P', d + 2]
        logs = total[:, slot, rank]  # [B, P']
        frontier = [frontier[s] + (r,) for s, r in chosen]
    kept: set = set()
    for p in _ranked(scores):  # best first, a parent before its children
        if len(kept) == nodes - 1:
            break
        if len(p) == 1 or p[:-1] in kept:
            kept.add(p)
    tree = Tree(tuple(sorted(kept, key=lambda p: (len(p), p))))
    tokens = torch.empty(b, tree.size, dtype=torch.int64, device=root.device)
    tokens[:, 0] = root
    for i, p in enumerate(tree.paths, start=1):
        d, slot, r = where[p]
        tokens[:, i] = levels[d][1][:, slot, r]
    return tree, tokens, levels


def _key(scores: dict):
    return lambda p: (-scores[p], len(p), p)


def _ranked(scores: dict) -> list[tuple]:
    return sorted(scores, key=_key(scores))
