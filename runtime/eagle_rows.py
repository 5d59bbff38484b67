"""The EAGLE draft layer in decoding: each row's own draft cache, caught up every round,
and the tree's levels drafted below it (``passes.eagle_draft``, ``rewriter.eagle``).

At position ``i`` the layer reads the model's feature ``f_i`` (the LM head's input) beside
the embedding of ``x_{i+1}``. So after a round that accepted ``a`` drafted tokens
``y_1 .. y_a`` below the root ``x_n`` (at position ``n``) and the model's token ``z`` after
them, the row's draft cache grows by positions ``n .. n + a``: the verified features there
(the round's hidden states at the root and the accepted nodes) beside ``y_1 .. y_a, z``.
The last of them is the draft's feature ``g`` after ``z``, the next round's root: the
LM head turns it into the root's children. A deeper node runs the layer once more on its
parent's output feature and its own token, at position ``n' + depth - 1``, attending to the
row's cache and its own ancestors' keys (``eagle.tree_step``), memoised by its path of
tokens for its children. Drafted nodes never enter the cache, so nothing is rolled back.

Rows run one by one (each row's cache has its own length); every row of a batch drafts
the same tree shape (``runtime.tree_dynamic``), with its own tokens. The layer runs in
torch in both backends: it is one layer against the model's many.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter import eagle
from rewriter.errors import RewriterError
from rewriter.ops import EAGLE_WEIGHTS, op_arguments


class EagleProgram:
    """The draft layer's weights as the IR holds them, with the model's token embedding
    and LM head (its draft-vocabulary rows, where trimmed); what ``EagleRows`` runs. ``code``: what it is, for ``Engine.programs()``."""
    generated_kernels = ()  # none: it runs in torch (the Triton backend's artifacts list them)

    def __init__(self, params: dict, shape: eagle.Shape, embed: Tensor, lm: Tensor):
        self.params, self.shape, self.embed, self.lm = params, shape, embed, lm

    @classmethod
    def of(cls, ir) -> "EagleProgram":
        from rewriter.passes.eagle_draft import eagle_node
        node = eagle_node(ir)
        if node is None:
            raise RewriterError("the decoding record asks for an EAGLE draft, but the graph has "
                                "no rw.eagle_layer")
        bound = op_arguments("eagle_layer", tuple(node.args), dict(node.kwargs))
        weights = [bound[arg] for arg, _ in EAGLE_WEIGHTS]
        embedded, users = bound["embedded"], list(node.users)
        linear = users[0] if len(users) == 1 else None
        proj = linear.args[1] if linear is not None and linear.target is torch.ops.rw.linear.default \
            and len(linear.args) == 2 and not linear.kwargs else None  # no bias
        rows = None  # a trimmed draft vocabulary: index_select(lm_head, 0, medusa.vocab)
        if getattr(proj, "op", None) == "call_function" and proj.target is torch.ops.aten.index_select.default \
                and len(proj.args) == 3 and proj.args[1] == 0:
            proj, rows = proj.args[0], proj.args[2]
        if (any(getattr(w, "op", None) != "get_attr" for w in weights)
                or getattr(embedded, "op", None) != "call_function" or len(embedded.args) < 2
                or getattr(embedded.args[1], "op", None) != "get_attr"
                or getattr(proj, "op", None) != "get_attr"
                or (rows is not None and getattr(rows, "target", None) != "medusa.vocab")):
            raise RewriterError(f"{node.name}: the EAGLE draft layer must read stored weights, "
                                f"an embedding of stored rows, and feed one linear of a stored "
                                f"LM head or its stored rows (as EagleDraft writes it)")
        gate = ir.weight(weights[8].target)
        shape = eagle.Shape(ir.weight(weights[0].target).shape[0], bound["num_heads"],
                            bound["num_kv_heads"], gate.shape[0], bound["rope_theta"], bound["eps"])
        params = {name: ir.weight(w.target).detach() for (_, name), w in zip(EAGLE_WEIGHTS, weights)}
        lm, embed = ir.weight(proj.target).detach(), ir.weight(embedded.args[1].target).detach()
        if lm.dim() != 2 or embed.dim() != 2 or embed.shape != lm.shape or lm.shape[1] != shape.hidden:
            raise RewriterError(f"{node.name}: the token embedding {list(embed.shape)} and the LM "
                                f"head {list(lm.shape)} must both be [vocabulary, {shape.hidden}]")
        if rows is not None:  # its ids were checked against the vocabulary by check_heads
            lm = lm[ir.weight(rows.target)]  # [Vd, H]
        return cls(params, shape, embed, lm)

    @property
    def code(self) -> str:
        s = self.shape
        return (f"# EAGLE draft layer (rewriter.eagle, runtime.eagle_rows): hidden {s.hidden}, "
                f"{s.heads} heads, {s.kv_heads} KV heads, MLP {s.intermediate}, RoPE base "
                f"{s.rope_theta}, eps {s.eps}\n"
                f"# catch-up: eagle.step(params, shape, features [1, n, H], embed[next ids] "
                f"[1, n, H], row cache) -> (g [1, n, H], cache + n)\n"
                f"# level d >= 1: eagle.tree_step(params, shape, parents' g [P, H], embed[tokens] "
                f"[P, H], row cache, ancestors' keys) -> g [P, H]\n"
                f"# guesses: log_softmax(g @ lm_head.T).topk(ranks)\n")


class EagleRows:
    """Each row's draft state: its cache over the accepted text, the draft's feature after
    the row's root, and this round's drafted paths (token tuples) -> (feature, keys)."""

    def __init__(self, program: EagleProgram, batch: int, device):
        dtype = program.lm.dtype  # the model's (the pass stored the layer's weights so)
        self.p = {k: v.to(device, dtype) for k, v in program.params.items()}
        self.shape, self.embed, self.lm = program.shape, program.embed, program.lm
        self.caches = [eagle.empty_cache(self.shape, 1, dtype, device) for _ in range(batch)]
        self.g: list[Optional[Tensor]] = [None] * batch  # [H] each
        self.memo: list[dict] = [{} for _ in range(batch)]
        self.idle: set = set()  # rows that are done: not drafted for (their tokens are dropped)

    def catch_up(self, row: int, features: Tensor, next_ids: list[int], chunk: int = 2048) -> None:
        """Positions the row accepted: the model's ``features`` there ``[n, H]`` beside the
        tokens after each, ``next_ids`` (``n``; the last: the next round's root); a long
        prompt in steps of ``chunk`` positions, as the model's prefill goes (a step's mask
        and scores are ``[n, L + n]``)."""
        ids = torch.tensor(next_ids, dtype=torch.int64, device=features.device)
        embedded = self.embed[ids].to(features.dtype)  # [n, H]
        with torch.inference_mode():
            for a in range(0, len(next_ids), chunk):
                out, self.caches[row] = eagle.step(self.p, self.shape, features[None, a:a + chunk],
                                                   embedded[None, a:a + chunk], self.caches[row])
        self.g[row] = out[0, -1]  # [H]
        self.memo[row] = {(): (self.g[row], None)}

    def call(self, d: int, chains: Tensor, ranks: int) -> tuple[Tensor, Tensor]:
        """``tree_dynamic``'s call: level ``d``'s guesses below the expanded paths ``chains``
        ``[B, P, d + 1]`` (the root first): log-probabilities and indices ``[B, P, ranks]``
        into the draft's rows (with a trimmed vocabulary the caller maps them to token ids)."""
        logps, ids = [], []
        host = chains[:, :, 1:].tolist() if d else None  # [B][P][d] the drafted tokens
        for r in range(chains.shape[0]):
            if r in self.idle:  # no say in the shape (tree_dynamic's weight 0), no layer call
                logps.append(torch.zeros(chains.shape[1], ranks, device=chains.device))
                ids.append(torch.zeros(chains.shape[1], ranks, dtype=torch.int64, device=chains.device))
                continue
            g = self._level(r, d, chains[r], host[r] if d else None)  # [P, H]
            top = (g @ self.lm.t().to(g.dtype)).float().log_softmax(-1).topk(ranks, dim=-1)
            logps.append(top.values)
            ids.append(top.indices)
        return torch.stack(logps), torch.stack(ids)

    def _level(self, r: int, d: int, chains: Tensor, paths: Optional[list]) -> Tensor:
        """Row ``r``'s draft features ``[P, H]`` after each of its expanded paths."""
        if d == 0:
            return self.g[r][None].expand(chains.shape[0], -1)
        memo = self.memo[r]
        paths = [tuple(p) for p in paths]
        parents = [memo[p[:-1]] for p in paths]
        feature = torch.stack([q[0] for q in parents])  # [P, H]
        path = None if d == 1 else tuple(torch.stack([q[1][i] for q in parents]) for i in (0, 1))
        cache = self.caches[r]
        with torch.inference_mode():
            g, k, v = eagle.tree_step(self.p, self.shape, feature,
                                      self.embed[chains[:, -1]].to(feature.dtype), cache, path,
                                      cache[0].shape[2] + d - 1)  # [P, H], [P, kv, 1, hd]
        for i, p in enumerate(paths):  # each node's own keys, below its ancestors'
            own = (k[i], v[i]) if path is None else \
                (torch.cat([path[0][i], k[i]], 1), torch.cat([path[1][i], v[i]], 1))
            memo[p] = (g[i], own)  # own: [kv, depth, hd] each
        return g
