"""``MedusaHeads`` and ``HydraHeads``: draft heads on the last hidden state, verified as a
token tree.

    MedusaHeads(weights="smollm2")                       # the shipped trained heads
    MedusaHeads(weights="heads.safetensors", draft_vocab=4096, tree="auto", max_nodes=32)
    MedusaHeads(num_heads=3, tree=[[0], [1], [0, 0]])    # untrained (zero) heads: for tests
    HydraHeads(weights="smollm2", draft_vocab=4096, dynamic=4)  # re-grown every round
    HydraHeads(weights="smollm2", draft_vocab=4096, lookup=0)   # no tokens copied from the text

The pass adds the heads to the graph as ordinary ops on the LM head's input ``h``
(``rewriter.passes.draft_graph``)::

    r_k = h + silu(linear(h, medusa.w{k}, medusa.b{k}))        [B, S, H]   k = 0..K-1
    draft = linear(cat([r_0[.., None, :], ..], -2), P)         [B, S, K, V or Vd]

``HydraHeads`` writes Hydra's sequentially dependent heads (``rewriter.drafts.heads``): head
``k`` also reads the embeddings of the tokens on its path. In the graph the path is the
input's own next tokens (teacher forcing: what the heads were trained on)::

    path = next_tokens(input_ids, K)                            [B, S, K]
    e_j = embedding(select(path, -1, j), E)                     [B, S, H]  (the model's E)
    r_k = h + silu(linear(cat([h, e_0, .., e_k], -1), hydra.w{k}, hydra.b{k}))
    draft_k = linear(r_k, P)                                    [B, S, V or Vd]
    draft = cat([draft_0[.., None, :], ..], -2)                 [B, S, K, V or Vd]

Heads of more than one block (a file trained with ``--blocks B``) run ``B - 1`` more
residual blocks on ``r_k`` before the projection, the same ops again::

    r_k = r_k + silu(linear(r_k, {medusa,hydra}.block{l}.w{k}, ...b{k}))   l = 1 .. B - 1

and the runtime lowers one program per head with ``h`` and the path as inputs, run level
by level over the tree's nodes (``runtime.decoding.tree.drafters``).

``P`` is the model's own LM head weight (shared: no copy), or with ``draft_vocab=N`` its
rows for the ``N`` tokens the model produced most often on the training text
(``index_select(lm_head, 0, medusa.vocab)`` ``[N, H]``, computed once at lowering;
VocabTrim; an ``N`` past the vocabulary keeps all of it, so one setting serves models of
any vocabulary). The graph
then returns ``(logits, draft)``. The decoding record (``rewriter.decoding``) holds the
tree (``rewriter.drafts.tree``): given, or chosen from the heads' measured accuracies and the
cost of a round, its programs and its own work against a whole plain step, timed by the
measurer ``rewriter.optimize`` gives, on the backend and device that will run the model
(``tree="auto"``; ``rewriter.measure.round_cost``; ``ir.info["measured_on"]`` says where;
then also the sub-tree of its likeliest nodes a
round verifies at 2, 4 and 8 rows, where verifying many tokens costs more: none at all,
plain decoding, when nothing pays; with ``adapt=True``, the default, the record keeps the
accuracies and costs, and the runtime re-chooses the sub-tree from what the heads guess
right on the text it decodes: ``runtime.decoding.tree.adapt``). The output is the model's: greedy tokens
equal plain greedy decoding's, sampling follows its distribution; ``acceptance="typical"``
(Medusa's typical acceptance) is the explicit lossy option. With ``dynamic=e`` the round
verifies as many nodes as the tree, but in a shape re-grown every round from the heads'
own probabilities, expanding the ``e`` likeliest nodes of each level (EAGLE-2's dynamic
tree: ``runtime.decoding.tree.dynamic``). With ``lookup=L`` every round also verifies a chain of up
to ``L`` tokens copied from the row's own text, where its last tokens occurred before
(prompt lookup: code and answers repeat their context; ``runtime.decoding.tree.lookup``); with the
adaptive tree's costs the rounds verify as many of them as pay on the text being decoded
(maybe none), and where no tree pays at a batch size, rounds may verify a chain alone.
The default: ``lookup=4`` with ``tree="auto"`` and ``adapt=True`` (trained heads), else 0.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch

from rewriter.drafts import heads as heads_file
from rewriter.decoding import MAX_EXPAND, MAX_LOOKUP, TreeDecoding, check_record, check_undecided
from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.pass_manager import Measurer, Pass
from rewriter.measure import round_cost
from rewriter.measure.calibrate import ShortContext
from rewriter.drafts.tree import MAX_NODES, MAX_RANK, best_subtree, chain, choose_tree, make_tree
from rewriter.passes.draft_graph import embedding_weight, insert, insert_hydra, lm_head

BATCHES = (2, 4, 8)  # batch sizes (beside 1) that get their own sub-tree of the auto tree
LOOKUP = 4  # copied tokens a round may verify, by default where the rounds choose how many


class MedusaHeads(Pass):
    ARCH = "medusa"
    measures = True  # tree="auto" with trained heads: the rounds' costs

    def __init__(self, num_heads: Optional[int] = None, weights: Optional[str] = None,
                 draft_vocab: Optional[int] = None, tree="auto", max_nodes: int = 32,
                 acceptance: str = "exact", posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, adapt: bool = True, dynamic: int = 0,
                 lookup: Optional[int] = None):
        self.heads, self.weights, self.num_heads = self._read_heads(num_heads, weights)
        if draft_vocab is not None and (type(draft_vocab) is not int or draft_vocab < 10):
            raise ValueError(f"{type(self).__name__}: draft_vocab must be an int >= 10, got {draft_vocab!r}")
        if draft_vocab is not None and (self.heads is None or self.heads.counts is None):
            raise ValueError(f"{type(self).__name__}: draft_vocab needs trained heads whose file counts "
                             "the tokens the model produced (weights=PATH from train-heads)")
        self.draft_vocab = draft_vocab
        if tree != "auto":
            tree = make_tree(tree, self.num_heads).record()  # ValueError names the problem
        self.tree = tree
        if type(max_nodes) is not int or not 1 <= max_nodes < MAX_NODES:
            raise ValueError(f"{type(self).__name__}: max_nodes must be an int in [1, {MAX_NODES - 1}], "
                             f"got {max_nodes!r}")
        self.max_nodes = max_nodes
        self.acceptance, self.posterior_threshold, self.posterior_alpha = checked_acceptance(
            type(self).__name__, acceptance, posterior_threshold, posterior_alpha)
        if not isinstance(adapt, bool):
            raise ValueError(f"{type(self).__name__}: adapt must be True or False, got {adapt!r}")
        self.adapt = adapt
        if type(dynamic) is not int or not 0 <= dynamic <= MAX_EXPAND:
            raise ValueError(f"{type(self).__name__}: dynamic must be an int in [0, {MAX_EXPAND}] "
                             f"(0: a fixed tree; e: re-grown every round, expanding e nodes a "
                             f"level), got {dynamic!r}")
        self.dynamic = dynamic
        self.lookup = self._checked_lookup(lookup)
        self.report: Optional[dict] = None  # the tree choice: expected tokens, cost curve

    def _read_heads(self, num_heads: Optional[int], weights) -> tuple:
        """``(heads, weights, num_heads)``: the trained heads in ``weights`` (None without),
        its name as a string, and the head count, checked against each other."""
        if num_heads is not None and (type(num_heads) is not int
                                      or not 1 <= num_heads <= heads_file.MAX_HEADS):
            raise ValueError(f"{type(self).__name__}: num_heads must be an int in [1, "
                             f"{heads_file.MAX_HEADS}], got {num_heads!r}")
        if weights is None and num_heads is None:
            raise ValueError(f"{type(self).__name__}: give weights=PATH (trained heads; 'default' and "
                             "'smollm2' are shipped) or num_heads=K (untrained heads)")
        if weights is not None and not isinstance(weights, str):
            weights = str(weights)  # a Path
        try:
            heads = heads_file.load(weights, self.ARCH) if weights is not None else None
        except heads_file.HeadsFileError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None
        if heads is not None and num_heads not in (None, heads.num_heads):
            raise ValueError(f"{type(self).__name__}: num_heads={num_heads}, but {weights} holds "
                             f"{heads.num_heads} heads")
        return heads, weights, num_heads if num_heads is not None else heads.num_heads

    def _checked_lookup(self, lookup: Optional[int]) -> int:
        """``lookup``, checked; by default ``LOOKUP`` where the rounds measure what a chain
        adds and costs, and so choose it (an auto tree, adapted, of trained heads), else 0."""
        if lookup is None:
            lookup = LOOKUP if self.tree == "auto" and self.adapt and self.heads is not None \
                and self.heads.accuracy else 0
        if type(lookup) is not int or not 0 <= lookup <= MAX_LOOKUP:
            raise ValueError(f"{type(self).__name__}: lookup must be an int in [0, {MAX_LOOKUP}] "
                             f"(0: none; L: a chain of up to L tokens copied from the row's own "
                             f"text, verified beside the tree), got {lookup!r}")
        return lookup

    def run(self, ir: IR, measurer: Optional[Measurer] = None) -> IR:
        check_undecided(ir, self)
        head = lm_head(ir)
        weight = ir.weight(head.args[1].target)
        if self.heads is not None:
            try:
                self.heads.fits(weight.detach(), str(self.weights))
            except heads_file.HeadsFileError as e:
                raise PassError(str(e)) from None
        if self.ARCH == "hydra":
            insert_hydra(ir, head, embedding_weight(ir, weight), self._weights(weight),
                         self._vocab(weight), self.name)
        else:
            insert(ir, head, self._weights(weight), self._vocab(weight), self.name)
        self._vocab_size = None if self.draft_vocab is None else min(self.draft_vocab, weight.shape[0])
        try:
            tree, batch_trees, costs = self._tree(ir, measurer)
        except ShortContext as e:  # timing the tree's rounds
            raise PassError(f"{e}: give the heads a smaller max_nodes, or tree=[...]") from None
        strategy = self._strategy(tree, batch_trees, costs)
        why = check_record(strategy.record())
        if why:
            raise PassError(f"{self!r}: the decoding record needs {why}")
        ir.info["decoding"] = strategy.record()
        ir.info["medusa"] = {"arch": self.ARCH, "weights": self.weights, "report": self.report,
                             "trained": self.heads.trained if self.heads else None}
        return ir

    def _strategy(self, tree, batch_trees=(), costs=()) -> TreeDecoding:
        return TreeDecoding(self.ARCH, depth=self.num_heads, tree=tree.paths,
                        draft_vocab=self._vocab_size, acceptance=self.acceptance,
                        posterior_threshold=self.posterior_threshold,
                        posterior_alpha=self.posterior_alpha, batch_trees=batch_trees,
                        accuracy=tuple(tuple(a[:MAX_RANK]) for a in self.heads.accuracy)
                        if costs else (),
                        costs=costs, dynamic=self.dynamic, lookup=self.lookup)

    def _weights(self, lm: torch.Tensor):
        k, h = self.num_heads, lm.shape[1]
        if self.heads is None:
            w = ([torch.zeros(h, h * (i + 2), dtype=lm.dtype, device=lm.device) for i in range(k)]
                 if self.ARCH == "hydra" else torch.zeros(k, h, h, dtype=lm.dtype, device=lm.device))
            return w, torch.zeros(k, h, dtype=lm.dtype, device=lm.device), None
        like = lambda t: t.to(lm.device, lm.dtype)  # noqa: E731
        deep = tuple(map(like, self.heads.deep)) if self.heads.deep is not None else None
        if self.ARCH == "hydra":
            return [like(w) for w in self.heads.w], like(self.heads.b), deep
        return like(self.heads.w), like(self.heads.b), deep

    def _vocab(self, lm: torch.Tensor):
        """The draft vocabulary's ids ``[N]`` (the most produced, sorted), or None."""
        if self.draft_vocab is None:
            return None
        counts = self.heads.counts
        if counts.numel() != lm.shape[0]:
            raise PassError(f"{self!r}: the heads file counts {counts.numel()} tokens, the "
                            f"model has {lm.shape[0]}")
        return heads_file.draft_vocab(counts, self.draft_vocab)

    def _tree(self, ir: IR, measurer: Optional[Measurer]) -> tuple:
        """The tree and, when chosen here, the sub-trees a round verifies at larger batches
        (``TreeDecoding.batch_trees``: there verifying many tokens is dearer) and, with
        ``adapt``, the measured costs (``TreeDecoding.costs``).

        The costs are the programs' plus what a round spends outside them, against a whole
        plain step, timed by ``measurer`` (``round_cost``)."""
        if self.tree != "auto":
            return make_tree(self.tree, self.num_heads), (), ()
        accuracy = self.heads.accuracy if self.heads is not None else []
        if not accuracy:  # untrained heads: nothing to choose from
            return chain(self.num_heads), (), ()
        timer = self.measurer(ir, measurer)
        tree, heads_1, times, costs = self._tree_at_one_row(ir, timer, accuracy)
        if self.report["predicted_speedup"] < 1:
            # no tree pays even at one row (where verifying 2 tokens costs 1.5 decode steps,
            # as float32 on some CPUs): the tree is kept in the record and no batch verifies
            # it; larger batches, where verifying costs more, need no tree measured. With
            # ``lookup`` a chain alone may still pay on text that repeats
            if self.lookup and self.adapt:
                costs += self._chain_costs(ir, timer, heads_1, times)
            return tree, ((1, ()),), tuple(costs) if self.adapt else ()
        batch_trees, batch_costs = self._batch_trees(ir, timer, tree, accuracy, costs)
        return tree, batch_trees, tuple(costs + batch_costs) if self.adapt else ()

    def _tree_at_one_row(self, ir: IR, timer: Measurer, accuracy: list) -> tuple:
        """``(tree, heads' cost, round times, costs)`` at one row: the tree chosen from the
        programs' costs, then again from those adjusted by a measured round's (its report in
        ``self.report``); ``costs`` its one row of ``TreeDecoding.costs``."""
        hydra = self.ARCH == "hydra"
        # rounds verify up to ``lookup`` copied tokens beside the tree: their costs too
        cost = timer.verify_cost(ir, min(self.max_nodes + 1 + self.lookup, MAX_NODES), runs=5)
        per_call = timer.heads_cost(ir, self.num_heads, hydra, runs=5)
        tree, _ = choose_tree(accuracy, cost, self.max_nodes, per_call, per_level=hydra)
        times = self._round_times(ir, timer, tree, (1,), (_cost_row(1, per_call, cost[1:]),))[1]
        heads_1, verify_1 = round_cost.adjust(per_call, cost[1:], times)
        tree, report = choose_tree(accuracy, [0.0, *verify_1], self.max_nodes, heads_1,
                                   per_level=hydra)
        self.report = {**report, "verify_cost": [round(c, 3) for c in cost[1:]],
                       "round_overhead": _overhead(times), "batches": {}}
        verified = min(tree.size + self.lookup, MAX_NODES)  # the tree and a chain: the costs kept
        return tree, heads_1, times, [_cost_row(1, heads_1, verify_1[:verified])]

    def _chain_costs(self, ir: IR, timer: Measurer, heads_1: float, times: dict) -> list:
        """The costs of a round verifying a chain alone at each of ``BATCHES`` (with the
        round's own work as measured at one row, ``times``)."""
        rows = []
        for b in BATCHES:
            cost_b = timer.verify_cost(ir, min(1 + self.lookup, MAX_NODES), runs=5, batch=b)
            _, verify_b = round_cost.adjust(0.0, cost_b[1:], times)
            rows.append(_cost_row(b, heads_1, verify_b))
        return rows

    def _batch_trees(self, ir: IR, timer: Measurer, tree, accuracy: list, costs: list) -> tuple:
        """``(batch_trees, their costs)``: at each of ``BATCHES`` the sub-tree of ``tree``
        that pays best there, from rounds of ``tree`` measured at that batch size (each
        reported in ``self.report["batches"]``)."""
        hydra = self.ARCH == "hydra"
        verified = min(tree.size + self.lookup, MAX_NODES)
        by_batch = self._round_times(ir, timer, tree, BATCHES, tuple(costs))
        batch_trees, rows = [], []
        for b in BATCHES:
            cost_b = timer.verify_cost(ir, verified, runs=5, batch=b)
            heads_b, verify_b = round_cost.adjust(
                timer.heads_cost(ir, self.num_heads, hydra, runs=5, batch=b), cost_b[1:], by_batch[b])
            sub, rate = best_subtree(tree, accuracy, [0.0, *verify_b], heads_b, hydra)
            batch_trees.append((b, sub.paths))
            rows.append(_cost_row(b, heads_b, verify_b))
            self.report["batches"][str(b)] = {"nodes": sub.size - 1, "predicted_speedup": rate,
                                              "verify_cost": [round(c, 3) for c in cost_b[1:]],
                                              "round_overhead": _overhead(by_batch[b])}
        return tuple(batch_trees), rows

    def _round_times(self, ir: IR, timer: Measurer, tree, batches: tuple, costs: tuple) -> dict:
        """Measured rounds of the drafted tree alone (not re-grown, no copied chain: the
        tree's size is what the costs are indexed by) at each of ``batches``."""
        vocab = ir.weight("medusa.vocab") if self.draft_vocab is not None else None
        strategy = self._strategy(tree, costs=costs if self.adapt else ())
        return timer.round_times(ir, replace(strategy, dynamic=0, lookup=0), batches, vocab)


