"""DuoAttention: full attention only in the KV heads that retrieve, a sink + window cache in
the others.

``DuoAttention(gates=PATH)`` reads one calibrated gate per layer and KV head
(``rewriter train-gates`` makes them: ``rewriter.training.train_gates``). A head whose gate is at
least ``threshold`` keeps a full cache; with ``sparsity=`` instead, that fraction of the
model's KV heads, those with the lowest gates, become streaming heads. They keep the gates
file's ``sinks`` and ``window`` (or the ones given here) in a ring, as
``StreamingAttention`` does, with the sink positions the gates were calibrated with
(``positions``: StreamingLLM's, ``"cache"``, by default).

Their ``sinks + window`` may not pass the model's context length (a gates file's as well as
those given here), as with ``StreamingAttention``.

In the IR every attention op shows its ``gates``; a layer whose heads all stream gets
``sinks`` and ``window`` (a whole ring), a layer with both kinds ``full_heads=[...]`` too,
and the KV-cache runtime keeps that layer in two caches: the full heads' and the others'
ring (``runtime.duo_cache``). A layer whose heads are all full is left as it was.
A layer reading another's cache (``ShareKV``) has no cache of its own to split: it takes
its owner's split, and ``sparsity`` counts the heads of the owners alone.

Speculative strategies roll rejected tokens back by length, which a ring cannot do, and
TidalDecode selects from whole caches: both are refused beside it, as with
``StreamingAttention``.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Union

from rewriter.drafts import duo_gates
from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.sharing import sources
from rewriter.ops import OPS, op_arguments
from rewriter.ir.pass_manager import Pass
from rewriter.passes.streaming import ring_attention_nodes, rotary_frequencies
from rewriter.values import MAX_INT, context_length, is_int, within_context


class DuoAttention(Pass):
    def __init__(self, gates: Union[str, os.PathLike, list] = "default", threshold: float = 0.5,
                 sparsity: Optional[float] = None, sinks: Optional[int] = None,
                 window: Optional[int] = None, positions: Optional[str] = None):
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
        if positions is not None and positions not in ("cache", "original"):
            raise ValueError(f"DuoAttention: positions must be 'cache' (StreamingLLM's sinks, "
                             f"as calibrated by default) or 'original', got {positions!r}")
        self.positions = positions or table.positions
        self.model = table.model  # the calibrated model's shape, when a file says it

    def full_heads(self, layers: Optional[list[int]] = None) -> list[list[int]]:
        """Per layer of the gates, the KV heads that keep a full cache: those whose gate is at
        least ``threshold``, or with ``sparsity`` all but that fraction of the heads of
        ``layers`` (default: every layer of the gates) with the lowest gates."""
        layers = range(len(self.table)) if layers is None else layers
        flat = sorted((self.table[i][h], i, h) for i in layers for h in range(len(self.table[i])))
        if self.sparsity is None:
            streaming = {(i, h) for g, i, h in flat if g < self.threshold}
        else:
            streaming = {(i, h) for _, i, h in flat[:round(self.sparsity * len(flat))]}
        return [[h for h in range(len(row)) if (i, h) not in streaming]
                for i, row in enumerate(self.table)]

    def run(self, ir: IR) -> IR:
        nodes = ring_attention_nodes(self, ir)
        self._check_model(ir)
        # the streaming heads' ring is sized by these (a gates file's or the ones given)
        who = self.name if isinstance(self.gates, list) else f"{self.name} (gates {self.gates})"
        within_context(who, context_length(ir.info.get("config", {})), sinks=self.sinks,
                       window=self.window)
        for n in nodes:
            self._check_fits(n, op_arguments("attention", tuple(n.args), dict(n.kwargs)))
        full = self._follow_owners(ir, nodes)
        for n in nodes:
            args = op_arguments("attention", tuple(n.args), dict(n.kwargs))
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
                freq = rotary_frequencies(n, args) if self.positions == "cache" else None
                if freq is not None:
                    n.kwargs = {**n.kwargs, "rotary": freq}
            n.meta.pop("val", None)
        return ir

    def _follow_owners(self, ir: IR, nodes: list) -> list[list[int]]:
        """``full_heads`` chosen among the layers that own their cache (a sparsity counts
        their heads), and each layer reading another's cache (``ShareKV``) split as its
        owner: they read one cache."""
        readers = sources(ir.graph)
        full = self.full_heads(sorted(layer for layer in (
            op_arguments("attention", tuple(n.args), dict(n.kwargs))["layer"] for n in nodes)
            if layer not in readers))
        for reader, owner in readers.items():
            full[reader] = full[owner]
        return full

    def _check_model(self, ir: IR) -> None:
        """The gates cover the model's layers (all of them, also after LayerSkip) and, when
        the file says which model they were calibrated for, its head size."""
        config = ir.info.get("config", {})
        layers = config.get("num_hidden_layers", config.get("n_layer"))
        if isinstance(layers, int) and len(self.table) != layers:
            raise PassError(f"{self!r}: the gates cover {len(self.table)} layers; the model "
                            f"has {layers}")
        node = next(iter(ir.graph.find_nodes(op="call_function", target=OPS["attention"])))
        head_dim = op_arguments("attention", tuple(node.args), dict(node.kwargs))["head_dim"]
        if self.model.get("head_dim", head_dim) != head_dim:
            raise PassError(f"{self!r}: the gates were calibrated for head_dim="
                            f"{self.model['head_dim']}; the model's is {head_dim}")

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
