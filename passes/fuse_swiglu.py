"""``FuseSwiGLU``: the gated MLP's gate and up projections as one GEMM, then one op.

    g = linear(x, Wg); u = linear(x, Wu); h = mul(silu(g), u)
becomes
    gu = linear(x, [Wg; Wu])      # [B, S, 2F]
    h = swiglu(gu)                # silu(gu[..., :F]) * gu[..., F:]   [B, S, F]

A GELU gate (GeGLU, Gemma's ``down(gelu_tanh(gate) * up)``) gets the one GEMM too; its
activation stays where it is, on the gate's half (``rw.swiglu`` is SiLU's, in its kernel):

    gu = linear(x, [Wg; Wu]); g, u = split_with_sizes(gu, [F, F], -1)   # views, no copy
    h = mul(gelu(g), u)

Lossless up to float rounding of the GEMM. The fused weight is ``<mlp>.gate_up_proj.weight``.
"""
from __future__ import annotations

import operator

import torch

from rewriter.ir.core import IR
from rewriter.ir.nodes import call, is_op, linear_parts, mark
from rewriter.passes.fusion import FusionPass, concat_weight, first_in_graph, sibling_name


class FuseSwiGLU(FusionPass):
    def fuse(self, ir: IR) -> int:
        count = 0
        for mul in list(ir.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)):
            match = _match(mul)
            if match is not None:
                _fuse(ir, mul, *match, self.name)
                count += 1
        return count


def _match(mul):
    """(activation node, gate linear, up linear) when ``mul`` is silu(gate) * up or
    gelu(gate) * up, else None."""
    for a, b in (mul.args, mul.args[::-1]):
        if (is_op(a, "silu") or is_op(a, "gelu")) and is_op(a.args[0], "linear") \
                and is_op(b, "linear"):
            gate, up = a.args[0], b
            if (len(a.users) == 1 and len(gate.users) == 1 and len(up.users) == 1
                    and linear_parts(gate)[0] is linear_parts(up)[0]
                    and linear_parts(gate)[2] is None and linear_parts(up)[2] is None):
                return a, gate, up
    return None


def _fuse(ir: IR, mul, act, gate, up, pass_name: str) -> None:
    x, w_gate, _ = linear_parts(gate)
    w_up = linear_parts(up)[1]
    name = sibling_name(w_gate.target, "gate_up_proj")
    concat_weight(ir, [w_gate, w_up], name)
    g = ir.graph
    with g.inserting_before(first_in_graph(ir, [gate, up])):
        w = g.get_attr(name)
        gu = mark(call(ir, torch.ops.rw.linear.default, (x, w, None), "gate_up"), gate, pass_name)
    if is_op(act, "gelu"):
        _split_halves(ir, gu, gate, up, pass_name)
        return
    with g.inserting_before(mul):
        h = mark(call(ir, torch.ops.rw.swiglu.default, (gu,), "swiglu"), mul, pass_name)
    mul.replace_all_uses_with(h)


def _split_halves(ir: IR, gu, gate, up, pass_name: str) -> None:
    """The gate and up halves of ``gu`` ``[B, S, 2F]`` as views standing for the two
    projections: a GELU gate reads its half as it read its projection."""
    width = ir.weight(linear_parts(gate)[1].target).shape[0]  # F
    with ir.graph.inserting_after(gu):
        parts = mark(call(ir, torch.ops.aten.split_with_sizes.default, (gu, [width, width], -1),
                          "gate_up_split"), gate, pass_name)
    with ir.graph.inserting_after(parts):
        halves = [mark(call(ir, operator.getitem, (parts, i), short), old, pass_name)
                  for i, (old, short) in enumerate(((gate, "gate"), (up, "up")))]
    gate.replace_all_uses_with(halves[0])
    up.replace_all_uses_with(halves[1])
