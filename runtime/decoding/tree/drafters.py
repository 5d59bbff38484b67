"""What drafts a round's tree: one drafter per record's ``drafter``, behind one interface
(``Drafter``; ``none``: copied chains alone, the base, which never drafts).

A drafter names the programs it needs (``programs``: beside ``tree_prefill`` and ``verify``)
and turns the hidden state ``h`` ``[B, 1, H]`` of each row's last accepted position
and the model's next token ``root`` ``[B]`` into the tree's tokens:

- ``fixed``: a given tree's tokens ``[B, n]`` (column 0: the root), and the ranked guesses
  behind them (``drafted``, what the adaptive tree counts: ``shape.Counts``);
- ``levels``: the call that grows a tree level by level (``dynamic.grow``), and ``grown``:
  the guesses behind the tree it grew.

``Medusa`` runs all heads once on ``h``: node ``(r0, .., rd)`` holds head ``d``'s ``rd``-th
best token. ``Hydra`` runs head ``d``, level by level, on the path of every depth-``d`` node
that has children (the root's token and the tokens below it); the ``rd``-th best token it
gives for the path of the node's parent fills the node. ``Eagle`` runs its draft layer with
a cache per row (``eagle_rows``), caught up over the prompt and every round's accepted
tokens. Chains copied from the row's text (``lookup.CopiedChains``) hang beside any of them.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import torch
from torch import Tensor

from rewriter.decoding import TreeDecoding
from rewriter.drafts.tree import Tree
from rewriter.ir.core import IR

from .dynamic import HeadCall
from .eagle_rows import EagleProgram, EagleRows

# (program name, *inputs) -> its output: a heads program, through a replay in static rounds
ProgramCall = Callable[..., Tensor]


class Drafter:
    """Drafts a tree's tokens (the module's docstring). ``call``: runs a heads program;
    ``vocab``: draft index -> token id (a trimmed draft vocabulary), or None."""
    level_by_level = False  # Hydra's and EAGLE's heads run on each level's paths
    every_position = False  # the prompt's hidden state at every position (EAGLE's catch-up)

    def __init__(self, call: ProgramCall, vocab: Optional[Tensor], stats: Counter, depth: int):
        self.call, self.vocab, self.stats, self.depth = call, vocab, stats, depth

    @staticmethod
    def programs(ir: IR, record: TreeDecoding, lowering) -> dict:
        """The programs it drafts with (``lowering``: ``runtime.programs.Lowering``)."""
        return {}  # copied chains alone: none

    def ids(self, indices: Tensor) -> Tensor:
        """Token ids of draft-vocabulary indices."""
        return indices if self.vocab is None else self.vocab[indices]

    def fixed(self, h: Tensor, root: Tensor, tree: Tree, plan, ranks: list[int]):
        """``(tokens [B, n], drafted)`` of ``tree`` (``plan``: its layout, or Hydra's
        ``level_plan``); ``ranks``: the ranks each depth drafts."""
        raise NotImplementedError

    def levels(self, h: Tensor, counted: int) -> HeadCall:
        """``dynamic.grow``'s call, each level's ``counted`` best guesses."""
        raise NotImplementedError

    def grown(self, tree: Tree, levels: list) -> object:
        """The ``drafted`` behind the tree ``dynamic.grow`` grew from ``levels``."""
        index = {p: i for i, p in enumerate(((),) + tree.paths)}  # a path's node, -1: not verified
        return [([index.get(p, -1) for p in paths], got) for paths, got in levels]

    def prompt(self, every: Tensor, ids: list, pad: list, token: list, chunk: int) -> None:
        """After the prefill: the hidden states ``every`` ``[B, S, H]`` of the prompts
        ``ids`` (``pad`` positions each), and the first new tokens."""

    def accepted(self, h: Tensor, paths: list, rows: list, done: list) -> None:
        """After a round: the hidden states ``h`` ``[B, m, H]`` it verified, each row's
        accepted path and tokens (``done``: the rows whose tokens are dropped)."""


class Medusa(Drafter):
    @staticmethod
    def programs(ir, record, lowering):  # the heads alone on h, at the accepted position only
        return {"heads": lowering.heads(ir)}

    def fixed(self, h, root, tree, plan, ranks):
        d = self.call("heads", h)[:, 0]  # [B, K, V or Vd]
        self.stats.update(head_passes=1)
        ids = self.ids(d.topk(max(ranks), dim=-1).indices)  # [B, K, ranks]
        return torch.cat([root[:, None], ids[:, plan["head"][1:], plan["rank"][1:]]], 1), ids

    def levels(self, h, counted):
        top = self.call("heads", h)[:, 0].float().log_softmax(-1).topk(counted, dim=-1)  # [B, K, R]
        self.stats.update(head_passes=1)
        self._ids = ids = self.ids(top.indices)
        b = h.shape[0]

        def call(d: int, chains: Tensor):  # every path at depth d gets head d's guesses
            p = chains.shape[1]
            return (top.values[:, d, None].expand(b, p, counted),
                    ids[:, d, None].expand(b, p, counted))
        return call

    def grown(self, tree, levels):
        return self._ids  # [B, K, ranks]: the heads' guesses at every depth


class Hydra(Drafter):
    level_by_level = True

    @staticmethod
    def programs(ir, record, lowering):  # drafting goes level by level: a program per head
        return {f"head{k}": lowering.heads(ir, head=k) for k in range(record.depth)}

    def _head(self, d: int, h: Tensor, chains: Tensor) -> Tensor:
        """Head ``d``'s logits ``[B, P, V]`` after the paths ``chains`` ``[B, P, d + 1]``."""
        b, p = chains.shape[:2]
        path = torch.zeros(b, p, self.depth, dtype=torch.int64, device=chains.device)
        path[:, :, :d + 1] = chains  # [B, P, d + 1]: root .. the parent
        logits = self.call(f"head{d}", h.expand(b, p, h.shape[-1]), path)
        self.stats.update(head_passes=1)
        return logits

    def fixed(self, h, root, tree, plan, ranks):
        nodes = torch.zeros(root.shape[0], tree.size, dtype=torch.int64, device=root.device)
        nodes[:, 0] = root
        drafted = []  # per level: (the parents' node indices, their ranked tokens)
        for d, (parents, chains, children, slot, rank, top, on_host) in enumerate(plan):
            logits = self._head(d, h, nodes[:, chains])  # [B, P, V]
            ids = self.ids(logits.topk(max(top, ranks[d]), dim=-1).indices)  # [B, P, ranks]
            nodes[:, children] = ids[:, slot, rank]
            drafted.append((on_host, ids))
        return nodes, drafted

    def levels(self, h, counted):
        def call(d: int, chains: Tensor):
            best = self._head(d, h, chains).float().log_softmax(-1).topk(counted, dim=-1)
            return best.values, self.ids(best.indices)
        return call


