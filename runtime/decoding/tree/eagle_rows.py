"""The EAGLE draft layer in decoding: each row's own draft cache, caught up every round,
and the tree's levels drafted below it (``passes.eagle_draft``, ``rewriter.drafts.eagle``).

At position ``i`` the layer reads the model's feature ``f_i`` (the LM head's input) beside
the embedding of ``x_{i+1}``. So after a round that accepted ``a`` drafted tokens
``y_1 .. y_a`` below the root ``x_n`` (at position ``n``) and the model's token ``z`` after
them, the row's draft cache grows by positions ``n .. n + a``: the verified features there
(the round's hidden states at the root and the accepted nodes) beside ``y_1 .. y_a, z``.
The last of them is the draft's feature ``g`` after ``z``, the next round's root: the
LM head turns it into the root's children. A deeper node runs the layer once more on its
parent's output feature and its own token, at position ``n' + depth - 1``, attending to the
row's cache and its own ancestors' keys (``eagle.tree_level``), kept by level for its
children. Drafted nodes never enter the cache, so nothing is rolled back.

Every row of a batch drafts the same tree shape (``runtime.decoding.tree.dynamic``) with its own
tokens, so a level runs for every row at once: the rows' caches are one padded tensor,
each row its own length (positions past it masked). Catching up stays a row at a time
(each row accepted its own number of tokens). The layer runs in torch in both backends:
it is one layer against the model's many.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.drafts import eagle
from rewriter.ir.eagle_graph import eagle_node
from rewriter.errors import RewriterError
from rewriter.ops import EAGLE_WEIGHTS, op_arguments

from ... import packed_linear


TEXT_STEP = 256  # positions a level's text grows by (``EagleRows._level``)


class EagleProgram:
    """The draft layer's weights as the IR holds them, with the model's token embedding
    and LM head (its draft-vocabulary rows, where trimmed); what ``EagleRows`` runs. ``code``: what it is, for ``Engine.programs()``."""
    generated_kernels = ()  # none: it runs in torch (the Triton backend's artifacts list them)

    def __init__(self, params: dict, shape: eagle.Shape, embed: Tensor, lm: Tensor,
                 scale: Optional[float] = None):
        self.params, self.shape, self.embed, self.lm = params, shape, embed, lm
        self.scale = scale  # the model's embedding scale (Gemma's sqrt(hidden)), or None
        self._weights: dict = {}

    def embedded(self, ids: Tensor) -> Tensor:
        """The embeddings of ``ids`` as the graph's ``rw.embedding`` makes them."""
        rows = self.embed[ids]
        return rows if self.scale is None else rows * self.scale

    def weights(self, device, dtype: torch.dtype) -> dict:
        """The layer's weights as decoding reads them, on ``device`` in ``dtype``, with the
        draft's LM head (``lm_head``, ``[V, H]``): q/k/v and gate/up as one product each
        (``eagle.fused``: a level makes 5 weight products, not 8), matrices packed for
        oneDNN where the machine packs (``runtime.packed_linear``) and there is room, made
        once for every generation's ``EagleRows``."""
        key = (str(device), dtype)
        if key not in self._weights:
            p = eagle.fused({k: v.to(device, dtype) for k, v in self.params.items()})
            p["lm_head"] = self.lm.to(device, dtype)
            matrices = [k for k, v in p.items() if v.dim() == 2 and packed_linear.supported(v)]
            # each packed copy replaces its matrix here: room for the moment both exist
            if matrices and packed_linear.pays() and packed_linear.room_for(
                    max(p[k].nbytes for k in matrices)):
                p.update({k: packed_linear.pack(p[k]) for k in matrices})
            self._weights[key] = p
        return self._weights[key]

    @classmethod
    def of(cls, ir) -> "EagleProgram":
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
        scale = op_arguments("embedding", tuple(embedded.args), dict(embedded.kwargs))["scale"]
        return cls(params, shape, embed, lm, scale)

    @property
    def code(self) -> str:
        s = self.shape
        return (f"# EAGLE draft layer (rewriter.drafts.eagle, runtime.decoding.tree.eagle_rows): hidden {s.hidden}, "
                f"{s.heads} heads, {s.kv_heads} KV heads, MLP {s.intermediate}, RoPE base "
                f"{s.rope_theta}, eps {s.eps}\n"
                f"# catch-up: eagle.step(params, shape, features [1, n, H], embed[next ids] "
                f"[1, n, H], row cache) -> (g [1, n, H], cache + n)\n"
                f"# level d >= 1, every row at once: eagle.tree_level(params, shape, parents' g "
                f"[B, P, H], embed[tokens] [B, P, H], the rows' padded caches, their lengths, "
                f"ancestors' keys) -> g [B, P, H]\n"
                f"# guesses: log_softmax(g @ lm_head.T).topk(ranks)\n")


