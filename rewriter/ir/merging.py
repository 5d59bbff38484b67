"""MiniCache's merged pairs in the IR: two adjacent attention layers whose caches the
runtime keeps as one (``runtime.merged_cache``), each naming the other (``merge_with``)
with the pair's settings (``merge``: ``[t, gamma, retain]``).

The whole-sequence graph computes exact attention either way: merging is a property of
the cache, like a codec, so the loss shows only through the runtime. ``check_merging``
keeps the pairs servable after every pass.
"""
from __future__ import annotations

from torch import fx

from rewriter.errors import PassError, VerificationError
from rewriter.ir.core import IR
from rewriter.ir.nodes import attention_args
from rewriter.ir.sharing import attention_by_layer, readers_of

# what one stored direction serves: both layers must have the same
SAME_CACHE = ("num_kv_heads", "head_dim", "causal", "window", "merge")
# a ring overwrites slots, a selection reads its own layer's cache, a shared cache is
# written by another layer: none of them is merged (refused, not approximated)
UNMERGED = {"sinks": "a sink + window ring (StreamingAttention)",
            "full_heads": "DuoAttention's split heads",
            "select": "a token selection (TidalDecode, Quest)",
            "rotary": "StreamingLLM's sink positions", "kv_source": "a shared cache (ShareKV)"}


def merged_pairs(graph: fx.Graph) -> dict[int, int]:
    """``{first layer: second layer}`` of every merged pair (the first writes first)."""
    return {layer: args["merge_with"] for layer, args in
            ((layer, attention_args(n)) for layer, n in attention_by_layer(graph).items())
            if args["merge_with"] is not None and args["merge_with"] > layer}


def check_merging(ir: IR) -> None:
    """Each merged layer's partner is the next (or previous) attention layer, names it
    back, runs after (before) it, has the same KV heads, head size, window and settings,
    and neither keeps a ring, a selection or a shared cache; no speculative strategy
    (its rollbacks would leave the side buffer's tokens behind, ``runtime.merged_cache``)."""
    by_layer = attention_by_layer(ir.graph)
    layers = sorted(by_layer)
    order = {n: i for i, n in enumerate(ir.graph.nodes)}
    for layer, node in by_layer.items():
        args = attention_args(node)
        if args["merge_with"] is None:
            continue
        where = f"{node.name} (layer {layer}) is merged with layer {args['merge_with']}"
        other = by_layer.get(args["merge_with"])
        if other is None:
            raise VerificationError(f"{where}, which has no attention (layers {layers})")
        _check_pair(where, args, attention_args(other), layers, order[node] < order[other])
        read = readers_of(ir.graph, [layer])
        if read:  # they would read merged directions as K and V
            raise VerificationError(f"{where}, and layers {read[layer]} read its cache "
                                    f"(ShareKV): MiniCache is refused with a shared cache")
        if ir.info.get("decoding") is not None:
            raise VerificationError(f"{where}: MiniCache refuses the speculative strategy "
                                    f"{ir.info['decoding'].get('strategy')!r} (a rollback "
                                    f"cannot take tokens back out of a merged cache)")


def _check_pair(where: str, args: dict, other: dict, layers: list, earlier: bool) -> None:
    first, second = sorted((args["layer"], other["layer"]))
    if other["merge_with"] != args["layer"]:
        raise VerificationError(f"{where}, which is merged with {other['merge_with']}: a pair "
                                f"names each other")
    if layers.index(second) != layers.index(first) + 1:
        raise VerificationError(f"{where}: the pair's layers are not adjacent attention "
                                f"layers ({layers})")
    if earlier != (args["layer"] == first):
        raise VerificationError(f"{where}: layer {first} must run first (it writes the "
                                f"pair's directions)")
    for key, what in UNMERGED.items():
        for side in (args, other):
            if side[key] is not None:
                raise VerificationError(f"{where}, and layer {side['layer']} has {key}: "
                                        f"MiniCache is refused with {what}")
    for key in SAME_CACHE:
        if args[key] != other[key]:
            raise VerificationError(f"{where}, but its {key} ({args[key]}) is not the other "
                                    f"layer's ({other[key]})")


def merge(ir: IR, pairs: list[tuple[int, int]], settings: list[float], who: str) -> None:
    """Mark each ``(first, second)`` of ``pairs`` (layer ids) as a merged pair with
    ``settings`` (``[t, gamma, retain]``); ``PassError`` (naming ``who``) for what cannot."""
    by_layer = attention_by_layer(ir.graph)
    for pair in pairs:
        for layer, other in (pair, pair[::-1]):
            node = by_layer[layer]
            if attention_args(node)["merge_with"] is not None:
                raise PassError(f"{who}: layer {layer} is merged with layer "
                                f"{attention_args(node)['merge_with']} already")
            node.kwargs = {**node.kwargs, "merge_with": other, "merge": list(settings)}
            node.meta["pass"] = "MiniCache"
    try:  # heads, head size, window, rings, selections, sharing: the pass's own refusal
        check_merging(ir)
    except VerificationError as e:
        raise PassError(f"{who}: {e}") from None