def _cost_row(batch: int, heads: float, verify) -> tuple:
    """One row of ``TreeDecoding.costs``: ``(batch, heads' cost, verify costs)``, rounded."""
    return batch, round(heads, 4), tuple(round(c, 4) for c in verify)


def _overhead(times: dict) -> dict:
    """A round's work outside its programs and a plain step's whole time, in decode programs."""
    return {"round": round(times["fixed"] / times["decode"], 3),
            "plain_step": round(times["plain"] / times["decode"], 3)}


class HydraHeads(MedusaHeads):
    """Hydra's sequentially dependent heads (``HydraHeads(weights="smollm2")``): the same
    arguments as ``MedusaHeads``; drafting runs one head call per tree level."""
    ARCH = "hydra"


def checked_acceptance(who: str, acceptance: str, threshold, alpha) -> tuple:
    """``(acceptance, posterior_threshold, posterior_alpha)`` of a tree-verified pass,
    checked (``ValueError`` names the bad one); the posterior values as floats."""
    if acceptance not in ("exact", "typical"):
        raise ValueError(f"{who}: acceptance must be 'exact' (lossless) or 'typical' "
                         f"(lossy), got {acceptance!r}")
    for name, v in (("posterior_threshold", threshold), ("posterior_alpha", alpha)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1 \
                or not math.isfinite(v):
            raise ValueError(f"{who}: {name} must be a number in (0, 1], got {v!r}")
    return acceptance, float(threshold), float(alpha)