class Eagle(Hydra):
    """EAGLE's draft layer: it always grows its tree (``dynamic``)."""
    every_position = True

    def __init__(self, call, vocab, stats, depth, rows: EagleRows):
        super().__init__(call, vocab, stats, depth)
        self.rows = rows

    @staticmethod
    def programs(ir, record, lowering):  # not a lowered graph: the layer with a cache per row
        return {"eagle": EagleProgram.of(ir)}

    def levels(self, h, counted):
        def call(d: int, chains: Tensor):
            self.stats.update(head_passes=1)
            logp, rows = self.rows.call(d, chains, counted)
            return logp, self.ids(rows)
        return call

    def prompt(self, every, ids, pad, token, chunk):  # the draft's cache over each row's prompt
        for r, (row, p, t) in enumerate(zip(ids, pad, token)):
            self.rows.catch_up(r, every[r, p:], row[p + 1:] + [t], chunk)

    def accepted(self, h, paths, rows, done):  # the draft's cache over what each row accepted
        self.rows.idle = {r for r, d in enumerate(done) if d}
        for r, (p, row) in enumerate(zip(paths, rows)):
            if not done[r]:
                at = torch.tensor([0, *p], device=h.device)
                self.rows.catch_up(r, h[r, at], row)  # the root and the accepted nodes


DRAFTERS = {"medusa": Medusa, "hydra": Hydra, "eagle": Eagle, "none": Drafter}


def drafter_for(record: TreeDecoding, programs: dict, call: ProgramCall, vocab: Optional[Tensor],
                stats: Counter, batch: int, device: torch.device) -> Drafter:
    """The drafter of ``record``, for a generation of ``batch`` rows."""
    if record.drafter == "eagle":
        return Eagle(call, vocab, stats, record.depth, EagleRows(programs["eagle"], batch, device))
    return DRAFTERS[record.drafter](call, vocab, stats, record.depth)


def level_plan(lay: dict, depth: int, device: Optional[torch.device] = None) -> list[tuple]:
    """Hydra's drafting plan, one entry per tree level ``d``: the depth-``d`` nodes with
    children (``parents``), their paths from the root (``chains`` ``[P, d + 1]``), the
    depth-``d + 1`` nodes (``children``), each child's parent slot in ``parents`` and
    rank, and how many ranks the level needs."""
    host = lambda v: v.tolist() if isinstance(v, Tensor) else list(v)  # noqa: E731
    parent, depth_of, rank = host(lay["parent"]), host(lay["depth"]), host(lay["rank"])
    device = device if device is not None else lay["parent"].device
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    out = []
    for d in range(depth):
        children = [i for i, x in enumerate(depth_of) if x == d + 1]
        parents = sorted({parent[c] for c in children})
        chains = []
        for p in parents:
            chain = [p]
            while chain[-1] > 0:
                chain.append(parent[chain[-1]])
            chains.append(chain[::-1])  # [d + 1]: root .. p
        slot = [parents.index(parent[c]) for c in children]
        out.append((t(parents), t(chains), t(children), t(slot), t([rank[c] for c in children]),
                    max(rank[c] for c in children) + 1, parents))
    return out
