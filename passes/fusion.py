"""What the fusion passes share: matching linears, concatenating their weights, and
making the fused nodes carry the metadata of the nodes they replace."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import fx

from rewriter.ir.core import IR
from rewriter.ir.pass_manager import Pass


class FusionPass(Pass):
    """A pass that rewrites every match in place: ``fuse(ir)`` returns how many groups it
    fused; then dead nodes and weights go and ``ir.info["fusions"]`` records the count."""

    def __init__(self):
        pass  # no parameters

    def fuse(self, ir: IR) -> int:
        raise NotImplementedError

    def run(self, ir: IR) -> IR:
        count = self.fuse(ir)
        ir.prune()
        record(ir, self.name, count)
        return ir


def concat_weight(ir: IR, nodes: Sequence[fx.Node], name: str) -> None:
    """Register the concatenation, along the output dim, of the weights read by ``nodes``
    (get_attr nodes) as the buffer ``name``."""
    ir.add_weight(name, torch.cat([ir.weight(n.target).detach() for n in nodes], dim=0))


def first_in_graph(ir: IR, nodes: Sequence[fx.Node]) -> fx.Node:
    """The node of ``nodes`` that comes first: fused nodes go before it, so every user of
    any of them comes after."""
    wanted = set(nodes)
    return next(n for n in ir.graph.nodes if n in wanted)


def sibling_name(weight_name: str, new_module: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.<new>.weight``."""
    parent, _, leaf = weight_name.rsplit(".", 2)
    return f"{parent}.{new_module}.{leaf}"


def record(ir: IR, pass_name: str, count: int) -> None:
    """Add ``count`` to how many groups ``pass_name`` fused, in ``ir.info["fusions"]``: a
    total over every run, so a second run (which finds nothing left) does not reset it
    to 0 and hide an earlier fusion from checks such as ``LayerSkip``'s."""
    fusions = ir.info.setdefault("fusions", {})
    fusions[pass_name] = fusions.get(pass_name, 0) + count
