"""The IR's whole-sequence graph as a program autograd runs through, and the distillation
loss of ``rewriter train-share``.

The ``rw.*`` ops are ``torch.library`` custom ops without a backward; the program calls
their plain reference functions (``rewriter.ops.REFERENCE``) instead, which are torch code
and differentiable, so a loss on its logits reaches the IR's weights that require grad.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from rewriter.ops import OPS, REFERENCE

_SHORT = {op: name for name, op in OPS.items()}


def program(ir) -> fx.GraphModule:
    """The IR's graph on plain functions, returning the logits ``[B, S, V]``; its weights
    are the IR's own tensors (one that requires grad receives gradients)."""
    graph, env = fx.Graph(), {}
    for node in ir.graph.nodes:
        if node.op == "output":
            value = node.args[0]
            logits = value[0] if isinstance(value, (tuple, list)) else value  # (logits, draft)
            graph.output(env[logits])
            continue
        new = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_function" and node.target in _SHORT:
            new.target = REFERENCE[_SHORT[node.target]]
        env[node] = new
    graph.eliminate_dead_code()
    return fx.GraphModule(ir.gm, graph)


def inputs(ir, ids: Tensor) -> tuple:
    """The graph's inputs for token ids ``[B, S]``: the ids, and positions where asked."""
    names = [n.name for n in ir.graph.find_nodes(op="placeholder")]
    positions = torch.arange(ids.shape[1], device=ids.device)[None].expand(ids.shape[0], -1)
    return tuple(positions if "position" in n else ids for n in names)


def distill_loss(student: Tensor, teacher: Tensor) -> Tensor:
    """Mean over tokens of KL(teacher || student) between next-token distributions, from
    logits ``[B, S, V]`` (in float32: the model may be in a narrower type)."""
    log_t = F.log_softmax(teacher.float(), dim=-1)
    log_s = F.log_softmax(student.float(), dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()