class EagleRows:
    """Each row's draft state: its cache over the accepted text (one padded tensor for the
    batch, each row its own length), the draft's feature after the row's root, and this
    round's drafted levels."""

    def __init__(self, program: EagleProgram, batch: int, device, capacity: int = 256):
        dtype = program.lm.dtype  # the model's (the pass stored the layer's weights so)
        self.p = program.weights(device, dtype)
        self.shape, self.embedded, self.lm = program.shape, program.embedded, program.lm
        s = self.shape
        # [B, kv, capacity, d] each; row r's cache is its first lengths[r] positions
        self.k = torch.zeros(batch, s.kv_heads, capacity, s.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lengths = [0] * batch
        self.g: list[Optional[Tensor]] = [None] * batch  # [H] each
        # this round's levels: (each row's {path of tokens: slot}, features [B, P, H],
        # ancestors' and own keys and values [B, P, kv, depth, d] each, or None at the root)
        self.levels: list[tuple] = []
        self.idle: set = set()  # rows that are done: not drafted for (their tokens are dropped)
        self.chunk = 256  # nodes projected onto the vocabulary at once (a big batch's memory)

    def cache(self, row: int) -> tuple[Tensor, Tensor]:
        """Row ``row``'s cache ``(keys, values)`` ``[1, kv, L, d]`` (views)."""
        n = self.lengths[row]
        return self.k[row:row + 1, :, :n], self.v[row:row + 1, :, :n]

    @property
    def caches(self) -> list[tuple[Tensor, Tensor]]:
        """Every row's ``cache``."""
        return [self.cache(r) for r in range(len(self.lengths))]

    def catch_up(self, row: int, features: Tensor, next_ids: list[int], chunk: int = 2048) -> None:
        """Positions the row accepted: the model's ``features`` there ``[n, H]`` beside the
        tokens after each, ``next_ids`` (``n``; the last: the next round's root); a long
        prompt in steps of ``chunk`` positions, as the model's prefill goes (a step's mask
        and scores are ``[n, L + n]``)."""
        ids = torch.tensor(next_ids, dtype=torch.int64, device=features.device)
        embedded = self.embedded(ids).to(features.dtype)  # [n, H]
        self._room(self.lengths[row] + len(next_ids))
        with torch.inference_mode():
            for a in range(0, len(next_ids), chunk):
                at = self.lengths[row]
                out, (k, v) = eagle.step(self.p, self.shape, features[None, a:a + chunk],
                                         embedded[None, a:a + chunk], self.cache(row))
                self.k[row, :, at:k.shape[2]], self.v[row, :, at:k.shape[2]] = k[0, :, at:], v[0, :, at:]
                self.lengths[row] = k.shape[2]
        self.g[row] = out[0, -1]  # [H]

    def _room(self, length: int) -> None:
        """Capacity for ``length`` positions in every row (doubled as needed)."""
        if length <= self.k.shape[2]:
            return
        grown = max(length, 2 * self.k.shape[2])
        pad = (0, 0, 0, grown - self.k.shape[2])  # [B, kv, T, d]: more positions
        self.k, self.v = torch.nn.functional.pad(self.k, pad), torch.nn.functional.pad(self.v, pad)

    def call(self, d: int, chains: Tensor, ranks: int) -> tuple[Tensor, Tensor]:
        """``dynamic``'s call: level ``d``'s guesses below the expanded paths ``chains``
        ``[B, P, d + 1]`` (the root first): log-probabilities and indices ``[B, P, ranks]``
        into the draft's rows (with a trimmed vocabulary the caller maps them to token ids).
        Every row runs at once; rows that are done get zeros (no say in the tree's shape:
        ``dynamic``'s weight 0)."""
        b, n = chains.shape[:2]
        g = self._level(d, chains).reshape(b * n, -1)  # [B*P, H]
        lm = self.p["lm_head"]  # [V, H], or packed
        logp, ids = [], []
        for a in range(0, b * n, self.chunk):  # [chunk, V] logits at a time, not [B*P, V]
            top = eagle._linear(g[a:a + self.chunk], lm).float().log_softmax(-1).topk(ranks, dim=-1)
            logp.append(top.values)
            ids.append(top.indices)
        logp, ids = torch.cat(logp).view(b, n, ranks), torch.cat(ids).view(b, n, ranks)
        if self.idle:
            idle = torch.tensor([r in self.idle for r in range(b)], device=chains.device)[:, None, None]
            logp, ids = logp.masked_fill(idle, 0.0), ids.masked_fill(idle, 0)
        return logp, ids

    def _level(self, d: int, chains: Tensor) -> Tensor:
        """Every row's draft features ``[B, P, H]`` after each of its expanded paths."""
        b, n = chains.shape[:2]
        if d == 0:
            g = torch.stack(self.g)[:, None].expand(b, n, -1)  # [B, P, H]: the roots' own
            self.levels = [([{(): 0}] * b, g, None)]
            return g
        slots, parent_g, parent_kv = self.levels[-1]
        paths = [[tuple(p) for p in row] for row in chains[:, :, 1:].tolist()]  # [B][P] tokens
        up = torch.tensor([[slots[r][p[:-1]] for p in row] for r, row in enumerate(paths)],
                          device=chains.device)  # [B, P]: each node's parent's slot
        rows = torch.arange(b, device=chains.device)[:, None]
        feature = parent_g[rows, up]  # [B, P, H]
        path = None if parent_kv is None else (parent_kv[0][rows, up], parent_kv[1][rows, up])
        # the rows' text in steps of TEXT_STEP positions (masked past each row's length):
        # on a CPU, bfloat16 products build a oneDNN kernel for every new shape, and a
        # round's first level over a length never seen took 1.7 ms against 0.3
        top = -(-max(self.lengths) // TEXT_STEP) * TEXT_STEP  # the slice stops at the buffer's end
        with torch.inference_mode():
            g, k, v = eagle.tree_level(self.p, self.shape, feature,
                                       self.embedded(chains[:, :, -1]).to(feature.dtype),
                                       self.k[:, :, :top], self.v[:, :, :top],
                                       torch.tensor(self.lengths, device=chains.device), path)
        own = (k, v) if path is None else (torch.cat([path[0], k], 3), torch.cat([path[1], v], 3))
        self.levels.append(([{p: i for i, p in enumerate(row)} for row in paths], g, own))
        return g

    def drafted(self, row: int) -> dict:
        """This round's drafted nodes of ``row``: ``{path of tokens: feature [H]}`` (the
        root's, ``()``, included)."""
        return {p: g[row, i] for slots, g, _ in self.levels for p, i in slots[row].items()}
