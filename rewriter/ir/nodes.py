"""Small helpers for rewriting graph nodes: matching an op, reading a linear's parts, and
making a new node that carries the metadata of the one it replaces. Passes use them,
and so do the rewrites below the passes (``rewriter.ir.int4``)."""
from __future__ import annotations

from typing import Optional

from torch import fx

from rewriter.ir.core import IR
from rewriter.ops import OPS, op_arguments


# ``meta["role"]`` of the draft heads' nodes: Int4Weights leaves them dense
DRAFT_HEAD = "draft_head"


def is_op(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is OPS[name]


def linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, Optional[fx.Node]]:
    """(input, weight get_attr, bias get_attr or None) of an ``rw.linear`` node."""
    x, w, *rest = node.args
    b = rest[0] if rest else node.kwargs.get("bias")
    return x, w, b


def mark(node: fx.Node, like: fx.Node, pass_name: str) -> fx.Node:
    """Copy layer and role from ``like``; record the pass that made ``node``."""
    for key in ("layer", "role"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta["pass"] = pass_name
    return node


def call(ir: IR, target, args: tuple, name: str) -> fx.Node:
    """A call_function node with a readable name (fx adds ``_1``, ``_2``... when taken)."""
    return ir.graph.create_node("call_function", target, args, name=name)


def attention_args(node: fx.Node) -> dict:
    """An ``rw.attention`` node's arguments by name, defaults filled in."""
    return op_arguments("attention", tuple(node.args), dict(node.kwargs))
