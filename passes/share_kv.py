"""``ShareKV``: layers read an earlier layer's KV cache instead of keeping their own.

    k_r = k_proj_r(x_r); v_r = v_proj_r(x_r); attention(q_r, k_r, v_r, layer=r)
becomes
    attention(q_r, k_o, v_o, layer=r, kv_source=o)

for each reader ``r`` and its owner ``o`` (an earlier layer): the reader's K/V projections
(and their norms and rotations) die, so they leave the IR and the artifact's weights, and
the runtime allocates one cache per owner, written by the owner alone
(``rewriter.ir.sharing``). Which layers share:

- ``sources={r: o, ...}``: an explicit map (a calibration's result, e.g. KVSharer's);
- ``every=k``: Cross-Layer Attention's groups of ``k`` adjacent layers, the lowest of each
  owning (CLA2 is ``every=2``);
- ``last=n``: the last ``n`` layers read the last layer before them, as Gemma 3n does.

Lossy on a model not trained for it (the readers' own K/V are gone): measure it
(``benchmarks/kv_sharing.py``). Rings (StreamingAttention, DuoAttention) and token
selections (TidalDecode, Quest) do not share: the verifier refuses them by name.
"""
from __future__ import annotations

from typing import Optional

from torch import fx

from rewriter.errors import PassError, VerificationError
from rewriter.ir.core import IR
from rewriter.ir.pass_manager import Pass
from rewriter.ir.sharing import attention_by_layer, check_sharing
from rewriter.ops import MAX_INT, OPS, op_arguments
from rewriter.values import is_int


class ShareKV(Pass):
    def __init__(self, sources: Optional[dict] = None, every: Optional[int] = None,
                 last: Optional[int] = None):
        given = [name for name, v in (("sources", sources), ("every", every), ("last", last))
                 if v is not None]
        if len(given) != 1:
            raise ValueError(f"ShareKV: give exactly one of sources={{reader: owner}}, every=k "
                             f"or last=n, got {', '.join(given) or 'none'}")
        if every is not None and (not is_int(every) or not 2 <= every <= MAX_INT):
            raise ValueError(f"ShareKV: every must be an integer >= 2 (layers a group), got {every!r}")
        if last is not None and (not is_int(last) or not 1 <= last <= MAX_INT):
            raise ValueError(f"ShareKV: last must be an integer >= 1, got {last!r}")
        self.sources = _checked_sources(sources) if sources is not None else None
        self.every = int(every) if every is not None else None
        self.last = int(last) if last is not None else None

    def run(self, ir: IR) -> IR:
        by_layer = attention_by_layer(ir.graph)
        if not by_layer:
            raise PassError(f"{self!r}: the IR has no rw.attention op")
        if ir.info.get("fusions", {}).get("FuseQKV"):
            raise PassError(f"{self!r} must run before FuseQKV: a fused projection would keep "
                            f"computing the readers' K and V with their queries")
        if ir.info.get("decoding") is not None:
            raise PassError(f"{self!r} must run before the speculative strategy "
                            f"({ir.info['decoding']['strategy']}), which times the model as it is")
        for reader, owner in sorted(self.pairs(sorted(by_layer)).items()):
            _share(by_layer[reader], by_layer[owner], self)
        try:  # heads, head size, window, rings, selections: named here, as this pass's
            check_sharing(ir)
        except VerificationError as e:
            raise PassError(f"{self!r}: {e}") from None
        ir.prune()  # the readers' K/V projections and their weights
        return ir

    def pairs(self, layers: list[int]) -> dict[int, int]:
        """``{reader: owner}`` over the attention layers present (ascending ids)."""
        if self.sources is not None:
            missing = sorted((set(self.sources) | set(self.sources.values())) - set(layers))
            if missing:
                raise PassError(f"{self!r}: layer {missing[0]} has no attention (layers "
                                f"{layers[0]}..{layers[-1]})")
            return dict(self.sources)
        if self.every is not None:
            return {r: layers[i - i % self.every] for i, r in enumerate(layers) if i % self.every}
        if self.last >= len(layers):
            raise PassError(f"{self!r}: the model has {len(layers)} attention layers; at least "
                            f"one must keep its cache for the last {self.last} to read")
        owner = layers[-self.last - 1]
        return {r: owner for r in layers[-self.last:]}


def _checked_sources(sources) -> dict[int, int]:
    """``{reader: owner}`` with integer layers (JSON keys arrive as digit strings), each
    owner earlier than its reader and owning its cache."""
    if not isinstance(sources, dict):  # {} shares nothing: the model as it is
        raise ValueError(f"ShareKV: sources must be a {{reader: owner}} map, got {sources!r}")
    pairs = {}
    for reader, owner in sources.items():
        r = int(reader) if isinstance(reader, str) and reader.isdigit() else reader
        if not is_int(r) or not is_int(owner) or not 0 <= owner < r <= MAX_INT:
            raise ValueError(f"ShareKV: sources maps a layer to an earlier one "
                             f"({{reader: owner}}, both >= 0), got {reader!r}: {owner!r}")
        pairs[int(r)] = int(owner)
    chained = sorted(set(pairs) & set(pairs.values()))
    if chained:
        raise ValueError(f"ShareKV: layer {chained[0]} both reads another's cache and is read: "
                         f"map its readers to its owner ({pairs[chained[0]]})")
    return pairs


def _share(node, owner, p: Pass) -> None:
    """``node`` reads ``owner``'s cache: the owner's k, v (and rotary tables) as its inputs."""
    args = op_arguments("attention", tuple(node.args), dict(node.kwargs))
    own = op_arguments("attention", tuple(owner.args), dict(owner.kwargs))
    if args["kv_source"] is not None:
        raise PassError(f"{p!r}: layer {args['layer']} reads layer {args['kv_source']}'s "
                        f"cache already")
    if (args["cos"] is None) != (own["cos"] is None):
        raise PassError(f"{p!r}: layers {own['layer']} and {args['layer']} rotate k in different "
                        f"places (FuseRoPE fused one of them): run ShareKV before FuseRoPE")
    if args["cos"] is not None and (args["cos"], args["sin"]) != (own["cos"], own["sin"]):
        raise PassError(f"{p!r}: layers {own['layer']} and {args['layer']} rotate by different "
                        f"tables")
    if _projection(args["k"]) is not None and _projection(args["k"]) is _projection(args["q"]):
        raise PassError(f"{p!r}: layer {args['layer']}'s K and V come out of one projection "
                        f"with its queries (GPT-2's c_attn): dropping them would not drop "
                        f"any weight, and this pass does not split projections")
    kept = {k: v for k, v in args.items() if k not in ("q", "k", "v") and v is not None}
    node.args = (args["q"], own["k"], own["v"])
    node.kwargs = {**kept, "kv_source": own["layer"]}
    node.meta.pop("val", None)  # other inputs now
    node.meta["pass"] = p.name


def _projection(node):
    """The linear op ``node`` comes out of, through reshapes, splits and rotations (their
    first input), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in (OPS["linear"], OPS["linear_int4"]):
            return node
        node = node.args[0] if node.args else None
    return None
