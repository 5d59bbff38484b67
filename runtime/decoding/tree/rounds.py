"""Draft heads verified as a token tree (Medusa, Hydra), lossless; and chains copied from
the text (``lookup``, ``runtime.decoding.tree.lookup``), beside the tree or alone (``PromptLookup``).

A round, for every row at once (each row at its own cache length ``length[b]``):

1. **candidates** fill the tree (``rewriter.drafts.tree``), computed after the previous round
   from the hidden state of the row's last accepted position. The root is the token the
   model chose last (not yet in the cache). Medusa: node ``(r0, .., rd)`` holds head
   ``d``'s ``rd``-th best token (one call of all heads). Hydra: head ``d`` runs, level by
   level, on the path of every depth-``d`` node that has children (the root's token and
   the tokens below it), and the ``rd``-th best token it gives for the path of the node's
   parent fills the node.
2. **verify**: the ``verify`` program over all ``n`` nodes at cache positions
   ``length + i``, token positions ``length + depth(i)``, under the tree mask: the full
   model's next-token logits after every node's path, and its hidden states.
3. **accept** the longest path whose every token is the model's own choice after its
   parent (greedy: its argmax, so the output is plain greedy decoding's); sampling walks
   the tree from the root accepting child ``c`` with probability ``p'(c)`` and, if it is
   rejected, removing ``c`` from ``p'`` and renormalising (recursive rejection sampling
   with one-token proposals: the output follows the model's distribution exactly);
   ``acceptance="typical"`` (lossy) accepts a child whose probability exceeds
   ``min(threshold, alpha * exp(-entropy))``. The token after the path is the model's.
4. **compact**: the accepted path's K/V rows move from ``length + i`` to
   ``length + depth``; the rest is left behind the row's new length (masked until
   overwritten). The heads then run on the hidden state of the path's last node.

The loop around it (columns, EOS, rows that are done, the cache bound) is
``runtime.decoding.speculative``'s. The jobs a round composes live beside it: the drafters
(``drafters``: Medusa, Hydra, EAGLE), the chains copied from the text (``lookup``), the
tree's shape as the generation goes (``shape``: fixed, adaptive, dynamic, the chain's
length) and the verification (``verify``: layouts, acceptance, compaction).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator, Optional

import torch
from torch import Tensor

from rewriter.decoding import TreeDecoding
from rewriter.drafts.tree import MAX_NODES, Tree

from ...generate import Batch, run_prompt
from ...kv_cache import KVCache
from ...sampling import next_token
from ...settings import GenerationSettings
from ..base import holds_eos
from ..speculative import Rounds
from . import verify
from .adapt import AdaptiveTree
from .drafters import drafter_for, level_plan
from .lookup import CopiedChains
from .shape import (Counts, check_windows, drafted_ranks, grow_tree, guesses, start_tree,
                    whole_tree)
from .verify import host_layout, kept, walk


def tree_loop(programs: dict, cache: KVCache, batch: Batch, settings: GenerationSettings,
              generator: Optional[torch.Generator], stats: Counter, strategy: TreeDecoding,
              vocab: Optional[Tensor], trees: Optional[dict] = None, static: bool = False,
              cuda_graph: bool = False, replays=None) -> Iterator[Tensor]:
    """Yield the next token of every row, ``[B]``, like ``generate.decode_loop``. ``trees``:
    the adaptive trees learnt so far, by (batch size, strategy), kept across calls;
    ``static``, ``cuda_graph`` and ``replays``: the verification and the heads on fixed
    buffers (``speculative.Rounds.step``), replayed from CUDA graphs kept across calls."""
    yield from TreeRounds(programs, cache, batch, settings, generator, stats, strategy, vocab,
                          trees if trees is not None else {}, static, cuda_graph, replays).run()


class TreeRounds(Rounds):
    """The rounds of one generation: the drafter (``drafters``) fills the tree the shape
    gives (``shape``), copied chains hang beside it (``lookup.CopiedChains``), and the
    verification accepts and compacts (``verify``)."""

    def _draft_size(self, strategy) -> tuple[float, int]:
        return self.full, 0  # no layer skipped; the tree's size is set with the tree (``use``)

    def __init__(self, programs, cache, batch, settings, generator, stats, strategy, vocab,
                 trees: dict, static: bool = False, cuda_graph: bool = False, replays=None):
        super().__init__(programs, cache, batch, settings, generator, stats, strategy, static,
                         cuda_graph, replays)
        b = batch.ids.shape[0]
        self.whole = whole_tree(strategy)
        self.drafter = drafter_for(strategy, programs, self._call, vocab, stats, b, self.device)
        self.hydra = strategy.level_by_level  # EAGLE drafts level by level as Hydra does
        self.dynamic = strategy.dynamic  # > 0: the shape is re-grown every round (dynamic)
        self.done: Optional[list] = None  # the last round's rows that are done
        self.ranks = drafted_ranks(self.whole)
        self.nodes: Optional[Tensor] = None  # [B, n] the tree's tokens (column 0: the root)
        self.drafted = None  # the heads' ranked guesses behind ``nodes`` (``observe``)
        self.adapt = self.counts = None
        if strategy.costs_at(b) is not None:  # learnt over this and earlier generations
            self.adapt = trees.setdefault((b, strategy), AdaptiveTree(self.whole, strategy, b))
            self.counts = Counts(self.adapt, self.ranks, self.hydra, b, strategy.depth)
        self.ended = [False] * b  # rows whose accepted text holds an end of sequence
        # where the pass found no tree that pays at this batch size, rounds verify only a
        # copied chain (when one pays), and the heads' tree is never probed
        self.chains_only = not strategy.tree_at(b)
        self.chain = self.adapt.chain if self.adapt is not None else None  # lookup.ChainLength
        self.chains = CopiedChains(strategy.lookup, self.chain, b) if strategy.lookup else None
        self.tree_depth: Optional[list] = None  # per row: the heads' tree's accepted depth
        # greedy acceptance's one read back a round (``verify.Greedy.read``), and the heads'
        # guesses behind this round's tree on the host [B][all, flat], read back with the
        # round's result for the adaptive tree's counts (``observe``), else None
        self.read: Optional[tuple] = None
        self.guessed: Optional[list] = None
        self.rounds = 0
        self.use(start_tree(strategy, b, self.adapt))
        check_windows(cache, strategy, self.whole)

    def use(self, tree) -> None:
        """Draft ``tree`` (a sub-tree of the whole, maybe the root alone) from now on; a
        re-shaped tree (``dynamic``) of as many nodes. A round verifies ``verified``: the
        drafted tree, with the chain copied from the row's text (``lookup``)."""
        self.budget = self.tree = self.verified = tree
        self.max_draft = tree.size - 1
        self.to_head = None  # a verified node's index in the drafted tree (None: the same)
        self.levels = kept(("levels", tree.paths), self.device,
                           lambda: level_plan(host_layout(tree), tree.depth, self.device)) \
            if self.hydra and tree.size > 1 and not self.dynamic else None

    def layout(self, m: int, tree=None) -> dict:
        """The layout of the first ``m`` nodes of ``tree`` (default: the one verified)."""
        key = (tree or self.verified).paths[:m - 1]
        return kept(("layout", key), self.device, lambda: Tree(key).layout(self.device))

    def first(self) -> Tensor:
        batch = self.batch
        steps = [] if self.drafter.every_position else None
        (logits, h), calls = run_prompt(self.programs["tree_prefill"], self.cache, batch.ids,
                                        batch.positions, batch.pad, self.s.prefill_chunk,
                                        every=steps)
        self.stats.update(forward_passes=calls, layer_evals=calls * self.full)
        token = next_token(logits[:, -1], self.s, self.generator)
        if steps is not None or self.chains is not None:  # each row's prompt, on the host
            ids, tokens = batch.ids.tolist(), token.tolist()
            pad = batch.pad.tolist() if batch.pad is not None else [0] * len(tokens)
            if steps is not None:
                every = torch.cat([step[1] for step in steps], 1)  # [B, S, H]
                h = every[:, -1:]
                self.drafter.prompt(every, ids, pad, tokens, self.s.prefill_chunk)
            if self.chains is not None:
                self.chains.start(ids, pad, tokens)
        self.draft_from(h[:, -1:], token)
        return token

    def _call(self, name: str, *args: Tensor):
        """A heads program (no cache): through a ``Replay`` per shape in static rounds."""
        if not self.static:
            with torch.inference_mode():
                return self.programs[name](*args)
        program = self.programs[name]

        def run(*inputs: Tensor):
            with torch.inference_mode():
                return program(*inputs)
        return self.replay((program, *(tuple(a.shape) for a in args)), run, name, *args)

    def draft_from(self, h: Tensor, root: Tensor) -> None:
        """The tree's tokens after hidden states ``h`` ``[B, 1, H]`` and the model's next
        token ``root`` ``[B]``."""
        if self.budget.size == 1:  # plain rounds: nothing to draft
            self.nodes, self.drafted = root[:, None], None
        elif self.dynamic:
            self.tree, self.nodes, self.drafted = grow_tree(
                self.drafter, h, root, self.budget, self.dynamic, self.ranks, self.done)
        else:
            plan = self.levels if self.hydra else self.layout(self.tree.size, self.tree)
            self.nodes, self.drafted = self.drafter.fixed(h, root, self.tree, plan, self.ranks)
        self._chain()

    def _chain(self) -> None:
        """The tree a round verifies: the drafted one, and with ``lookup`` a chain copied
        from each running row's text below the root (``lookup``)."""
        self.verified, self.to_head = self.tree, None
        if self.chains is not None:
            self.chains.proposed = None
            if self.tree.size > 1 or self.chains_only or self.chain is not None:
                self.verified, self.nodes, self.to_head = self.chains.propose(
                    self.tree, self.nodes, self.done, self.ended, MAX_NODES - self.tree.size)
        self.max_draft = self.verified.size - 1

    def _counted_guesses(self) -> list[Tensor]:
        """The heads' guesses where the adaptive tree counts them this round (``observe``)."""
        if self.adapt is None or self.drafted is None:
            return []
        return guesses(self.drafted, self.hydra)

    def round(self, last: Tensor, length: list[int], k: int, done: list[bool]):
        m, b = k + 1, last.shape[0]
        lay = self.layout(m)
        tokens = torch.empty(b, m, dtype=torch.int64, device=self.device)
        tokens[:, 0] = last
        if m > 1:
            tokens[:, 1:] = self.nodes[:, 1:m]  # [B, m - 1]
        tree = m > 1  # the root alone attends as a plain decode step does: no mask to build
        positions = (self.on_device(length) - self.pad0)[:, None] + lay["depth"][None]  # [B, m]
        logits, h = self.step("verify", length, 0, tokens, positions,  # [B, m, V], [B, m, H]
                              tree=lay["ancestors"] if tree else None,
                              depth=lay["depth"] if tree else None)
        self.stats.update(forward_passes=1, layer_evals=self.full,
                          drafted=(m - 1) * sum(not d for d in done))
        if self.to_head is not None:  # chain nodes copied from the text, verified this round
            self.stats.update(copied=sum(i < 0 for i in self.to_head[1:m]))
        paths, bonus = self._accepted(logits, tokens, lay, length)
        # the verified tokens on the host: greedy acceptance read them back with its result
        host = self.read[0] if self.read is not None else tokens.tolist() if m > 1 else None
        rows = [[host[r][i] for i in p] + [bonus[r]] for r, p in enumerate(paths)]
        if self.chains is not None:
            self.chains.extend(rows, done)
        if self.adapt is not None:
            self._adapt(host, paths, bonus, done, rows, length)
        else:  # a row whose text ended this round copies no chain from the next on
            self._mark_ended(rows)
        if self.read is not None:  # each row's deepest accepted node and the token after it
            ends, after = self.read[1], self.read[2]
        else:
            ends = torch.tensor([p[-1] if p else 0 for p in paths], device=self.device)
            after = torch.tensor(bonus, device=self.device)
        nxt = torch.where(self.on_device(done), last, after)
        self.drafter.accepted(h, paths, rows, done)
        self.done = done
        self.draft_from(h[torch.arange(b, device=self.device), ends][:, None], nxt)  # [B, 1, H]
        return nxt, rows

    def _accepted(self, logits: Tensor, tokens: Tensor, lay: dict, length: list[int]):
        """Per row: the accepted path and the token after it, the K/V compacted."""
        self.tree_depth, self.read, self.guessed = None, None, None
        if tokens.shape[1] > 1:
            paths, bonus = self.accept(logits, tokens, lay)
            self.compact(length, paths)
            return paths, bonus
        # a plain round (the adaptive tree chose none, or a generation's last token): the
        # model's token, chosen as plain decoding chooses it, with no acceptance or K/V
        # moves to pay for; read back with the guesses the counts need
        counted = self._counted_guesses()
        read = torch.cat([next_token(logits[:, 0], self.s, self.generator)[:, None],
                          *counted], 1).tolist()  # [B, 1 (+ guesses)]
        self.guessed = [row[1:] for row in read] if counted else None
        return [[] for _ in read], [row[0] for row in read]

    def _adapt(self, tokens: Optional[list], paths: list[list[int]], bonus: list[int],
               done: list[bool], rows: list[list[int]], length: list[int]) -> None:
        """Count this round, then verify the tree (and the chain) the counts choose from the
        next round on."""
        self.rounds += 1
        if self.drafted is not None:  # text past a row's end of sequence is not counted
            self.observe(tokens, paths, bonus, [d or e for d, e in zip(done, self.ended)])
        if self.chain is not None:
            self.chains.score(paths, [not d and not e for d, e in zip(done, self.ended)],
                              length, self.tree_depth, self.to_head)
        self._mark_ended(rows)
        if not self.chains_only:
            running = [r for r in range(len(rows)) if not done[r] and not self.ended[r]]
            tree = self.counts.choose(self.budget, rows, running, length)
            if tree != self.budget:
                self.use(tree)
                self.stats.update(tree_changes=1)
        # every few rounds; while no copy is verified, every round (a short generation
        # would otherwise never bring the chain back)
        if self.chain is not None and (self.rounds % AdaptiveTree.EVERY == 0
                                       or not any(self.chains.copy)):
            self.chains.copy = self.chain.current = self.adapt.chain_length(self.budget)

    def _mark_ended(self, rows: list[list[int]]) -> None:
        """Rows whose accepted text (``rows``, this round's) holds an end of sequence."""
        self.ended = [e or holds_eos(self.s, row) for e, row in zip(self.ended, rows)]

    def observe(self, rows: Optional[list], paths: list[list[int]], bonus: list[int],
                done: list[bool]) -> None:
        """Count the round for the adaptive tree (``shape.Counts.observe``); the guesses
        read back with the round's acceptance where it was greedy."""
        guessed = self.guessed if self.guessed is not None \
            else torch.cat(guesses(self.drafted, self.hydra), 1).tolist()
        self.counts.observe(self.drafted, guessed, self.to_head, rows, paths, bonus, done)

    def accept(self, logits: Tensor, tokens: Tensor, lay: dict) -> tuple[list, list[int]]:
        """Per row: the accepted path (node indices, root excluded) and the token after it."""
        if self.s.do_sample or self.strategy.acceptance != "exact":
            # sampling (exact or typical) and greedy typical: node by node from the root
            return walk(logits, tokens, lay["children"], self.s, self.strategy, self.generator)
        heads = [i >= 0 for i in self.to_head] \
            if self.to_head is not None and self.chain is not None else None
        verdict = verify.greedy(logits, tokens, lay, heads, self._counted_guesses())
        self.tree_depth, self.read, self.guessed = verdict.tree_depth, verdict.read, verdict.extra
        return verdict.paths, verdict.bonus

    def compact(self, length: list[int], paths: list[list[int]]) -> None:
        """Move each row's accepted nodes from ``length + i`` to ``length + depth``."""
        verify.compact(self.cache, length, paths, self.stats, self.device)
