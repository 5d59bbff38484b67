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

On text that does not repeat, a chain accepts nothing and costs its tokens in every
verification. With the pass's measured costs (the adaptive tree's), a generation scores
every row's full chain each round, verified or not, against the text that follows, and
verifies the chain's first ``l`` tokens for the ``l`` (maybe 0) those scores pay for
(``ChainLength``); rounds of no heads' tree at all may still verify a chain. The length
is chosen per match order ``n`` (how many of the text's last tokens occurred before): a
chain found by a 3-token match is right far more often than one found by a single token
(SmolLM2's greedy code: 2.6 copies against 0.8 on average; chat answers: 1.2 against 0.3),
so on chat text a round may verify only the chains of long matches.
"""
from __future__ import annotations

from itertools import combinations_with_replacement
from typing import Optional, Sequence

import torch
from torch import Tensor

from rewriter.drafts.tree import MAX_RANK, Tree

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

    def match(self, length: int) -> tuple[int, list[int]]:
        """``(n, chain)``: the ``length`` tokens that followed the latest earlier occurrence
        of the text's longest matching suffix, and that suffix's length ``n`` (its order;
        ``(0, [])`` where nothing matched). Where fewer follow it, the text since that
        occurrence is a loop: the chain goes round it again."""
        for n in range(min(NGRAM, len(self.tokens)), 0, -1):
            i = self.last.get(tuple(self.tokens[-n:]))
            if i is not None:
                loop = self.tokens[i + 1:]  # [..]: at least one token
                return n, (loop * -(-length // len(loop)))[:length]
        return 0, []


class ChainLength:
    """How many copied tokens a round verifies, by the chain's match order, from what full
    chains would have gained.

    A row's chain of ``L`` tokens, proposed at a round, is scored once the row's text has
    reached past it: its first ``m`` tokens are the text's own, and the round accepted
    ``a`` tokens of the heads' tree (its deepest accepted path had the chain not been
    verified), so verifying the chain's first ``l`` tokens gained ``max(0, min(m, l) - a)``
    tokens. Greedy text is the model's whatever was verified, so ``m`` is what verification
    accepts; sampled text matches a copied token as often as verification accepts it
    (one-token proposals; an estimate where the chain is tried after the tree's nodes).

    A length ``l[h]`` is chosen per match order (``Context.match``): a round verifies as
    many copies as its rows' longest match's order ``h`` was given, and every row fills
    them from its own chain. So a row's gain is counted under its round's ``h`` (at one
    row: its own chain's order), and the lengths maximise tokens a round over its cost::

        (tokens(tree) + sum_h gain_h(l[h])) / sum_h share_h * cost(tree + l[h])

    ``gain_h(l)``: the tokens the first ``l`` copies gained in rounds of highest order
    ``h``, over all scored row-rounds; ``share_h``: the share of rounds whose highest order
    was ``h`` (``h = 0``: no row had a chain, ``l[0] = 0``). In a batch only the row that
    lags is scored each round (the running rows with the fewest tokens; a row past its end
    of sequence is done, ``speculative.Rounds.run``): the batch takes as many rounds as
    its slowest row, so copies that speed up only the rows ahead buy nothing until one of
    them falls behind. A longer match is never given
    fewer copies than a shorter one: it is the surer guess, and the rule keeps sparse
    counts from choosing gaps (and the search small).
    Until ``MIN`` row-rounds are scored every chain is verified whole. The counts halve
    every ``HALVE`` rounds, so they follow a workload that changes. Where rounds verify a
    chain alone (no heads' tree pays) and it chose none, a generation would only pay for
    the rounds' own work: the engine decodes the next ``RETRY - 1`` generations plainly and
    tries again at the ``RETRY``-th, with fresh counts (``rests``)."""
    MIN = 8
    HALVE = 512
    RETRY = 8

    def __init__(self, lookup: int):
        self.lookup = lookup
        self.whole = (0,) + (lookup,) * NGRAM  # copies by order: every chain whole
        self._clear()
        self.current: Optional[tuple] = None  # the last choice: the next generation's start
        self.rested = 0  # generations decoded plainly since the chain chose none

    def _clear(self) -> None:
        # gains[h][j]: row-rounds where the j-th copy gained a token, in rounds of highest order h
        self.gains = [[0.0] * (self.lookup + 1) for _ in range(NGRAM + 1)]
        self.scored = 0.0  # row-rounds scored
        self.rounds = 0.0  # rounds, and by the highest order of their chains (0: none)
        self.highest = [0.0] * (NGRAM + 1)

    def count_round(self, order: int) -> None:
        """A round whose rows' longest match had ``order`` tokens (0: no row had a chain)."""
        self.rounds += 1
        self.highest[order] += 1
        if self.rounds >= self.HALVE:  # every count at once: one window
            self.rounds, self.scored = self.rounds / 2, self.scored / 2
            self.highest = [h / 2 for h in self.highest]
            self.gains = [[g / 2 for g in row] for row in self.gains]

    def score(self, proposal: Sequence[int], text: Sequence[int], accepted: int,
              order: int) -> None:
        """A row's chain ``proposal`` against the ``text`` that followed it, in a round of
        highest match order ``order`` that accepted ``accepted`` tokens of the heads' tree."""
        m = 0
        while m < min(len(proposal), len(text), self.lookup) and proposal[m] == text[m]:
            m += 1
        for j in range(accepted + 1, m + 1):
            self.gains[order][j] += 1
        self.scored += 1

    def rests(self) -> bool:
        """Whether a generation of chains alone should decode plainly instead: the chain
        chose no copies, and its next try is not due (every ``RETRY``-th generation)."""
        if self.current is None or any(self.current):
            return False
        self.rested += 1
        if self.rested >= self.RETRY:  # a try: on what the text is now, not what it was
            self.rested = 0
            self._clear()
            return False
        return True

    def choose(self, tokens: float, chained: Sequence[float]) -> tuple:
        """The copies a round verifies by its highest match order, ``(0, l[1], .., l[NGRAM])``,
        beside a tree expected to give ``tokens`` a round, where ``chained[l]`` is the cost
        of a round of the tree and ``l`` copies (plain steps; as far as costs were
        measured)."""
        if self.scored < self.MIN or self.rounds == 0:
            return self.whole
        top = min(self.lookup, len(chained) - 1)
        share = [h / self.rounds for h in self.highest]
        gained = []  # gained[h][l]: tokens a row-round, l copies in rounds of highest order h
        for row in self.gains:
            sums = [0.0]
            for g in row[1:top + 1]:
                sums.append(sums[-1] + g / self.scored)
            gained.append(sums)
        best, rate = (0,) * (NGRAM + 1), tokens / chained[0]
        for lengths in combinations_with_replacement(range(top + 1), NGRAM):  # non-decreasing
            gain = sum(gained[n][l] for n, l in enumerate(lengths, start=1))
            cost = share[0] * chained[0] + sum(share[n] * chained[l]
                                               for n, l in enumerate(lengths, start=1))
            if cost > 0 and (tokens + gain) / cost > rate:
                best, rate = (0, *lengths), (tokens + gain) / cost
        return best


def with_chain(tree: Tree, nodes: Tensor, chains: list[list[int]], fill: Tensor) -> tuple[Tree, Tensor]:
    """``tree`` and its tokens ``nodes`` ``[B, n]`` with a chain below the root as long as
    the longest of ``chains`` (one list a row; shorter ones padded with ``fill`` ``[B]``):
    ``(tree, tokens [B, n + chain])`` in the tree's order."""
    length = max((len(c) for c in chains), default=0)
    if length == 0:
        return tree, nodes
    chain = tuple((LOOKUP,) * d for d in range(1, length + 1))
    paths = tuple(sorted(tree.paths + chain, key=lambda p: (len(p), p)))
    # shorter chains padded with -1, then with ``fill`` on the device: no read back
    padded = torch.tensor([c + [-1] * (length - len(c)) for c in chains], dtype=torch.int64,
                          device=nodes.device)  # [B, L]
    padded = torch.where(padded < 0, fill[:, None], padded)
    n = nodes.shape[1]
    where = {p: i for i, p in enumerate(tree.paths, start=1)}
    order = [0] + [where[p] if p[-1] != LOOKUP else n + len(p) - 1 for p in paths]
    index = torch.tensor(order, device=nodes.device)
    return Tree(paths), torch.cat([nodes, padded], 1)[:, index]  # [B, n + L]


class CopiedChains:
    """One generation's copied chains: each row's text (``Context``), the chains proposed
    for the round under way, and those waiting to be scored once their text is known
    (``ChainLength``, where the chain's length adapts: ``length``). ``copy``: the copied
    tokens a round verifies, by its rows' highest match order."""

    def __init__(self, lookup: int, length: Optional[ChainLength], batch: int):
        self.lookup, self.length = lookup, length
        # the chain's last choice at this batch size, else every chain whole
        self.copy = (0,) + (lookup,) * NGRAM if length is None or length.current is None \
            else length.current
        self.contexts: list[Context] = []
        # per row: (where its chain starts, the chain, its match order)
        self.proposed: Optional[list] = None
        self.order = 0  # the round's highest match order (``propose``)
        self.pending: list = [[] for _ in range(batch)]  # per row: chains not yet scored

    def start(self, ids: list, pad: list, token: list) -> None:
        """Each row's text: its prompt (without padding) and the first new token."""
        self.contexts = [Context(row[p:] + [t]) for row, p, t in zip(ids, pad, token)]

    def extend(self, rows: list[list[int]], done: list[bool]) -> None:
        """Each running row's tokens accepted this round."""
        for context, row, d in zip(self.contexts, rows, done):
            if not d:
                context.extend(row)

    def propose(self, tree: Tree, nodes: Tensor, done: Optional[list[bool]],
                ended: list[bool], room: int) -> tuple[Tree, Tensor, Optional[list]]:
        """``tree`` and its tokens ``nodes`` with a chain copied from each running row's
        text below the root (a row whose text has ended copies none), at most ``room``
        tokens: ``(the tree verified, its tokens, each verified node's index in tree or
        -1: a copy)``; the last None where the chain added nothing."""
        done = done or [False] * len(self.contexts)
        # every row's whole chain, to be scored (``ChainLength``) whatever is verified
        self.proposed = [None if d or e else (len(c.tokens), *c.match(self.lookup)[::-1])
                         for c, d, e in zip(self.contexts, done, ended)]
        # as many copies as the longest match was given, for every row (already paid)
        self.order = max((p[2] for p in self.proposed if p is not None and p[1]), default=0)
        room = min(self.copy[self.order], room)
        chains = [p[1][:room] if p is not None else [] for p in self.proposed]
        verified, nodes = with_chain(tree, nodes, chains, nodes[:, 0])
        if verified is tree:
            return tree, nodes, None
        where = {p: i for i, p in enumerate(((),) + tree.paths)}
        return verified, nodes, [where.get(p, -1) for p in ((),) + verified.paths]

    def score(self, paths: list[list[int]], running: list[bool], length: list[int],
              depth: Optional[list], to_head: Optional[list]) -> None:
        """Queue the lagging rows' chains proposed for this round (``length``: each row's
        cache length before it) with the heads' tree's accepted depth (``depth``; None: a
        sampled walk, which tries the chain after the tree), and score those whose text is
        now known (``ChainLength``)."""
        if self.proposed is not None:
            if depth is None:  # a sampled walk tries the chain after the tree: via it, none
                depth = [len(p) if to_head is None or not p or to_head[p[0]] >= 0
                         else 0 for p in paths]
            # the round's highest order set its copies for every row: each row's gain is
            # that order's (ChainLength)
            highest = self.order
            self.length.count_round(highest)
            # a batch takes as many rounds as its slowest row: what counts is what the
            # chain adds to the row that lags (the fewest tokens; every row at one length)
            lag = min((n for n, p, r in zip(length, self.proposed, running) if p is not None and r),
                      default=None)
            for r, p in enumerate(self.proposed):
                if p is not None and running[r] and length[r] == lag:
                    self.pending[r].append((p[0], p[1], highest, depth[r]))
        for context, queue in zip(self.contexts, self.pending):
            while queue and queue[0][0] + len(queue[0][1]) <= len(context.tokens):
                start, proposal, highest, accepted = queue.pop(0)
                self.length.score(proposal, context.tokens[start:start + len(proposal)], accepted,
                                  highest)
