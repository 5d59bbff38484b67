"""``EagleDraft``: an EAGLE draft layer inserted as a pass, verified as a dynamic token tree.

    EagleDraft(weights="smollm2", draft_vocab=4096)         # the shipped SmolLM2 draft
                                                            # (a file named so: "./smollm2")
    EagleDraft(weights="draft.safetensors")                 # a trained draft (eagle_file)
    EagleDraft(weights="draft.safetensors", nodes=16, expand=4, depth=5)
    EagleDraft(weights="draft.safetensors", draft_vocab=4096)  # a trimmed draft projection

Unlike draft heads, which read only the last hidden state and the path, the draft is one
decoder layer of its own that attends to the whole text with a KV cache of its own
(``rewriter.drafts.eagle``: EAGLE's ``fc([f; e])``, a Llama layer, a final norm, the model's frozen
LM head). In the graph it is one op over whole rows, teacher-forced as it was trained::

    path = next_tokens(input_ids, 1)                         [B, S, 1]
    e = embedding(select(path, -1, 0), E)                    [B, S, H]  (the model's E)
    g = eagle_layer(h, e, eagle.fc_weight, .., eagle.norm)   [B, S, H]  h: the LM head's input
    draft = unsqueeze(linear(g, P), -2)                      [B, S, 1, V]

``P`` is the model's LM head weight, or with ``draft_vocab=N`` its rows for the ``N`` tokens
the model produced most often in the draft's training data (the file's ``counts``;
VocabTrim: ``index_select(lm_head, 0, medusa.vocab)``, as the draft heads trim theirs). On a
CPU the full projection is most of a round's drafting: SmolLM2's 49152 rows by 576, for
every node a level expands.

So the IR prints it, dumps show it and artifacts store its weights (``eagle.*``), and the
graph returns ``(logits, draft)``: at position ``t`` the draft's guess of the token two
after it. Decoding does not run that op: the runtime reads its weights and drafts with the
layer's own cache (``runtime.decoding.tree.eagle_rows``), caught up each round over the positions the
round accepted, and grows each round's tree from the draft's own probabilities (EAGLE-2's
dynamic tree, ``runtime.decoding.tree.dynamic``): ``depth`` levels, ``expand`` nodes expanded a
level, ``nodes`` tokens verified (the root included). Verification, acceptance (greedy,
sampled or typical) and the K/V compaction are the draft heads' (``runtime.decoding.tree.verify``):
the output is the model's.
"""
from __future__ import annotations

from typing import Optional

import torch

from rewriter.drafts import eagle_file
from rewriter.drafts.heads import MAX_HEADS, draft_vocab
from rewriter.decoding import MAX_EXPAND, MAX_LOOKUP, TreeDecoding, check_record, check_undecided
from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ops import EAGLE_WEIGHTS
from rewriter.ir.pass_manager import Pass
from rewriter.passes.draft_graph import embedding_args, embedding_weight, lm_head, mark
from rewriter.passes.draft_heads import checked_acceptance
from rewriter.ir.nodes import call
from rewriter.drafts.tree import MAX_NODES, MAX_RANK, make_tree

MAX_DEPTH = MAX_HEADS  # draft levels a round may grow (the record's depth)


