"""What the fusion passes share: matching linears, concatenating their weights, and
making the fused nodes carry the metadata of the nodes they replace."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import fx

from rewriter.ir.core import IR
from rewriter.ops import OPS
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


def is_op(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is OPS[name]


def linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, Optional[fx.Node]]:
    """(input, weight get_attr, bias get_attr or None) of an ``rw.linear`` node."""
    x, w, *rest = node.args
    b = rest[0] if rest else node.kwargs.get("bias")
    return x, w, b


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


def mark(node: fx.Node, like: fx.Node, pass_name: str) -> fx.Node:
    """Copy layer and role from ``like``; record the pass that made ``node``."""
    for key in ("layer", "role"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta["pass"] = pass_name
    return node


def record(ir: IR, pass_name: str, count: int) -> None:
    """Add ``count`` to how many groups ``pass_name`` fused, in ``ir.info["fusions"]``: a
    total over every run, so a second run (which finds nothing left) does not reset it
    to 0 and hide an earlier fusion from checks such as ``LayerSkip``'s."""
    fusions = ir.info.setdefault("fusions", {})
    fusions[pass_name] = fusions.get(pass_name, 0) + count


def call(ir: IR, target, args: tuple, name: str) -> fx.Node:
    """A call_function node with a readable name (fx adds ``_1``, ``_2``... when taken)."""
    return ir.graph.create_node("call_function", target, args, name=name)
