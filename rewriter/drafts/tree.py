"""Candidate trees for draft-head verification: their layout, and how one is chosen.

A tree is a list of *paths*: ``(r0, r1, ..)`` is the node reached by taking head 0's
``r0``-th best token, then head 1's ``r1``-th best, and so on (Medusa's "choices"). The
root, index 0, is the token the model itself chose last (certain, not a guess). Nodes are
ordered by depth, then path, so every prefix of the order is itself a tree (a round near
the cache's end verifies only the first ``m`` nodes) and a parent comes before its
children.

The verification pass writes node ``i`` at cache position ``start + i`` with the token
position ``start + depth(i)``; node ``i`` sees the prefix, its ancestors and itself
(``ancestors``). Afterwards the accepted path's K/V rows are moved to ``start + depth``.

``choose_tree`` picks the tree from each head's measured rank accuracies and the measured
cost of verifying ``n`` tokens: nodes are added best-first by the probability that their
whole path is right (the product of its ranks' accuracies, heads assumed independent, as
Medusa does), and the size that maximises expected tokens per unit of verify time wins.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

MAX_NODES = 64
MAX_RANK = 10


@dataclass(frozen=True)
class Tree:
    paths: tuple[tuple[int, ...], ...]  # node i >= 1 is paths[i - 1]

    @property
    def size(self) -> int:
        """Tokens one verification reads: the root and every node."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    def prefix(self, m: int) -> "Tree":
        """The first ``m`` nodes (the root included): a tree too."""
        return Tree(self.paths[:max(0, m - 1)])

    def layout(self, device=None) -> dict:
        """Tensors of the tree: ``parent``, ``depth``, ``head``, ``rank`` ``[n]`` (root: -1,
        0, -1, -1) and ``ancestors`` ``[n, n]`` (True where node i may see node j); lists:
        each node's ``children``, and ``paths``, the nodes from the root's child down to it."""
        n = self.size
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        parent = [-1] + [index.get(p[:-1], 0) for p in self.paths]
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[parent[i]]
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return {"parent": t(parent), "depth": t([0] + [len(p) for p in self.paths]),
                "head": t([-1] + [len(p) - 1 for p in self.paths]),
                "rank": t([-1] + [p[-1] for p in self.paths]),
                "ancestors": anc.to(device), "children": _children(parent),
                "paths": _node_paths(parent)}

    def record(self) -> list:
        return [list(p) for p in self.paths]


def _node_paths(parent: list[int]) -> list[list[int]]:
    paths: list[list[int]] = [[]]  # the root: no node below it
    for i in range(1, len(parent)):
        paths.append(paths[parent[i]] + [i])  # a parent comes before its children
    return paths


def _children(parent: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parent]
    for i, p in enumerate(parent):
        if p >= 0:
            kids[p].append(i)
    return kids


def make_tree(paths: Sequence[Sequence[int]], num_heads: int) -> Tree:
    """A ``Tree`` from paths in any order; ``ValueError`` names what is wrong."""
    why = check_paths(paths, num_heads)
    if why:
        raise ValueError(f"tree: {why}")
    return Tree(tuple(sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))))


def check_paths(paths, num_heads: int) -> str | None:
    """Why ``paths`` is not a tree for ``num_heads`` heads, or None."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, (list, tuple)) or not paths:
        return "a non-empty list of paths (lists of ranks, e.g. [[0], [1], [0, 0]])"
    if len(paths) >= MAX_NODES:
        return f"at most {MAX_NODES - 1} nodes, got {len(paths)}"
    seen = set()
    for p in paths:
        if (isinstance(p, (str, bytes)) or not isinstance(p, (list, tuple)) or not p
                or not all(type(r) is int and 0 <= r < MAX_RANK for r in p)):
            return f"each path is a non-empty list of ranks in [0, {MAX_RANK}), got {p!r}"
        if len(p) > num_heads:
            return f"path {list(p)} is deeper than the {num_heads} heads"
        if tuple(p) in seen:
            return f"path {list(p)} is given twice"
        seen.add(tuple(p))
    for p in seen:
        if len(p) > 1 and p[:-1] not in seen:
            return f"path {list(p)} has no parent {list(p[:-1])} in the tree"
    return None


def chain(num_heads: int) -> Tree:
    """Each head's best guess after the last: Medusa without a tree."""
    return Tree(tuple((0,) * d for d in range(1, num_heads + 1)))


