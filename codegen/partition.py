"""Fusion groups for generated kernels: maximal groups of pointwise ops on the IR graph,
each optionally ending in one row reduction.

A node is pointwise when it is one of ``POINTWISE`` (elementwise ATen ops and the ``rw``
activations that no template covers) and its output has the shape every tensor input
broadcasts to. A row reduction (``REDUCTIONS``: sum, mean or amax over the last dim, of a
float tensor whose last dim is a constant) may end a group: nothing joins after it. Groups grow along producer -> consumer edges (networkx), and a merge is
kept only if the graph with every group contracted to one node stays acyclic, so a fused
kernel never needs a value that is computed from its own output.
"""
from __future__ import annotations

import networkx as nx
import torch
from torch import fx

from rewriter.ops import OPS

aten = torch.ops.aten
# target -> the op's name in ``codegen.pointwise.EXPRESSIONS``
POINTWISE = {
    aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul",
    aten.div.Tensor: "div", aten.neg.default: "neg", aten.exp.default: "exp",
    aten.sigmoid.default: "sigmoid", aten.rsqrt.default: "rsqrt", aten.relu.default: "relu",
    aten.tanh.default: "tanh",
    OPS["silu"]: "silu", OPS["gelu"]: "gelu",
}


REDUCTIONS = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "amax"}


def is_row_reduction(node: fx.Node) -> bool:
    """sum / mean / amax over the last dimension only (no dtype change), constant width."""
    if node.op != "call_function" or node.target not in REDUCTIONS:
        return False
    x, dims = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point or v.dim() == 0:
        return False
    if node.kwargs.get("dtype") is not None or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    return dims[0] in (-1, v.dim() - 1) and isinstance(v.shape[-1], int)


def is_pointwise(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in POINTWISE:
        return False
    if node.target is aten.add.Tensor or node.target is aten.sub.Tensor:
        if node.kwargs.get("alpha", 1) != 1:
            return False
    if node.target is OPS["gelu"] and len(node.args) > 1 and node.args[1] not in ("none", "tanh"):
        return False
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point:
        return False
    for a in node.all_input_nodes:  # every tensor input broadcasts to the output's shape
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dim() > out.dim():
            return False
        if any(not (s == 1 or s == o) for s, o in zip(reversed(v.shape), reversed(out.shape))):
            return False
    return True


def pointwise_groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Groups of pointwise nodes (each in graph order), largest first merges by edge."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((a, n) for n in nodes for a in n.all_input_nodes)
    group_of = {n: frozenset([n]) for n in nodes if is_pointwise(n) or is_row_reduction(n)}
    closed = {n for n in group_of if is_row_reduction(n)}  # groups that end in a reduction
    for n in nodes:  # topological: merge each node into its producers' groups
        if n not in group_of:
            continue
        for a in n.all_input_nodes:
            if a not in group_of or group_of[a] is group_of[n] or group_of[a] & closed:
                continue
            if is_row_reduction(n):
                ok = a is n.args[0] and not group_of[n] - {n}  # the reduction joins its input
            else:
                ok = not group_of[n] & closed and _same_shape(a, n)
            merged = group_of[a] | group_of[n]
            if ok and _acyclic_with(dag, merged):
                for m in merged:
                    group_of[m] = merged
    groups = {g for g in group_of.values()}
    return sorted((sorted(g, key=order.get) for g in groups), key=lambda g: order[g[0]])


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    return a.meta["val"].shape == b.meta["val"].shape


def _acyclic_with(dag: nx.DiGraph, merged: frozenset) -> bool:
    """No path leaves ``merged`` and comes back into it through a node outside it."""
    outside = {s for m in merged for s in dag.successors(m) if s not in merged}
    reachable = set().union(*(nx.descendants(dag, s) for s in outside)) if outside else set()
    return not (reachable & merged)


def schedule(gm: fx.GraphModule, groups: list[list[fx.Node]]) -> list:
    """Graph order with every group as one item (its node list): a topological order of the
    graph with groups contracted, as close to the original order as dependencies allow."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    unit = {n: n for n in nodes}
    for g in groups:
        item = tuple(g)
        for n in g:
            unit[n] = item
    quotient = nx.DiGraph()
    quotient.add_nodes_from(set(unit.values()))
    quotient.add_edges_from((unit[a], unit[n]) for n in nodes for a in n.all_input_nodes
                            if unit[a] is not unit[n])
    first = lambda u: order[u[0]] if isinstance(u, tuple) else order[u]  # noqa: E731
    return [list(u) if isinstance(u, tuple) else u
            for u in nx.lexicographical_topological_sort(quotient, key=first)]
