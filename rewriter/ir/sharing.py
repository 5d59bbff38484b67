"""KV sharing across layers in the IR: an attention op whose ``kv_source`` names another
layer reads that layer's cache (Cross-Layer Attention, KVSharer) and writes none.

The reader takes the owner's own k and v nodes (and its rotary tables, when the rotation
happens inside the op), so the whole-sequence graph computes exactly what the runtime
reads from the owner's cache. ``check_sharing`` keeps that true after every pass.

A shared cache may be a sparse one: a reader of a ring (StreamingAttention, DuoAttention)
keeps the same sinks, window and heads as its owner, and a reader of a Quest cache selects
its own pages by its own queries from the owner's pages and bounds (its ``select_pages``
names the owner's cache). TidalDecode's token selections are refused: a layer reusing
another's selection would read a third layer's cache.
"""
from __future__ import annotations

from torch import fx

from rewriter.errors import PassError, VerificationError
from rewriter.ir.core import IR
from rewriter.ir.nodes import attention_args
from rewriter.ops import OPS, op_arguments

# what the owner's cache is made of: a reader must see the same
SAME_INPUTS = ("k", "v", "cos", "sin", "rotary")
SAME_CACHE = ("num_kv_heads", "head_dim", "causal", "window", "sinks", "full_heads")


def attention_by_layer(graph: fx.Graph) -> dict[int, fx.Node]:
    """``{layer: its rw.attention node}``."""
    return {attention_args(n)["layer"]: n for n in graph.find_nodes(op="call_function",
                                                           target=OPS["attention"])}


def cache_of(args: dict) -> int:
    """The cache an attention op (its ``attention_args``) reads: its own layer's, or the
    owner's it shares."""
    return args["layer"] if args["kv_source"] is None else args["kv_source"]


def sources(graph: fx.Graph) -> dict[int, int]:
    """``{reader layer: owner layer}`` of every attention op that reads another's cache."""
    return {layer: attention_args(n)["kv_source"] for layer, n in attention_by_layer(graph).items()
            if attention_args(n)["kv_source"] is not None}


def readers_of(graph: fx.Graph, owners) -> dict[int, list[int]]:
    """``{owner: [its readers]}`` for each of ``owners`` that any layer reads."""
    found: dict[int, list[int]] = {}
    for reader, owner in sorted(sources(graph).items()):
        if owner in owners:
            found.setdefault(owner, []).append(reader)
    return found


def check_sharing(ir: IR) -> None:
    """Each reader's owner is an attention op earlier in the graph that owns its cache,
    has the same KV heads, head size, window, ring and Quest pages, and hands the reader
    its own k, v and rotary tables; neither side selects TidalDecode's tokens."""
    by_layer = attention_by_layer(ir.graph)
    order = {n: i for i, n in enumerate(ir.graph.nodes)}
    for layer, node in by_layer.items():
        args = attention_args(node)
        if args["kv_source"] is None:
            continue
        owner = by_layer.get(args["kv_source"])
        if owner is None:
            raise VerificationError(f"{node.name}: kv_source={args['kv_source']} names no "
                                    f"attention (layers {sorted(by_layer)})")
        _check_pair(node, args, owner, attention_args(owner), order)


def _check_pair(node: fx.Node, args: dict, owner: fx.Node, own: dict, order: dict) -> None:
    where = f"{node.name} (layer {args['layer']}) reads layer {own['layer']}'s cache"
    if own["kv_source"] is not None:
        raise VerificationError(f"{where}, which reads layer {own['kv_source']}'s: name the "
                                f"owner itself")
    if order[owner] > order[node]:
        raise VerificationError(f"{where}, which runs later: the owner writes first")
    for side in (args, own):
        if _selection(side) == "select_tokens":
            raise VerificationError(f"{where}, and layer {side['layer']} has a TidalDecode "
                                    f"selection: KV sharing is refused with token selections")
    if _pages(args) != _pages(own):
        raise VerificationError(f"{where}, but its Quest pages ({_pages(args)}) are not the "
                                f"owner's ({_pages(own)}): a reader selects from its owner's")
    if _pages(args) is not None and _select_args(args)["layer"] != own["layer"]:
        raise VerificationError(f"{where}, but its page selection names cache "
                                f"{_select_args(args)['layer']}")
    for key in SAME_CACHE + SAME_INPUTS:
        if args[key] != own[key]:
            shown = (lambda v: v.name if isinstance(v, fx.Node) else v)
            raise VerificationError(f"{where}, but its {key} ({shown(args[key])}) is not the "
                                    f"owner's ({shown(own[key])})")


def _selection(args: dict):
    """The short name of the attention's selection op, or None."""
    sel = args["select"]
    return None if sel is None else next((k for k in ("select_tokens", "select_pages")
                                          if sel.target is OPS[k]), "another op")


def _select_args(args: dict) -> dict:
    sel = args["select"]
    return op_arguments(_selection(args), tuple(sel.args), dict(sel.kwargs))


def _pages(args: dict):
    """The page size of a Quest selection (its cache keeps per-page bounds), or None."""
    return _select_args(args)["page"] if _selection(args) == "select_pages" else None


def share(ir: IR, pairs: dict[int, int], who: str) -> None:
    """Rewrite ``ir`` so each reader of ``pairs`` (``{reader: owner}``, layer ids) reads its
    owner's cache, then drop what the readers no longer compute (their K/V projections and
    weights); ``PassError`` (naming ``who``) for what cannot share."""
    by_layer = attention_by_layer(ir.graph)
    for reader, owner in sorted(pairs.items()):
        _share(by_layer[reader], by_layer[owner], who)
    try:  # heads, head size, window, rings, selections: named as the pass's own refusal
        check_sharing(ir)
    except VerificationError as e:
        raise PassError(f"{who}: {e}") from None
    ir.prune()


def _share(node: fx.Node, owner: fx.Node, who: str) -> None:
    """``node`` reads ``owner``'s cache: the owner's k, v (and rotary tables) as its inputs."""
    args, own = attention_args(node), attention_args(owner)
    if args["kv_source"] is not None:
        raise PassError(f"{who}: layer {args['layer']} reads layer {args['kv_source']}'s "
                        f"cache already")
    if (args["cos"] is None) != (own["cos"] is None):
        raise PassError(f"{who}: layers {own['layer']} and {args['layer']} rotate k in different "
                        f"places (FuseRoPE fused one of them): run ShareKV before FuseRoPE")
    if args["cos"] is not None and (args["cos"], args["sin"]) != (own["cos"], own["sin"]):
        raise PassError(f"{who}: layers {own['layer']} and {args['layer']} rotate by different "
                        f"tables")
    if _projection(args["k"]) is not None and _projection(args["k"]) is _projection(args["q"]):
        raise PassError(f"{who}: layer {args['layer']}'s K and V come out of one projection "
                        f"with its queries (GPT-2's c_attn): dropping them would not drop "
                        f"any weight, and this pass does not split projections")
    kept = {k: v for k, v in args.items() if k not in ("q", "k", "v") and v is not None}
    node.args = (args["q"], own["k"], own["v"])
    node.kwargs = {**kept, "kv_source": own["layer"]}
    node.meta.pop("val", None)  # other inputs now
    node.meta["pass"] = "ShareKV"


def _projection(node):
    """The linear op ``node`` comes out of, through reshapes, splits and rotations (their
    first input), or None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in (OPS["linear"], OPS["linear_int4"]):
            return node
        node = node.args[0] if node.args else None
    return None
