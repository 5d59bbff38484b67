"""The IR: an executable ``fx.GraphModule`` plus what the frontend learnt about the model.

``info`` is plain JSON-able data: the model family and config, the graph's input specs,
the layer spans (``[{"index", "input", "output"}]``, node names) and the lift report.
Passes edit ``gm`` in place and keep ``info`` true; ``refresh()`` re-derives shapes and
layer spans from the graph after each pass.
"""
from __future__ import annotations

from functools import reduce

import torch
from torch import fx, nn

from rewriter.ir.layers import layer_spans
from rewriter.ir.printer import format_graph
from rewriter.ir.shapes import propagate_shapes


class IR:
    def __init__(self, gm: fx.GraphModule, info: dict):
        self.gm = gm
        self.info = info
        self.version = 0  # bumped by refresh(): programs lowered from older versions are stale

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @property
    def layers(self) -> list[dict]:
        return self.info.get("layers", [])

    @property
    def is_causal_lm(self) -> bool:
        return bool(self.info.get("causal_lm"))

    def node(self, name: str) -> fx.Node:
        for n in self.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def ops(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "call_function"]

    def weights(self) -> dict[str, torch.Tensor]:
        return {n.target: self.weight(n.target) for n in self.graph.find_nodes(op="get_attr")}

    def weight(self, name: str) -> torch.Tensor:
        return reduce(getattr, name.split("."), self.gm)

    def num_params(self) -> int:
        return sum(t.numel() for t in {id(t): t for t in self.weights().values()}.values())

    def add_weight(self, name: str, value: torch.Tensor) -> None:
        add_weight(self.gm, name, value)

    def prune(self) -> None:
        """Drop dead nodes, then every weight no node reads any more."""
        self.graph.eliminate_dead_code()
        used = {n.target for n in self.graph.find_nodes(op="get_attr")}
        for name, _ in list(self.gm.named_parameters()) + list(self.gm.named_buffers()):
            if name not in used:
                *path, leaf = name.split(".")
                owner = reduce(getattr, path, self.gm)
                delattr(owner, leaf)
        self.gm.delete_all_unused_submodules()
        self.gm.recompile()

    def refresh(self) -> None:
        """Re-derive shapes and layer spans after the graph changed."""
        self.version += 1
        self.gm.recompile()
        propagate_shapes(self.gm, self.info["inputs"])
        self.info["layers"] = layer_spans(self.gm)

    def op_counts(self) -> dict[str, int]:
        from rewriter.ops import short_name
        counts: dict[str, int] = {}
        for n in self.ops():
            key = short_name(n.target)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def summary(self) -> str:
        fam = self.info.get("family", "module")
        return (f"rewriter IR · {fam} · {len(self.layers)} layers · {len(self.ops())} ops · "
                f"{self.num_params() / 1e6:.2f}M params")

    def __str__(self) -> str:
        return format_graph(self.gm, title="# " + self.summary())

    __repr__ = __str__


def add_weight(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Register ``value`` as the buffer ``name`` (dotted), making submodules on the way."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if hasattr(mod, leaf):
        delattr(mod, leaf)
    mod.register_buffer(leaf, value)
