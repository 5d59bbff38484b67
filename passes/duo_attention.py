"""DuoAttention: full attention only in the KV heads that retrieve, a sink + window cache in
the others.

``DuoAttention(gates=PATH)`` reads one calibrated gate per layer and KV head
(``rewriter train-gates`` makes them: ``rewriter.train_gates``). A head whose gate is above
``threshold`` keeps a full cache; with ``sparsity=`` instead, that fraction of all KV heads,
those with the lowest gates, become streaming heads. The others keep the gates file's
``sinks`` and ``window`` (or the ones given here) in a ring, as ``StreamingAttention`` does,
with StreamingLLM's sink positions.

In the IR every attention op shows its ``gates``; a layer whose heads all stream gets
``sinks`` and ``window`` (a whole ring), a layer with both kinds ``full_heads=[...]`` too,
and the KV-cache runtime keeps that layer in two caches: the full heads' and the others'
ring (``runtime.duo_cache``). A layer whose heads are all full is left as it was.

Speculative strategies roll rejected tokens back by length, which a ring cannot do, and
TidalDecode selects from whole caches: both are refused beside it, as with
``StreamingAttention``.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Union

from rewriter import duo_gates
from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ops import MAX_INT, OPS, op_arguments
from rewriter.pass_manager import Pass
from rewriter.passes.streaming import rotary_frequencies
from rewriter.values import is_int


class DuoAttention(Pass):
    def __init__(self, gates: Union[str, os.PathLike, list] = "default", threshold: float = 0.5,
                 sparsity: Optional[float] = None, sinks: Optional[int] = None,
                 window: Optional[int] = None):
        if isinstance(gates, list):
            why = duo_gates.check_gates(gates)
            if why:
                raise ValueError(f"DuoAttention: {why}")
            if sinks is None or window is None:
                raise ValueError("DuoAttention: gates given as a list need sinks= and window= "
                                 "(a gates file records the ones it was calibrated with)")
            table = duo_gates.Gates(gates, sinks, window)
        elif isinstance(gates, (str, os.PathLike)):
            table = duo_gates.load(gates)  # GatesFileError (a ValueError) names the problem
        else:
            raise ValueError(f"DuoAttention: gates must be a gates file, a shipped name "
                             f"({', '.join(duo_gates.SHIPPED)}) or a [layers][kv_heads] list, "
                             f"got {gates!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not math.isfinite(threshold) or not 0 <= threshold <= 1:
            raise ValueError(f"DuoAttention: threshold must be a number in [0, 1], got {threshold!r}")
        if sparsity is not None and (isinstance(sparsity, bool) or not isinstance(sparsity, (int, float))
                                     or not math.isfinite(sparsity) or not 0 <= sparsity <= 1):
            raise ValueError(f"DuoAttention: sparsity must be None or a fraction in [0, 1], "
                             f"got {sparsity!r}")
        for name, v, low in (("sinks", sinks, 0), ("window", window, 1)):
            if v is not None and (not is_int(v) or not low <= v <= MAX_INT):
                raise ValueError(f"DuoAttention: {name} must be an integer >= {low}, got {v!r}")
        self.gates = gates if isinstance(gates, list) else os.fspath(gates)
        self.threshold, self.sparsity = float(threshold), sparsity
        self.sinks = int(sinks) if sinks is not None else table.sinks
        self.window = int(window) if window is not None else table.window
        self.table = table.gates

    def full_heads(self) -> list[list[int]]:
        """Per layer of the gates, the KV heads that keep a full cache."""
        flat = sorted((g, i, h) for i, row in enumerate(self.table) for h, g in enumerate(row))
        if self.sparsity is None:
            streaming = {(i, h) for g, i, h in flat if g <= self.threshold}
        else:
            streaming = {(i, h) for _, i, h in flat[:round(self.sparsity * len(flat))]}
        return [[h for h in range(len(row)) if (i, h) not in streaming]
                for i, row in enumerate(self.table)]

    def run(self, ir: IR) -> IR:
        if ir.info.get("decoding") is not None:
            raise PassError(f"{self!r} cannot follow a speculative strategy "
                            f"({ir.info['decoding']['strategy']}): rejected drafts are rolled "
                            f"back by length, and a ring cache has overwritten what they replaced")
        if any(ir.graph.find_nodes(op="call_function", target=OPS[op])
               for op in ("select_tokens", "select_pages")):
            raise PassError(f"{self!r} cannot follow TidalDecode or Quest: their selection "
                            f"reads whole caches, and a ring drops what it would name")
        nodes = list(ir.graph.find_nodes(op="call_function", target=OPS["attention"]))
        if not nodes:
            raise PassError(f"{self!r}: the IR has no rw.attention op to rewrite")
        full = self.full_heads()
        for n in nodes:
            args = op_arguments("attention", tuple(n.args), dict(n.kwargs))
            self._check_fits(n, args)
            layer = args["layer"]
            kept = {k: v for k, v in args.items()  # q, k, v stay positional; None unsaid
                    if k not in ("q", "k", "v") and v is not None}
            n.args = tuple(n.args[:3])  # q, k, v; every attribute by name from here
            n.kwargs = {**kept, "gates": [float(g) for g in self.table[layer]]}
            heads = full[layer]
            if len(heads) < args["num_kv_heads"]:  # some heads stream: a ring
                n.kwargs = {**n.kwargs, "window": self.window, "sinks": self.sinks}
                if heads:
                    n.kwargs = {**n.kwargs, "full_heads": heads}
                freq = rotary_frequencies(n, args)
                if freq is not None:
                    n.kwargs = {**n.kwargs, "rotary": freq}
            n.meta.pop("val", None)
        return ir

    def _check_fits(self, n, args: dict) -> None:
        layer, heads = args["layer"], args["num_kv_heads"]
        if layer >= len(self.table):
            raise PassError(f"{self!r}: {n.name} is layer {layer}; the gates cover "
                            f"{len(self.table)} layers")
        if len(self.table[layer]) != heads:
            raise PassError(f"{self!r}: {n.name} has {heads} KV heads; the gates give layer "
                            f"{layer} {len(self.table[layer])}")
        if args["sinks"] is not None or args["select"] is not None:
            raise PassError(f"{self!r}: {n.name} already limits what it sees (sinks="
                            f"{args['sinks']}); run DuoAttention instead of StreamingAttention")
        if args["window"] is not None:
            raise PassError(f"{self!r}: {n.name} has a sliding window ({args['window']}): its "
                            f"full heads would lose it; DuoAttention needs whole-context layers")
