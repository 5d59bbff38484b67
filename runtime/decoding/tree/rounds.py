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
``runtime.decoding.speculative``'s. With the pass's measured costs in the record, the sub-tree a
round verifies is re-chosen every few rounds from the accuracies the heads show on this
text (``runtime.decoding.tree.adapt``).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator, Optional

import torch
from torch import Tensor

from rewriter.decoding import TreeDecoding
from rewriter.errors import RewriterError
from rewriter.drafts.tree import MAX_NODES, MAX_RANK, Tree, make_tree

from ...generate import Batch, run_prompt
from ...kv_cache import KVCache
from ...sampling import greedy, next_token
from ...settings import GenerationSettings
from ..speculative import Rounds
from .acceptance import walk
from .eagle_rows import EagleRows
from .adapt import AdaptiveTree
from .dynamic import grow
from .layout import host_layout, kept, level_plan
from .lookup import NGRAM, Context, with_chain

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
    def _draft_size(self, strategy) -> tuple[float, int]:
        return self.full, 0  # no layer skipped; the tree's size is set with the tree (``use``)

    def __init__(self, programs, cache, batch, settings, generator, stats, strategy, vocab,
                 trees: dict, static: bool = False, cuda_graph: bool = False, replays=None):
        super().__init__(programs, cache, batch, settings, generator, stats, strategy, static,
                         cuda_graph, replays)
        b = batch.ids.shape[0]
        # the heads' tree (none under prompt lookup: rounds of copied chains alone)
        self.whole = make_tree(strategy.tree, strategy.depth) if strategy.tree else Tree(())
        # EAGLE drafts level by level as Hydra does, with a layer of its own (eagle_rows)
        self.hydra = strategy.level_by_level
        self.eagle = EagleRows(programs["eagle"], b, self.device) \
            if strategy.drafter == "eagle" else None
        self.dynamic = strategy.dynamic  # > 0: the shape is re-grown every round (dynamic)
        self.lookup = strategy.lookup  # > 0: a chain copied from each row's text (lookup)
        self.contexts: list = []
        self.done: Optional[list] = None  # the last round's rows that are done
        # ranks drafted at each depth: the whole tree's, so the counts cover every sub-tree
        self.ranks = [1 + max(p[-1] for p in self.whole.paths if len(p) == d + 1)
                      for d in range(self.whole.depth)]
        self.vocab = vocab  # draft index -> token id (a trimmed draft vocabulary), or None
        self.nodes: Optional[Tensor] = None  # [B, n] the tree's tokens (column 0: the root)
        self.drafted = None  # the heads' ranked tokens behind ``nodes`` (``observe``)
        self.adapt = None
        if strategy.costs_at(b) is not None:  # learnt over this and earlier generations
            self.adapt = trees.setdefault((b, strategy), AdaptiveTree(self.whole, strategy, b))
        self.ended = [False] * b  # rows whose accepted text holds an end of sequence
        # where the pass found no tree that pays at this batch size, rounds verify only a
        # copied chain (when one pays), and the heads' tree is never probed
        self.chains_only = not strategy.tree_at(b)
        self.chain = self.adapt.chain if self.adapt is not None else None  # lookup.ChainLength
        # copied tokens a round verifies, by its rows' highest match order (ChainLength):
        # the chain's last choice at this batch size
        self.copy = (0,) + (strategy.lookup,) * NGRAM if self.chain is None \
            or self.chain.current is None else self.chain.current
        # per row: (where its chain starts, the chain, its match order)
        self.proposed: Optional[list] = None
        self.pending: list = [[] for _ in range(b)]  # per row: chains not yet scored
        self.tree_depth: Optional[list] = None  # per row: the heads' tree's accepted depth
        # greedy acceptance's one read back a round: (the tokens verified on the host
        # [B][m], the accepted node [B] and the token after it [B] on the device)
        self.read: Optional[tuple] = None
        # the heads' guesses behind this round's tree on the host [B][all, flat], read back
        # with the round's result for the adaptive tree's counts (``observe``), else None
        self.guessed: Optional[list] = None
        self.rounds = 0
        k = strategy.depth  # each row's counts in this generation (adapt.row_accuracy)
        self.row_hits = [[[0] * MAX_RANK for _ in range(k)] for _ in range(b)]
        self.row_trials = [[0] * k for _ in range(b)]
        # verifying many tokens costs more in a larger batch: from some batch on the
        # strategy may verify a sub-tree (where it is empty: chains alone, or plain steps)
        paths = strategy.tree_at(b)  # none: rounds of a copied chain alone (chains_only)
        start = make_tree(paths, strategy.depth) if paths else Tree(())
        self.use(self.adapt.current if self.adapt is not None and self.adapt.current else start)
        deepest = max(strategy.depth if self.dynamic else self.whole.depth, strategy.lookup)
        for s in cache.table.values():
            if s.window is not None and s.window <= deepest:
                raise RewriterError(f"a tree of depth {deepest} needs attention "
                                    f"windows longer than that; cache {s.id} has {s.window}")

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
        steps = [] if self.eagle is not None else None
        (logits, h), calls = run_prompt(self.programs["tree_prefill"], self.cache, batch.ids,
                                        batch.positions, batch.pad, self.s.prefill_chunk,
                                        every=steps)
        self.stats.update(forward_passes=calls, layer_evals=calls * self.full)
        token = next_token(logits[:, -1], self.s, self.generator)
        if self.eagle is not None:  # the draft's cache over each row's prompt
            every = torch.cat([step[1] for step in steps], 1)  # [B, S, H]
            h = every[:, -1:]
            pad = batch.pad.tolist() if batch.pad is not None else [0] * len(token)
            for r, (row, p, t) in enumerate(zip(batch.ids.tolist(), pad, token.tolist())):
                self.eagle.catch_up(r, every[r, p:], row[p + 1:] + [t], self.s.prefill_chunk)
        if self.lookup:  # each row's text: its prompt (without padding) and the new token
            pad = batch.pad.tolist() if batch.pad is not None else [0] * len(token)
            self.contexts = [Context(row[p:] + [t]) for row, p, t
                             in zip(batch.ids.tolist(), pad, token.tolist())]
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
            self._grow(h, root)
        elif self.hydra:
            self._hydra(h, root)
        else:
            d = self._call("heads", h)[:, 0]  # [B, K, V or Vd]
            self.stats.update(head_passes=1)
            ids = self._ids(d.topk(max(self.ranks), dim=-1).indices)  # [B, K, ranks]
            self.drafted = ids
            lay = self.layout(self.tree.size, self.tree)
            self.nodes = torch.cat([root[:, None], ids[:, lay["head"][1:], lay["rank"][1:]]], 1)
        self._chain()

    def _chain(self) -> None:
        """The tree a round verifies: the drafted one, and with ``lookup`` a chain copied
        from each running row's text below the root (``lookup``); a row whose text has
        ended copies none."""
        self.verified, self.to_head, self.proposed = self.tree, None, None
        if self.lookup and (self.tree.size > 1 or self.chains_only or self.chain is not None):
            done = self.done or [False] * len(self.contexts)
            # every row's whole chain, to be scored (``ChainLength``) whatever is verified
            self.proposed = [None if d or e else (len(c.tokens), *c.match(self.lookup)[::-1])
                             for c, d, e in zip(self.contexts, done, self.ended)]
            # as many copies as the longest match was given, for every row (already paid)
            self.order = self._highest()  # the round's, scored under it (_score)
            room = min(self.copy[self.order], MAX_NODES - self.tree.size)  # <= MAX_NODES
            chains = [p[1][:room] if p is not None else [] for p in self.proposed]
            self.verified, self.nodes = with_chain(self.tree, self.nodes, chains, self.nodes[:, 0])
            if self.verified is not self.tree:
                where = {p: i for i, p in enumerate(((),) + self.tree.paths)}
                self.to_head = [where.get(p, -1) for p in ((),) + self.verified.paths]
        self.max_draft = self.verified.size - 1

    def _highest(self) -> int:
        """The longest match order among this round's proposed chains (0: none)."""
        return max((p[2] for p in self.proposed if p is not None and p[1]), default=0)

    def _hydra(self, h: Tensor, root: Tensor) -> None:
        b, n = root.shape[0], self.tree.size
        nodes = torch.zeros(b, n, dtype=torch.int64, device=self.device)
        nodes[:, 0] = root
        k = self.strategy.depth
        self.drafted = []  # per level: (the parents' node indices, their ranked tokens)
        for d, (parents, chains, children, slot, rank, top, on_host) in enumerate(self.levels):
            path = torch.zeros(b, len(parents), k, dtype=torch.int64, device=self.device)
            path[:, :, :d + 1] = nodes[:, chains]  # [B, P, d + 1]: root .. parent
            logits = self._call(f"head{d}", h.expand(b, len(parents), h.shape[-1]), path)  # [B, P, V]
            self.stats.update(head_passes=1)
            ids = self._ids(logits.topk(max(top, self.ranks[d]), dim=-1).indices)  # [B, P, ranks]
            nodes[:, children] = ids[:, slot, rank]
            self.drafted.append((on_host, ids))
        self.nodes = nodes

    def _grow(self, h: Tensor, root: Tensor) -> None:
        """A tree of the budget's size grown from the heads' probabilities (``dynamic``)."""
        b, k = root.shape[0], self.strategy.depth
        ranks = min(MAX_RANK, self.budget.size - 1)  # the candidates a node gets
        # the ranks counted (observe): the whole tree's, as the fixed trees count, so a small
        # budget does not count a guess the whole tree would have verified as a miss
        counted = max([ranks, *self.ranks])
        if not self.hydra:
            top = self._call("heads", h)[:, 0].float().log_softmax(-1).topk(counted, dim=-1)  # [B, K, R]
            self.stats.update(head_passes=1)
            ids = self._ids(top.indices)

        def call(d: int, chains: Tensor):
            p = chains.shape[1]
            if self.eagle is not None:
                self.stats.update(head_passes=1)
                logp, rows = self.eagle.call(d, chains, counted)  # (not ``ids``: Medusa's, below)
                return logp, self._ids(rows)
            if not self.hydra:  # every path at depth d gets head d's guesses
                return top.values[:, d, None].expand(b, p, counted), ids[:, d, None].expand(b, p, counted)
            path = torch.zeros(b, p, k, dtype=torch.int64, device=self.device)
            path[:, :, :d + 1] = chains  # [B, P, d + 1]: root .. the expanded node
            logits = self._call(f"head{d}", h.expand(b, p, h.shape[-1]), path)  # [B, P, V]
            self.stats.update(head_passes=1)
            best = logits.float().log_softmax(-1).topk(counted, dim=-1)
            return best.values, self._ids(best.indices)

        running = torch.tensor([not d for d in self.done], dtype=torch.float32, device=self.device) \
            if self.done is not None else None  # rows that are done have no say in the shape
        tree, self.nodes, levels = grow(call, root, self.budget.size, k, self.dynamic, running,
                                        ranks)
        self.tree = tree
        if not self.hydra:
            self.drafted = ids
            return
        index = {p: i for i, p in enumerate(((),) + tree.paths)}  # a path's node, -1: not verified
        self.drafted = [([index.get(p, -1) for p in paths], got) for paths, got in levels]

    def _counted_guesses(self) -> list[Tensor]:
        """``_guesses()`` where the adaptive tree counts them this round (``observe``)."""
        return self._guesses() if self.adapt is not None and self.drafted is not None else []

    def _guesses(self) -> list[Tensor]:
        """The heads' ranked guesses behind this round's tree, each ``[B, n]``: Medusa's
        ``[B, K, ranks]``, or each Hydra level's ``[B, parents, ranks]``, flattened."""
        if self.hydra:
            return [ids.flatten(1) for _, ids in self.drafted]
        return [self.drafted.flatten(1)]

    def _ids(self, indices: Tensor) -> Tensor:
        """Token ids of draft-vocabulary indices."""
        return indices if self.vocab is None else self.vocab[indices]

    def round(self, last: Tensor, length: list[int], k: int, done: list[bool]):
        m = k + 1
        lay = self.layout(m)
        b = last.shape[0]
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
        self.tree_depth, self.read, self.guessed = None, None, None
        if m > 1:
            paths, bonus = self.accept(logits, tokens, lay)
            self.compact(length, paths)
        else:  # a plain round (the adaptive tree chose none, or a generation's last token):
            # the model's token, chosen as plain decoding chooses it, with no acceptance or
            # K/V moves to pay for; read back with the guesses the counts need
            paths = [[] for _ in range(b)]
            guesses = self._counted_guesses()
            read = torch.cat([next_token(logits[:, 0], self.s, self.generator)[:, None],
                              *guesses], 1).tolist()  # [B, 1 (+ guesses)]
            bonus = [row[0] for row in read]
            self.guessed = [row[1:] for row in read] if guesses else None
        # the verified tokens on the host: greedy acceptance read them back with its result
        host = self.read[0] if self.read is not None else tokens.tolist() if m > 1 else None
        rows = [[host[r][i] for i in p] + [bonus[r]] for r, p in enumerate(paths)]
        if self.lookup:
            for context, row, d in zip(self.contexts, rows, done):
                if not d:
                    context.extend(row)
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
        if self.eagle is not None:  # the draft's cache over what each row accepted
            self.eagle.idle = {r for r, d in enumerate(done) if d}
            for r, (p, row) in enumerate(zip(paths, rows)):
                if not done[r]:
                    at = torch.tensor([0, *p], device=self.device)
                    self.eagle.catch_up(r, h[r, at], row)  # the root and the accepted nodes
        self.done = done
        self.draft_from(h[torch.arange(b, device=self.device), ends][:, None], nxt)  # [B, 1, H]
        return nxt, rows

    def _adapt(self, tokens: Optional[list], paths: list[list[int]], bonus: list[int],
               done: list[bool], rows: list[list[int]], length: list[int]) -> None:
        """Count this round, then verify the tree (and the chain) the counts choose from the
        next round on."""
        self.rounds += 1
        if self.drafted is not None:  # text past a row's end of sequence is not counted
            self.observe(tokens, paths, bonus, [d or e for d, e in zip(done, self.ended)])
        if self.chain is not None:
            self._score(paths, done, length)
        self._mark_ended(rows)
        if not self.chains_only:
            self._choose_tree(rows, done, length)
        # every few rounds; while no copy is verified, every round (a short generation
        # would otherwise never bring the chain back)
        if self.chain is not None and (self.rounds % AdaptiveTree.EVERY == 0 or not any(self.copy)):
            self.copy = self.chain.current = self.adapt.chain_length(self.budget)

    def _mark_ended(self, rows: list[list[int]]) -> None:
        """Rows whose accepted text (``rows``, this round's) holds an end of sequence."""
        eos = set(self.s.eos_token_id)
        self.ended = [e or any(t in eos for t in row) for e, row in zip(self.ended, rows)]

    def _choose_tree(self, rows: list[list[int]], done: list[bool], length: list[int]) -> None:
        # in a batch, the row with the fewest tokens decides when it ends: its counts choose
        running = [r for r in range(len(rows)) if not done[r] and not self.ended[r]]
        accuracy = None
        if len(rows) > 1 and running:
            lag = min(running, key=lambda r: length[r] + len(rows[r]))
            accuracy = lambda: self.adapt.row_accuracy(self.row_hits[lag],  # noqa: E731
                                                       self.row_trials[lag])
        tree = self.adapt.next(self.budget, accuracy)
        self.adapt.current = tree
        if tree != self.budget:
            self.use(tree)
            self.stats.update(tree_changes=1)

    def _score(self, paths: list[list[int]], done: list[bool], length: list[int]) -> None:
        """Queue the lagging rows' chains proposed for this round (``length``: each row's
        cache length before it) with the heads' tree's accepted depth, and score those
        whose text is now known (``lookup.ChainLength``)."""
        if self.proposed is not None:
            depth = self.tree_depth
            if depth is None:  # a sampled walk tries the chain after the tree: via it, none
                depth = [len(p) if self.to_head is None or not p or self.to_head[p[0]] >= 0
                         else 0 for p in paths]
            running = [not d and not e for d, e in zip(done, self.ended)]
            # the round's highest order set its copies for every row: each row's gain is
            # that order's (ChainLength)
            highest = self.order
            self.chain.count_round(highest)
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
                self.chain.score(proposal, context.tokens[start:start + len(proposal)], accepted,
                                 highest)

    def observe(self, rows: Optional[list], paths: list[list[int]], bonus: list[int],
                done: list[bool]) -> None:
        """Count, for every head that drafted after a row's accepted path, the rank of the
        model's token among its guesses there (``runtime.decoding.tree.adapt``). ``rows``: the
        tokens verified, on the host ``[B][m]`` (None when only the root was)."""
        # [B][every guess, flat]: read back with the round's acceptance where it was greedy
        guesses_read = self.guessed if self.guessed is not None \
            else torch.cat(self._guesses(), 1).tolist()
        if self.hydra:  # per level: (the parents' node indices, [B][parents][ranks])
            levels, at = [], 0
            for parents, ids in self.drafted:
                _, p, n = ids.shape
                levels.append((parents, [[row[at + j * n:at + (j + 1) * n] for j in range(p)]
                                         for row in guesses_read]))
                at += p * n
        else:
            _, k, n = self.drafted.shape  # [B][K][ranks]
            drafted = [[row[j * n:(j + 1) * n] for j in range(k)] for row in guesses_read]
        for r, path in enumerate(paths):
            if done[r]:
                continue
            nodes = [0, *path]
            for d, node in enumerate(nodes):
                if d >= len(self.ranks):
                    break
                target = rows[r][nodes[d + 1]] if d + 1 < len(nodes) else bonus[r]
                if self.hydra:  # head d ran on the path only where the node has children
                    node = self.to_head[node] if self.to_head is not None else node
                    # a copied chain's node (-1) had no head run on its path; nor had a
                    # re-grown tree's expanded paths that were not kept (-1 there too)
                    if node < 0 or d >= len(levels) or node not in levels[d][0]:
                        break
                    guesses = levels[d][1][r][levels[d][0].index(node)]
                else:
                    guesses = drafted[r][d]
                rank = guesses.index(target) if target in guesses else None
                self.adapt.observe(d, rank)
                self.row_trials[r][d] += 1
                if rank is not None and rank < MAX_RANK:
                    self.row_hits[r][d][rank] += 1

    # -------------------------------------------------------------- acceptance
    def accept(self, logits: Tensor, tokens: Tensor, lay: dict) -> tuple[list[list[int]], list[int]]:
        """Per row: the accepted path (node indices, root excluded) and the token after it."""
        if not self.s.do_sample and self.strategy.acceptance == "exact":
            return self._greedy(logits, tokens, lay)
        return self._walk(logits, tokens, lay)

    def _greedy(self, logits, tokens, lay):
        target = greedy(logits)  # [B, m]
        parent, depth = lay["parent"], lay["depth"]
        m = tokens.shape[1]
        right = tokens == target[:, parent.clamp_min(0)]  # [B, m]: the model's choice after its parent
        right[:, 0] = True  # the root: the model's own
        # a node is accepted when it and every ancestor are right (one masked reduction,
        # not a Python pass over the nodes: this runs every round)
        ok = ~((~right)[:, None, :] & lay["ancestors"][None]).any(-1)  # [B, m]
        # the accepted nodes form one path, its deepest taken (siblings hold different
        # tokens, except a copied chain's first token, which may repeat a head's: then
        # both branches are the model's own text, and the deepest is still exact)
        best = torch.where(ok, depth[None] * m + torch.arange(m, device=self.device), -1).argmax(1)
        bonus = target[torch.arange(len(best), device=self.device), best]  # [B]
        parts = [best[:, None], bonus[:, None]]
        if self.to_head is not None and self.chain is not None:  # the heads' nodes' own best
            heads = torch.tensor([i >= 0 for i in self.to_head[:m]], device=self.device)
            parts.append(torch.where(ok & heads[None], depth[None], 0).amax(1)[:, None])
        guesses = self._counted_guesses()
        # one read back a round (on a GPU each one waits for the queued work):
        # [B, 2 (+ 1) + m (+ guesses)]
        read = torch.cat([*parts, tokens, *guesses], 1).tolist()
        c = len(parts)
        if c == 3:
            self.tree_depth = [row[2] for row in read]
        self.read = ([row[c:c + m] for row in read], best, bonus)
        self.guessed = [row[c + m:] for row in read] if guesses else None
        return [lay["paths"][row[0]] for row in read], [row[1] for row in read]

    def _walk(self, logits, tokens, lay):
        """Sampling (exact or typical) and greedy typical: node by node from the root."""
        return walk(logits, tokens, lay["children"], self.s, self.strategy, self.generator)

    # -------------------------------------------------------------- cache
    def compact(self, length: list[int], paths: list[list[int]]) -> None:
        """Move each row's accepted nodes from ``length + i`` to ``length + depth``."""
        moves = [(r, length[r] + i, length[r] + d) for r, p in enumerate(paths)
                 for d, i in enumerate(p, start=1) if i != d]
        if not moves:
            return
        rows, src, dst = torch.tensor(moves, device=self.device).unbind(1)  # one copy: [n, 3]
        self.cache.move(rows, src, dst)  # gathered first: sources lie past targets
        self.stats.update(kv_moves=len(moves))
