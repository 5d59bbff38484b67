"""The tree a round verifies, re-chosen from the text being decoded.

The pass chooses the tree from the heads' accuracies on held-out text. On other text (a
chat answer, code of another kind) they guess worse, and a tree that paid there costs more
than it saves here: on SmolLM2 (bfloat16) the held-out text promises 1.9 tokens a round
from the 9-node tree, code prompts accept 1.4. So a generation counts, per head, how often
its ``r``-th best token was the model's own, given that the path before it was accepted
(rows past their end of sequence are not counted), and every ``EVERY`` rounds verifies the
sub-tree of the pass's tree that these counts and the pass's measured costs pay for
(``rewriter.drafts.tree.best_subtree``). That may be no node at all: plain rounds. After ``PROBE``
rounds spent on less than the whole tree, one round verifies the whole tree, so that heads
whose nodes were dropped are counted again and can win them back; a probe that changes
nothing doubles the wait for the next (up to ``MAX_PROBE`` rounds: a probe of a large tree
costs a few decode steps). The pass's accuracies are the prior, worth ``PRIOR``
observations. The counts, and the tree last chosen, carry over to the engine's next
generation at the same batch size (``Engine.trees``); the oldest weigh less as counts grow
(halved at ``HALVE`` observations of a head), so they follow a workload that changes.

A batch ends when its last row has all its tokens, so what a round is worth is what it
gains the row that lags (the fewest tokens among the rows still running); the rows ahead
of it will wait anyway. Rows differ: on the default model at batch 4 the heads' text
accepted 1.88 tokens a round per row on average, and the batch still took 25% more
rounds than that promises (the slowest row accepted 1.5). So in a batch the choice weighs
the lagging row's own counts in this generation, with the pooled counts as their prior
(``row_accuracy``).

Where the pass found that nothing pays at a batch size even by the held-out accuracies
(an empty ``batch_trees`` entry), the heads' tree is never verified there: the counts on
other text are rarely better, and the plain decode loop is the faster one (on a GPU it
replays a CUDA graph). With ``lookup`` the rounds may still verify a chain copied from the
text (``runtime.decoding.tree.lookup``); once the chain chooses no copies, the engine decodes the
next ``ChainLength.RETRY - 1`` generations of such a batch plainly, then tries again.

Greedy and sampled acceptance are exact whatever the tree: the tokens (or their
distribution) do not change, only the time. Typical acceptance (lossy) accepts by the
tree it is given, so there the choices change the text too.
"""
from __future__ import annotations

from typing import Optional

from rewriter.decoding import TreeDecoding
from rewriter.drafts.tree import MAX_RANK, Tree, best_subtree, expected_tokens, monotone

from .lookup import ChainLength


class AdaptiveTree:
    PRIOR = 16  # observations the pass's accuracies are worth
    EVERY = 4  # rounds between choices
    PROBE = 16  # rounds on less than the whole tree before it is probed
    MAX_PROBE = 256
    HALVE = 512  # a head's observations at which its counts are halved: a few generations

    def __init__(self, whole: Tree, strategy: TreeDecoding, batch: int):
        self.whole = whole  # the pass's tree: every choice is a sub-tree of it
        self.hydra = strategy.drafter == "hydra"
        self.heads_cost, verify = strategy.costs_at(batch)
        self.cost = [0.0, *verify]  # cost[s]: a round verifying s tokens, in plain steps
        self.prior = [[a[r] if r < len(a) else 0.0 for r in range(MAX_RANK)]
                      for a in strategy.accuracy]  # [K][MAX_RANK]
        self.hits = [[0] * MAX_RANK for _ in self.prior]
        self.trials = [0] * len(self.prior)
        self.rounds = 0
        self.short = 0  # rounds on less than the whole tree since the last probe
        self.wait = self.PROBE  # rounds between probes
        self.probing: Optional[Tree] = None  # during a probe: the tree verified before it
        self.current: Optional[Tree] = None  # the last choice (the engine's next start)
        # with ``lookup``: how many copied tokens pay, counted beside the heads (lookup)
        self.chain = ChainLength(strategy.lookup) if strategy.lookup else None

    def observe(self, head: int, rank: Optional[int]) -> None:
        """Head ``head`` drafted after an accepted path; the model's token was its
        ``rank``-th best (None: not among those it drafted)."""
        self.trials[head] += 1
        if rank is not None and rank < MAX_RANK:
            self.hits[head][rank] += 1
        if self.trials[head] >= self.HALVE:
            self.trials[head] /= 2
            self.hits[head] = [h / 2 for h in self.hits[head]]

    def accuracy(self) -> list[list[float]]:
        """``[K][MAX_RANK]`` the counts, with the prior's ``PRIOR`` pseudo-observations."""
        w = self.PRIOR
        return [[(h + w * p) / (n + w) for h, p in zip(hits, prior)]
                for hits, prior, n in zip(self.hits, self.prior, self.trials)]

    def row_accuracy(self, hits: list[list[int]], trials: list[int]) -> list[list[float]]:
        """``[K][MAX_RANK]`` one row's counts in this generation, with the pooled accuracies
        (``accuracy``) as their prior, worth ``PRIOR`` observations."""
        w = self.PRIOR
        return [[(h + w * p) / (n + w) for h, p in zip(row, pooled)]
                for row, pooled, n in zip(hits, self.accuracy(), trials)]

    def choose(self, accuracy=None) -> Tree:
        """The sub-tree that ``accuracy()`` (a function: the lagging row's, in a batch;
        computed only here, not every round) or the pooled counts pay for."""
        acc = accuracy() if accuracy is not None else self.accuracy()
        return best_subtree(self.whole, acc, self.cost, self.heads_cost, self.hydra)[0]

    def chain_length(self, tree: Tree) -> tuple:
        """The copied tokens a round verifies beside ``tree``, by its highest match order
        (``ChainLength.choose``)."""
        verify = monotone(self.cost)
        n = min(tree.size, len(verify) - 1)
        short = n + self.chain.lookup - (len(verify) - 1)
        if short > 0:  # costs recorded only as far as the tree (before chains were measured):
            # the rest at the measured curve's mean slope
            slope = (verify[-1] - verify[1]) / max(len(verify) - 2, 1)
            verify = verify + [verify[-1] + slope * (i + 1) for i in range(short)]
        heads = self.heads_cost * (tree.depth if self.hydra else 1) if n > 1 else 0.0
        # a plain round is a plain step (no mask, no acceptance: ``rounds``); a
        # round with copies costs what verifying as many tokens does, the round's own work in
        chained = [verify[n] + heads if n > 1 else 1.0] + \
            [verify[s] + heads for s in range(n + 1, n + self.chain.lookup + 1)]
        return self.chain.choose(expected_tokens(tree, self.accuracy()), chained)

    def next(self, current: Tree, accuracy=None) -> Tree:
        """The tree the next round verifies, after a round that verified ``current``
        (``accuracy``: as ``choose``'s)."""
        self.rounds += 1
        if current != self.whole:  # dropped nodes are never counted: probe them now and then
            self.short += 1
            if self.short >= self.wait:
                self.short, self.probing = 0, current
                return self.whole
        if self.probing is not None:
            tree, before, self.probing = self.choose(accuracy), self.probing, None
            self.wait = min(2 * self.wait, self.MAX_PROBE) if tree == before else self.PROBE
            return tree
        if current.size > 1 and self.rounds % self.EVERY == 0:  # plain rounds learn nothing
            return self.choose(accuracy)
        return current
