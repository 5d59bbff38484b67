"""Drafts copied from the row's own text, beside the heads' tree (prompt lookup).

A model's continuation often repeats its context: code re-uses names, signatures and
whole lines; answers quote the question. So each round, beside the heads' guesses, a
chain of up to ``L`` tokens is copied from the row's text (prompt and everything accepted
so far): the tokens that followed the latest earlier occurrence of the text's last
``n`` tokens (``n`` = ``NGRAM`` down to 1, the longest that occurred). The chain hangs
below the root as a branch of its own (one shape for the whole batch: a row with a shorter
chain, or none, fills it with its last token, which verification accepts only if it is
the model's own choice). Verification reads the chain as any other node, so the output
is unchanged; the chain costs its ``L`` tokens in the verification.

In the tree's paths a chain node is rank ``LOOKUP`` at every depth, past any head's rank:
laid out by depth like every node, and never read as a head's guess.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from rewriter.tree import MAX_RANK, Tree

NGRAM = 3  # the longest suffix matched
LOOKUP = MAX_RANK  # a chain node's rank in the tree's paths


class Context:
    """One row's text, with the latest position each of its n-grams ended at (among
    those whose next token is known)."""

    def __init__(self, tokens: Sequence[int]):
        self.tokens: list[int] = []
        self.last: dict[tuple, int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        for i in range(max(0, start - 1), len(self.tokens) - 1):  # next token now known
            for n in range(1, NGRAM + 1):
                if i - n + 1 >= 0:
                    self.last[tuple(self.tokens[i - n + 1:i + 1])] = i

    def propose(self, length: int) -> list[int]:
        """Up to ``length`` tokens that followed the latest earlier occurrence of the
        text's longest matching suffix (none: ``[]``)."""
        for n in range(min(NGRAM, len(self.tokens)), 0, -1):
            i = self.last.get(tuple(self.tokens[-n:]))
            if i is not None:
                return self.tokens[i + 1:i + 1 + length]
        return []


def with_chain(tree: Tree, nodes: Tensor, chains: list[list[int]], fill: Tensor) -> tuple[Tree, Tensor]:
    """``tree`` and its tokens ``nodes`` ``[B, n]`` with a chain below the root as long as
    the longest of ``chains`` (one list a row; shorter ones padded with ``fill`` ``[B]``):
    ``(tree, tokens [B, n + chain])`` in the tree's order."""
    length = max((len(c) for c in chains), default=0)
    if length == 0:
        return tree, nodes
    chain = tuple((LOOKUP,) * d for d in range(1, length + 1))
    paths = tuple(sorted(tree.paths + chain, key=lambda p: (len(p), p)))
    padded = torch.tensor([c + [int(fill[r])] * (length - len(c)) for r, c in enumerate(chains)],
                          dtype=torch.int64, device=nodes.device)  # [B, L]
    n = nodes.shape[1]
    where = {p: i for i, p in enumerate(tree.paths, start=1)}
    order = [0] + [where[p] if p[-1] != LOOKUP else n + len(p) - 1 for p in paths]
    index = torch.tensor(order, device=nodes.device)
    return Tree(paths), torch.cat([nodes, padded], 1)[:, index]  # [B, n + L]