def expected_tokens(tree: Tree, accuracy: Sequence[Sequence[float]]) -> float:
    """Tokens a round is expected to produce: 1 (the model's own) + every node's chance
    that its whole path is accepted."""
    return 1.0 + sum(_path_probability(p, accuracy) for p in tree.paths)


def _path_probability(path, accuracy) -> float:
    prob = 1.0
    for head, rank in enumerate(path):
        a = accuracy[head]
        prob *= a[rank] if rank < len(a) else 0.0
    return prob


def monotone(cost: Sequence[float]) -> list[float]:
    """Verifying more tokens never costs less (nor less than one step): a timing that says so
    is noise (a busy machine), and trusting it would pick a tree by its luckiest measurement."""
    return [0.0] + list(itertools.accumulate((max(c, 1.0) for c in cost[1:]), max))


def choose_tree(accuracy: Sequence[Sequence[float]], cost: Sequence[float],
                max_nodes: int = MAX_NODES - 1, head_cost: float = 0.0,
                per_level: bool = False) -> tuple[Tree, dict]:
    """The tree that maximises ``expected_tokens / (cost[size] + heads)`` (``cost[s]``:
    verifying ``s`` tokens, in units of one; ``cost[0]`` unused; ``heads``: the draft heads'
    calls a round, ``head_cost`` each: one, or one per level with ``per_level`` (Hydra)),
    with at most ``max_nodes`` nodes and ``len(cost) - 2`` at most; and what it predicts."""
    num_heads = len(accuracy)
    cost = monotone(cost)
    limit = min(max_nodes, len(cost) - 2, MAX_NODES - 1)
    order: list[tuple[int, ...]] = []
    frontier = {(r,): _path_probability((r,), accuracy) for r in range(MAX_RANK)}
    while frontier and len(order) < limit:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        if frontier.pop(best) <= 0:
            break
        order.append(best)
        if len(best) < num_heads:
            for r in range(MAX_RANK):
                child = best + (r,)
                frontier[child] = _path_probability(child, accuracy)
    heads = lambda depth: head_cost * (depth if per_level else 1)  # noqa: E731
    best_m, best_rate, expected = 0, 1.0 / (cost[1] + heads(1)), 1.0
    total, depth = 1.0, 0
    for m, p in enumerate(order, start=1):
        total += _path_probability(p, accuracy)
        depth = max(depth, len(p))
        rate = total / (cost[m + 1] + heads(depth))
        if rate > best_rate:
            best_m, best_rate, expected = m, rate, total
    if best_m == 0:
        tree = chain(1)  # nothing pays for itself: one guess, the cheapest tree there is
        expected = expected_tokens(tree, accuracy)
    else:
        tree = make_tree(order[:best_m], num_heads)
    return tree, {"expected_tokens": round(expected, 4),
                  "predicted_speedup": round(expected / (cost[tree.size] + heads(tree.depth)), 4),
                  "nodes": tree.size - 1, "head_cost": round(head_cost, 4)}


def best_subtree(tree: Tree, accuracy: Sequence[Sequence[float]], cost: Sequence[float],
                 head_cost: float = 0.0, per_level: bool = False) -> tuple[Tree, float]:
    """(sub-tree, predicted speed-up): the nodes of ``tree`` worth verifying a round when
    verifying costs ``cost`` (as ``choose_tree``'s, measured at another batch size): its
    ``m`` likeliest nodes (a child is never likelier than its parent, so they form a tree)
    for the best ``m``; no node at all (plain decoding, rate 1) when none pays for itself."""
    cost = monotone(cost)
    likeliest = sorted(tree.paths, key=lambda p: (-_path_probability(p, accuracy), len(p), p))
    best, rate, total, depth = 0, 1.0, 1.0, 0
    for m, p in enumerate(likeliest[:len(cost) - 2], start=1):
        total += _path_probability(p, accuracy)
        depth = max(depth, len(p))
        r = total / (cost[m + 1] + head_cost * (depth if per_level else 1))
        if r > rate:
            best, rate = m, r
    chosen = set(likeliest[:best])
    return Tree(tuple(p for p in tree.paths if p in chosen)), round(rate, 4)
