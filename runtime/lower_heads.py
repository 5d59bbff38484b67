"""Lowering the draft heads alone: the nodes between an IR's LM-head input and its draft
logits (the graph's second output) become a program of their own, which speculative rounds
call on the hidden states of the tokens they verified (``runtime.decoding``)."""
from __future__ import annotations

import torch
from torch import fx

from rewriter.errors import RewriterError
from rewriter.ir.core import IR

from .lower import SHORT, kernel_table, logits_node, program_on_weights


def lower_heads(ir: IR, backend: str = "torch", transposed: dict | None = None,
                head: int | None = None) -> fx.GraphModule:
    """The draft heads alone: ``(h [B, S, H]) -> draft logits [B, S, K, V]``, the nodes
    between the LM head's input and the graph's second output. Hydra's heads (``head=k``):
    ``(h [B, N, H], path [B, N, K]) -> head k's logits [B, N, V]``, the path's tokens in
    place of the graph's ``rw.next_tokens`` (only its first ``k + 1`` columns are read)."""
    table = kernel_table(backend)[0]
    (out,) = ir.graph.find_nodes(op="output")
    value = out.args[0]
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise RewriterError("this IR has no draft heads (its graph returns the logits only)")
    h, target = logits_node(ir).args[0], value[1]
    if head is not None:  # draft = cat([unsqueeze(logits_0, -2), ..], -2)
        rows = target.args[0] if _is(target, torch.ops.aten.cat.default) else None
        if rows is None or not 0 <= head < len(rows) or not _is(rows[head], torch.ops.aten.unsqueeze.default):
            raise RewriterError("Hydra's draft logits must be a cat of one row per head")
        target = rows[head].args[0]
    paths = [n for n in ir.graph.nodes if n.op == "call_function" and SHORT.get(n.target) == "next_tokens"]
    need, todo = set(), [target]
    while todo:  # the heads' nodes: from the draft logits back to h (and the path)
        n = todo.pop()
        if n in need or n is h or n in paths:
            continue
        need.add(n)
        todo += n.all_input_nodes
    if any(n.op == "placeholder" for n in need):
        raise RewriterError("the draft heads read more than the LM head's input (and Hydra's path)")
    graph = fx.Graph()
    env = {h: graph.placeholder("h")}
    used = [p for p in paths if any(p in n.all_input_nodes for n in need)]
    if len(used) > 1 or (used and head is None):
        raise RewriterError("draft heads read one path (rw.next_tokens), with a program per head")
    if head is not None:
        if not used:
            raise RewriterError("Hydra's heads read the path's tokens (rw.next_tokens)")
        env[used[0]] = graph.placeholder("path")
    for node in ir.graph.nodes:
        if node in need:
            new = graph.node_copy(node, lambda n: env[n])
            name = SHORT.get(node.target) if node.op == "call_function" else None
            if name is not None:
                new.target = table[name]
            env[node] = new
    graph.output(env[target])
    extra = transposed if transposed is not None else {}
    _fold_constants(ir, graph, extra)
    return program_on_weights(ir, graph, table, backend, transposed, extra)


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _fold_constants(ir: IR, graph: fx.Graph, extra: dict) -> None:
    """Compute once, here, every ATen node that reads weights only (a draft vocabulary's
    rows of the LM head): the program then reads the result as a weight."""
    for node in list(graph.nodes):
        if (node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload)
                or node.target.namespace != "aten" or not node.all_input_nodes
                or any(a.op != "get_attr" for a in node.all_input_nodes)):
            continue
        name = f"{node.name}.__folded"
        if name not in extra:
            value = lambda a: (extra[a.target] if a.target in extra else ir.weight(a.target)) \
                if isinstance(a, fx.Node) else a  # noqa: E731
            try:
                extra[name] = node.target(*fx.node.map_aggregate(node.args, value)).detach()
            except (IndexError, RuntimeError, TypeError, ValueError) as e:  # an edited artifact
                raise RewriterError(f"{node.name} ({node.target}) fails on its weights: {e}") from None
        with graph.inserting_before(node):
            node.replace_all_uses_with(graph.get_attr(name))
        graph.erase_node(node)