class EagleDraft(Pass):
    ARCH = "eagle"

    def __init__(self, weights: str = None, nodes: int = 8, expand: int = 4, depth: int = 4,
                 draft_vocab: Optional[int] = None, acceptance: str = "exact", posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, lookup: int = 0):
        name = type(self).__name__
        if weights is None:
            raise ValueError(f"{name}: give weights='smollm2' (the shipped SmolLM2 draft) or "
                             f"PATH, a trained draft file (rewriter.drafts.eagle_file; "
                             f"made by `rewriter train-eagle`)")
        if not isinstance(weights, str):
            weights = str(weights)  # a Path
        try:
            self.draft = eagle_file.load(weights)
        except eagle_file.DraftFileError as e:
            raise ValueError(f"{name}: {e}") from None
        self.weights = weights
        for key, v, low, high in (("nodes", nodes, 2, MAX_NODES - 1), ("expand", expand, 1, MAX_EXPAND),
                                  ("depth", depth, 1, MAX_DEPTH), ("lookup", lookup, 0, MAX_LOOKUP)):
            if type(v) is not int or not low <= v <= high:
                raise ValueError(f"{name}: {key} must be an int in [{low}, {high}], got {v!r}")
        self.nodes, self.expand, self.depth, self.lookup = nodes, expand, depth, lookup
        most = sum(MAX_RANK ** k for k in range(1, depth + 1))  # paths of ranks < MAX_RANK
        if nodes - 1 > most:
            raise ValueError(f"{name}: a tree {depth} deep holds at most {most + 1} nodes with "
                             f"{MAX_RANK} guesses a node; nodes={nodes}")
        if draft_vocab is not None and (type(draft_vocab) is not int or draft_vocab < 10):
            raise ValueError(f"{name}: draft_vocab must be an int >= 10, got {draft_vocab!r}")
        if draft_vocab is not None and self.draft.counts is None:
            raise ValueError(f"{name}: draft_vocab needs a draft file that counts the tokens "
                             f"the model produced ({weights} has no counts)")
        self.draft_vocab = draft_vocab
        self.acceptance, self.posterior_threshold, self.posterior_alpha = checked_acceptance(
            name, acceptance, posterior_threshold, posterior_alpha)

    def __repr__(self) -> str:
        typical = (f", posterior_threshold={self.posterior_threshold}, posterior_alpha="
                   f"{self.posterior_alpha}") if self.acceptance == "typical" else ""
        return (f"EagleDraft(weights={self.weights!r}, nodes={self.nodes}, expand={self.expand}, "
                f"depth={self.depth}, draft_vocab={self.draft_vocab}, lookup={self.lookup}, "
                f"acceptance={self.acceptance!r}{typical})")

    def run(self, ir: IR) -> IR:
        check_undecided(ir, self)
        head = lm_head(ir)
        lm = ir.weight(head.args[1].target)
        try:
            self.draft.fits(lm.detach(), self.weights)
        except eagle_file.DraftFileError as e:
            raise PassError(str(e)) from None
        embed = embedding_weight(ir, lm)
        vocab = None
        if self.draft_vocab is not None:  # the most produced tokens, ids sorted
            vocab = draft_vocab(self.draft.counts, self.draft_vocab)
        self._vocab_size = None if vocab is None else len(vocab)
        insert_eagle(ir, head, embed, self.draft, lm, self.name, vocab)
        strategy = self.strategy()
        why = check_record(strategy.record())
        if why:
            raise PassError(f"{self!r}: the decoding record needs {why}")
        ir.info["decoding"] = strategy.record()
        ir.info["medusa"] = {"arch": self.ARCH, "weights": self.weights, "report": None,
                             "trained": self.draft.trained}
        return ir

    def strategy(self) -> TreeDecoding:
        """Dynamic rounds (``dynamic=expand``) of ``nodes`` tokens, ``depth`` levels deep.
        The record's tree only sizes them: each round grows its own."""
        return TreeDecoding(self.ARCH, depth=self.depth,
                        tree=budget_tree(self.nodes, self.depth).paths,
                        draft_vocab=getattr(self, "_vocab_size", None),
                        acceptance=self.acceptance, posterior_threshold=self.posterior_threshold,
                        posterior_alpha=self.posterior_alpha, dynamic=self.expand,
                        lookup=self.lookup)


def budget_tree(nodes: int, depth: int):
    """A tree of ``nodes`` tokens (the root included) at most ``depth`` deep: the sizes a
    dynamic round verifies. Its shape is a nominal one (each level's guesses right half as
    often as its best), by the probability of each path."""
    def p(path):
        out = 1.0
        for r in path:
            out *= 0.5 ** (r + 1)
        return out
    frontier, kept = [(0,)], []
    while len(kept) < nodes - 1:
        best = max(frontier, key=lambda q: (p(q), -len(q)))
        frontier.remove(best)
        kept.append(best)
        if best[-1] + 1 < MAX_RANK:
            frontier.append(best[:-1] + (best[-1] + 1,))  # its next sibling
        if len(best) < depth:
            frontier.append(best + (0,))  # its first child
    return make_tree(kept, depth)


def insert_eagle(ir: IR, head, embed, draft, lm: torch.Tensor, pass_name: str,
                 vocab: Optional[torch.Tensor] = None) -> None:
    """Add the draft layer after the LM head's input; the graph returns ``(logits, draft)``
    (``vocab``: the draft vocabulary's token ids, or None: the whole)."""
    g = ir.graph
    x = head.args[0]
    for arg, name in EAGLE_WEIGHTS:
        ir.add_weight(f"eagle.{arg}", draft.params[name].detach().to(lm.device, lm.dtype).clone())
    if vocab is not None:
        ir.add_weight("medusa.vocab", vocab.to(lm.device, torch.int64))
    ids = next(iter(g.find_nodes(op="placeholder")))
    s = draft.shape
    (out,) = g.find_nodes(op="output")
    with g.inserting_before(out):
        m = lambda n: mark(n, 0, pass_name)  # noqa: E731
        path = m(call(ir, torch.ops.rw.next_tokens.default, (ids, 1), "eagle_path"))
        path.meta["draft_path"] = True
        col = m(call(ir, torch.ops.aten.select.int, (path, -1, 0), "eagle_next"))
        e = m(call(ir, torch.ops.rw.embedding.default, embedding_args(col, embed), "eagle_e"))
        weights = [g.get_attr(f"eagle.{arg}") for arg, _ in EAGLE_WEIGHTS]
        layer = m(call(ir, torch.ops.rw.eagle_layer.default,
                       (x, e, *weights, s.heads, s.kv_heads, s.rope_theta, s.eps), "eagle_layer"))
        proj = head.args[1]
        if vocab is not None:
            proj = m(call(ir, torch.ops.aten.index_select.default,
                          (proj, 0, g.get_attr("medusa.vocab")), "medusa_vocab_rows"))
        logits = m(call(ir, torch.ops.rw.linear.default, (layer, proj), "eagle_logits"))
        logits.meta["head_logits"] = 0
        draft_out = m(call(ir, torch.ops.aten.unsqueeze.default, (logits, -2), "eagle_draft"))
    out.args = ((head, draft_out),)

