"""The tree a round drafts and verifies, as a generation goes.

- **fixed**: the pass's tree (``rewriter.drafts.tree``), or the sub-tree it chose for the
  batch size (``batch_trees``); none: rounds of a copied chain alone;
- **adaptive**: with the pass's measured costs, the sub-tree re-chosen every few rounds
  from what the heads got right on this text (``adapt.AdaptiveTree``; this generation's
  counts: ``Counts``), and the copied chain's length with it (``lookup.ChainLength``);
- **dynamic**: re-grown every round from the heads' own confidence (``dynamic.grow``;
  ``grow_tree``), as many nodes as the fixed or adaptive tree has.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.decoding import TreeDecoding
from rewriter.drafts.tree import MAX_RANK, Tree, make_tree
from rewriter.errors import RewriterError

from ...kv_cache import KVCache
from .adapt import AdaptiveTree
from .drafters import Drafter
from .dynamic import grow


def whole_tree(record: TreeDecoding) -> Tree:
    """The heads' tree (none under prompt lookup: rounds of copied chains alone)."""
    return make_tree(record.tree, record.depth) if record.tree else Tree(())


def start_tree(record: TreeDecoding, batch: int, adapt: Optional[AdaptiveTree]) -> Tree:
    """The tree a generation starts with: the adaptive tree's last choice, else the one
    the pass chose for the batch size. Verifying many tokens costs more in a larger batch:
    from some batch on the strategy may verify a sub-tree (where it is empty: chains
    alone, or plain steps)."""
    if adapt is not None and adapt.current:
        return adapt.current
    paths = record.tree_at(batch)
    return make_tree(paths, record.depth) if paths else Tree(())


def drafted_ranks(whole: Tree) -> list[int]:
    """Ranks drafted at each depth: the whole tree's, so the counts cover every sub-tree."""
    return [1 + max(p[-1] for p in whole.paths if len(p) == d + 1) for d in range(whole.depth)]


def check_windows(cache: KVCache, record: TreeDecoding, whole: Tree) -> None:
    """A round writes as deep as its tree (or its copied chain): no attention window may
    be that short."""
    deepest = max(record.depth if record.dynamic else whole.depth, record.lookup)
    for s in cache.table.values():
        if s.window is not None and s.window <= deepest:
            raise RewriterError(f"a tree of depth {deepest} needs attention "
                                f"windows longer than that; cache {s.id} has {s.window}")


def grow_tree(drafter: Drafter, h: Tensor, root: Tensor, budget: Tree, expand: int,
              ranks: list[int], done: Optional[list[bool]]):
    """``(tree, tokens [B, n], drafted)``: a tree of the budget's size grown from the
    drafter's probabilities (``dynamic``) after ``h`` and ``root``."""
    candidates = min(MAX_RANK, budget.size - 1)  # the candidates a node gets
    # the ranks counted (observe): the whole tree's, as the fixed trees count, so a small
    # budget does not count a guess the whole tree would have verified as a miss
    call = drafter.levels(h, max([candidates, *ranks]))
    running = torch.tensor([not d for d in done], dtype=torch.float32, device=root.device) \
        if done is not None else None  # rows that are done have no say in the shape
    tree, nodes, levels = grow(call, root, budget.size, drafter.depth, expand, running,
                               candidates)
    return tree, nodes, drafter.grown(tree, levels)


def guesses(drafted, level_by_level: bool) -> list[Tensor]:
    """The heads' ranked guesses behind a round's tree, each ``[B, n]``: Medusa's
    ``[B, K, ranks]``, or each Hydra level's ``[B, parents, ranks]``, flattened."""
    if level_by_level:
        return [ids.flatten(1) for _, ids in drafted]
    return [drafted.flatten(1)]


class Counts:
    """This generation's counts for the adaptive tree: for every head that drafted after a
    row's accepted path, the rank of the model's token among its guesses there, pooled
    (``adapt``, carried across generations) and per row (``row_accuracy``: in a batch
    the lagging row's choose)."""

    def __init__(self, adapt: AdaptiveTree, ranks: list[int], level_by_level: bool,
                 batch: int, depth: int):
        self.adapt, self.ranks, self.level_by_level = adapt, ranks, level_by_level
        self.row_hits = [[[0] * MAX_RANK for _ in range(depth)] for _ in range(batch)]
        self.row_trials = [[0] * depth for _ in range(batch)]

    def observe(self, drafted, guessed: list, to_head: Optional[list], rows: Optional[list],
                paths: list[list[int]], bonus: list[int], done: list[bool]) -> None:
        """Count a round (``runtime.decoding.tree.adapt``). ``drafted``: the guesses behind
        its tree, ``guessed`` the same on the host ``[B][every guess, flat]``; ``to_head``:
        each verified node's index in the drafted tree (None: the same); ``rows``: the
        tokens verified, on the host ``[B][m]`` (None when only the root was)."""
        by_level = self.level_by_level  # head d ran on the path only where the node has children
        levels = self._levels(drafted, guessed) if by_level else None
        if not by_level:
            _, k, n = drafted.shape  # [B][K][ranks]
            heads = [[row[j * n:(j + 1) * n] for j in range(k)] for row in guessed]
        for r, path in enumerate(paths):
            if done[r]:
                continue
            nodes = [0, *path]
            for d, node in enumerate(nodes):
                if d >= len(self.ranks):
                    break
                target = rows[r][nodes[d + 1]] if d + 1 < len(nodes) else bonus[r]
                if by_level:
                    node = to_head[node] if to_head is not None else node
                    # a copied chain's node (-1) had no head run on its path; nor had a
                    # re-grown tree's expanded paths that were not kept (-1 there too)
                    if node < 0 or d >= len(levels) or node not in levels[d][0]:
                        break
                    ranked = levels[d][1][r][levels[d][0].index(node)]
                else:
                    ranked = heads[r][d]
                self._count(r, d, ranked.index(target) if target in ranked else None)

    @staticmethod
    def _levels(drafted, guessed: list) -> list:
        """Per level: (the parents' node indices, ``[B][parents][ranks]``)."""
        levels, at = [], 0
        for parents, ids in drafted:
            _, p, n = ids.shape
            levels.append((parents, [[row[at + j * n:at + (j + 1) * n] for j in range(p)]
                                     for row in guessed]))
            at += p * n
        return levels

    def _count(self, row: int, head: int, rank: Optional[int]) -> None:
        self.adapt.observe(head, rank)
        self.row_trials[row][head] += 1
        if rank is not None and rank < MAX_RANK:
            self.row_hits[row][head][rank] += 1

    def choose(self, budget: Tree, rows: list[list[int]], running: list[int],
               length: list[int]) -> Tree:
        """The tree the next round verifies after one that verified ``budget``. In a batch,
        the row with the fewest tokens decides when it ends: its counts choose."""
        accuracy = None
        if len(rows) > 1 and running:
            lag = min(running, key=lambda r: length[r] + len(rows[r]))
            accuracy = lambda: self.adapt.row_accuracy(self.row_hits[lag],  # noqa: E731
                                                       self.row_trials[lag])
        tree = self.adapt.next(budget, accuracy)
        self.adapt.current = tree
        return tree
