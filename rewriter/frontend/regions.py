"""Module scopes of a traced graph: which nodes came from which submodule.

``torch.export`` tags each node with ``nn_module_stack``; its innermost entry names the
module the node was computed in (``model.layers.3.self_attn``). A *region* is the set of
nodes under one scope; its inputs and outputs are the values crossing its border.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx


def scope_of(node: fx.Node, prefix: str) -> tuple[str, str]:
    """``(path, class name)`` of the innermost module of ``node``, ``prefix`` stripped."""
    cached = node.meta.get("_scope")
    if cached is not None and cached[0] == prefix:
        return cached[1]
    node.meta["_scope"] = (prefix, _scope_of(node, prefix))
    return node.meta["_scope"][1]


def _scope_of(node: fx.Node, prefix: str) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    cls_name = cls_name.rsplit(".", 1)[-1]
    if path.startswith(prefix):
        path = path[len(prefix):]
    elif path + "." == prefix:
        path = ""
    return path, cls_name


def scope_classes(node: fx.Node) -> list[str]:
    """Class names of every module enclosing ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for _, cls in stack.values():
        name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        out.append(name.rsplit(".", 1)[-1])
    return out


def in_scope(path: str, scope: str) -> bool:
    return path == scope or path.startswith(scope + ".")


@dataclass
class Region:
    scope: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]  # tensors from outside, weights and sizes excluded, first use first
    weights: list[fx.Node]  # get_attr nodes the region reads
    outputs: list[fx.Node]  # region values used outside, in graph order


def region(graph: fx.Graph, scope: str, prefix: str, exact: bool = False,
           also: tuple[str, ...] = ()) -> Region:
    """The nodes of ``scope`` (and of its children unless ``exact``; with ``also``, of
    those child scopes too) and their border."""
    def member(n: fx.Node) -> bool:
        if n.op != "call_function":
            return False
        path = scope_of(n, prefix)[0]
        return path == scope or path in also if exact else in_scope(path, scope)

    nodes = [n for n in graph.nodes if member(n)]
    inside = set(nodes)
    inputs: list[fx.Node] = []
    weights: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside:
                continue
            if _is_size(a):
                continue
            bucket = weights if a.op == "get_attr" else inputs
            if a not in bucket:
                bucket.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    return Region(scope, nodes, inputs, weights, outputs)


def erase_region(graph: fx.Graph, reg: Region) -> None:
    """Erase a region whose outputs no longer have users outside it."""
    for n in reversed(reg.nodes):
        if not n.users:
            graph.erase_node(n)


def data_ancestors(node: fx.Node) -> set[fx.Node]:
    """Nodes whose values flow into ``node``; reading only a size is not a data flow."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen and not _is_size(a):
                seen.add(a)
                todo.append(a)
    return seen


def _is_size(node: fx.Node) -> bool:
    """A symbolic size (``sym_size``): it says how big, not what, so it is no data input."""
    return isinstance(node.meta.get("val"), (int, torch.SymInt))
