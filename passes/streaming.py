"""StreamingLLM's attention: every layer keeps its first ``sinks`` tokens and the last
``window`` ones, in a cache of ``sinks + window`` slots (``runtime.ring_cache``).

``StreamingAttention(sinks=4, window=1020)`` sets ``sinks`` and ``window`` on every
``rw.attention`` (or on the layers named by ``layers=[...]``). The IR shows them on each
op; the whole-sequence graph attends under the equivalent mask (causal, the last
``window`` keys and the first ``sinks``), and the KV-cache runtime keeps the layer's K/V in
a ring, so memory stays bounded and generation may run past the model's context length
(models with rotary positions; learned position tables end there).

Positions (``positions="cache"``, the default) follow StreamingLLM: keys stay rotated at
their true positions, and a query scores the sinks as if they sat just before its window,
so no query-key distance exceeds ``sinks + window - 1`` however long the sequence gets (the
attention op takes the model's RoPE frequencies for it, ``rotary=``). ``positions=
"original"`` keeps the true distances to the sinks (they grow without bound).

A layer that already has a sliding window (Mistral) keeps the smaller of the two windows.
A model that mixes local (sliding-window) and global layers (Gemma 3) gets sinks and a
window on its global layers only: its local layers already keep a window-sized ring of
the model's own, and naming one in ``layers`` is refused (``whole_cache.local_layers``).
``sinks + window`` may not pass the model's context length: the runtime sizes the ring and
its sink layout by them, and no sequence the model was made for needs more. The pass checks
it when it runs (``__init__`` does not know the model); the verifier, after every pass and
when an artifact is loaded, checks every attention op's (``rewriter.ops.check_context``).
Speculative strategies (``SelfSpeculative``, draft heads) roll rejected tokens back by
length, which a ring that overwrote the oldest keys cannot do: the combination is refused.
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ops import OPS, op_arguments
from rewriter.ir.pass_manager import Pass
from rewriter.passes.whole_cache import local_layers
from rewriter.values import MAX_INT, context_length, is_int, within_context


class StreamingAttention(Pass):
    def __init__(self, sinks: int = 4, window: int = 1020, layers: Optional[Sequence[int]] = None,
                 positions: str = "cache"):
        if not is_int(sinks) or not 0 <= sinks <= MAX_INT:
            raise ValueError(f"StreamingAttention: sinks must be an integer >= 0, got {sinks!r}")
        if not is_int(window) or not 1 <= window <= MAX_INT:
            raise ValueError(f"StreamingAttention: window must be an integer >= 1, got {window!r}")
        if layers is not None and (isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple))
                                   or not all(is_int(i) and i >= 0 for i in layers) or not layers):
            raise ValueError(f"StreamingAttention: layers must be a non-empty list of layer "
                             f"indices, got {layers!r}")
        if positions not in ("cache", "original"):
            raise ValueError(f"StreamingAttention: positions must be 'cache' (StreamingLLM: the "
                             f"sinks sit just before the window) or 'original', got {positions!r}")
        self.sinks, self.window, self.positions = int(sinks), int(window), positions
        self.layers = sorted(set(int(i) for i in layers)) if layers is not None else None

    def run(self, ir: IR) -> IR:
        nodes = ring_attention_nodes(self, ir)
        by_layer = {op_arguments("attention", tuple(n.args), dict(n.kwargs))["layer"]: n for n in nodes}
        local = local_layers(nodes)
        chosen = self.layers if self.layers is not None else sorted(set(by_layer) - local)
        missing = [i for i in chosen if i not in by_layer]
        if missing:
            raise PassError(f"{self!r}: no attention names cache {missing[0]}; the IR has "
                            f"{sorted(by_layer)}")
        self._check_global(by_layer, local, chosen)
        # the ring's slots and its sink layout are sized by these (runtime.ring_cache)
        within_context(self.name, context_length(ir.info.get("config", {})), sinks=self.sinks,
                       window=self.window)
        for i in chosen:
            n = by_layer[i]
            args = op_arguments("attention", tuple(n.args), dict(n.kwargs))
            if args["sinks"] is not None:
                raise PassError(f"{self!r}: {n.name} keeps sinks already (sinks={args['sinks']})")
            native = args["window"]
            window = self.window if native is None else min(native, self.window)
            n.args = tuple(n.args[:3])  # q, k, v; every attribute by name from here
            kept = {k: v for k, v in args.items()  # None (every optional's default) unsaid
                    if k not in ("q", "k", "v") and v is not None}
            n.kwargs = {**kept, "window": window, "sinks": self.sinks}
            freq = rotary_frequencies(n, args) if self.positions == "cache" else None
            if freq is not None:
                n.kwargs = {**n.kwargs, "rotary": freq}
            n.meta.pop("val", None)
        return ir


    def _check_global(self, by_layer: dict, local: set, chosen: list) -> None:
        """``PassError`` for a local layer of a local/global pattern named in ``layers``."""
        named = sorted(local.intersection(chosen))
        if named:
            n = by_layer[named[0]]
            window = op_arguments("attention", tuple(n.args), dict(n.kwargs))["window"]
            raise PassError(f"{self!r}: layer {named[0]} is a local layer of the model's "
                            f"local/global pattern (a sliding window of its own, {window} "
                            f"tokens, already kept in a ring): sinks and a window go on the "
                            f"global layers {sorted(set(by_layer) - local)} only")


def ring_attention_nodes(p: Pass, ir: IR) -> list:
    """The attention ops a pass that gives layers a ring (StreamingAttention, DuoAttention)
    may rewrite; ``PassError`` when the IR has none, or holds what a ring cannot serve: a
    speculative strategy (it rolls back by length) or a token selection (it reads whole
    caches)."""
    if ir.info.get("decoding") is not None:
        raise PassError(f"{p!r} cannot follow a speculative strategy "
                        f"({ir.info['decoding']['strategy']}): rejected drafts are rolled "
                        f"back by length, and a ring cache has overwritten what they replaced")
    if any(ir.graph.find_nodes(op="call_function", target=OPS[op])
           for op in ("select_tokens", "select_pages")):
        raise PassError(f"{p!r} cannot follow TidalDecode or Quest: their selection "
                        f"reads whole caches, and a ring drops what it would name")
    nodes = list(ir.graph.find_nodes(op="call_function", target=OPS["attention"]))
    if not nodes:
        raise PassError(f"{p!r}: the IR has no rw.attention op to rewrite")
    return nodes


def rotary_frequencies(attn, args: dict):
    """The ``inv_freq`` node of the ``rw.rotary`` whose tables rotate this attention's q
    (through ``rw.rope``, or the op's own ``cos`` under ``FuseRoPE``); None without RoPE."""
    cos = args["cos"]
    if cos is None:
        q = args["q"]
        if not (q.op == "call_function" and q.target is OPS["rope"]):
            return None
        cos = q.args[1]
    table = cos.args[0] if cos.op == "call_function" and cos.target is operator.getitem else None
    if table is None or table.target is not OPS["rotary"]:
        return None
    return table.args[1]
