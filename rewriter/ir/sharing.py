"""KV sharing across layers in the IR: an attention op whose ``kv_source`` names another
layer reads that layer's cache (Cross-Layer Attention, KVSharer) and writes none.

The reader takes the owner's own k and v nodes (and its rotary tables, when the rotation
happens inside the op), so the whole-sequence graph computes exactly what the runtime
reads from the owner's cache. ``check_sharing`` keeps that true after every pass.
"""
from __future__ import annotations

from torch import fx

from rewriter.errors import VerificationError
from rewriter.ir.core import IR
from rewriter.ops import OPS, op_arguments

# what the owner's cache is made of: a reader must see the same
SAME_INPUTS = ("k", "v", "cos", "sin")
SAME_CACHE = ("num_kv_heads", "head_dim", "causal", "window")
# a ring overwrites slots its readers might still need, and a selection reads its own
# layer's cache bounds (refused, not approximated)
UNSHARED = ("sinks", "full_heads", "select", "rotary")


def attention_by_layer(graph: fx.Graph) -> dict[int, fx.Node]:
    """``{layer: its rw.attention node}``."""
    return {_args(n)["layer"]: n for n in graph.find_nodes(op="call_function",
                                                           target=OPS["attention"])}


def sources(graph: fx.Graph) -> dict[int, int]:
    """``{reader layer: owner layer}`` of every attention op that reads another's cache."""
    return {layer: _args(n)["kv_source"] for layer, n in attention_by_layer(graph).items()
            if _args(n)["kv_source"] is not None}


def readers_of(graph: fx.Graph, owners) -> dict[int, list[int]]:
    """``{owner: [its readers]}`` for each of ``owners`` that any layer reads."""
    found: dict[int, list[int]] = {}
    for reader, owner in sorted(sources(graph).items()):
        if owner in owners:
            found.setdefault(owner, []).append(reader)
    return found


def check_sharing(ir: IR) -> None:
    """Each reader's owner is an attention op earlier in the graph that owns its cache,
    has the same KV heads, head size and window, and hands the reader its own k, v and
    rotary tables; neither side keeps a ring or a selection."""
    by_layer = attention_by_layer(ir.graph)
    order = {n: i for i, n in enumerate(ir.graph.nodes)}
    for layer, node in by_layer.items():
        args = _args(node)
        if args["kv_source"] is None:
            continue
        owner = by_layer.get(args["kv_source"])
        if owner is None:
            raise VerificationError(f"{node.name}: kv_source={args['kv_source']} names no "
                                    f"attention (layers {sorted(by_layer)})")
        _check_pair(node, args, owner, _args(owner), order)


def _check_pair(node: fx.Node, args: dict, owner: fx.Node, own: dict, order: dict) -> None:
    where = f"{node.name} (layer {args['layer']}) reads layer {own['layer']}'s cache"
    if own["kv_source"] is not None:
        raise VerificationError(f"{where}, which reads layer {own['kv_source']}'s: name the "
                                f"owner itself")
    if order[owner] > order[node]:
        raise VerificationError(f"{where}, which runs later: the owner writes first")
    for key in UNSHARED:
        for side in (args, own):
            if side[key] is not None:
                raise VerificationError(f"{where}, and layer {side['layer']} has {key}: KV "
                                        f"sharing is refused with rings and token selections")
    for key in SAME_CACHE + SAME_INPUTS:
        if args[key] != own[key]:
            shown = (lambda v: v.name if isinstance(v, fx.Node) else v)
            raise VerificationError(f"{where}, but its {key} ({shown(args[key])}) is not the "
                                    f"owner's ({shown(own[key])})")


def _args(node: fx.Node) -> dict:
    return op_arguments("attention", tuple(node.args), dict(node.kwargs))
