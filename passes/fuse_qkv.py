"""``FuseQKV``: the q, k and v projections of an attention as one GEMM.

    q = linear(x, Wq, bq); k = linear(x, Wk, bk); v = linear(x, Wv, bv)
becomes
    qkv = linear(x, [Wq; Wk; Wv], [bq; bk; bv])                # [B, S, (Hq + 2 Hkv) D]
    q, k, v = split_with_sizes(qkv, [Hq D, Hkv D, Hkv D], -1)  # views, no copy

One read of ``x`` and one launch instead of three. A QK-norm (``rw.head_rms_norm``) between a
projection and its rope stays where it is, reading its part of the split. Lossless up to float rounding of the
GEMM. The fused weights are new buffers ``<attn>.qkv_proj.weight``; the old ones go.
"""
from __future__ import annotations

import operator

import torch

from rewriter.ir.core import IR
from rewriter.ir.nodes import call, is_op, linear_parts, mark
from rewriter.passes.fusion import FusionPass, concat_weight, first_in_graph, sibling_name


class FuseQKV(FusionPass):
    def fuse(self, ir: IR) -> int:
        count = 0
        for attn in list(ir.graph.find_nodes(op="call_function", target=torch.ops.rw.attention.default)):
            projections = [_projection(a) for a in attn.args[:3]]
            if any(p is None for p in projections) or len(set(projections)) != 3:
                continue
            inputs = {linear_parts(p)[0] for p in projections}
            if len(inputs) != 1:
                continue
            count += _fuse(ir, projections, inputs.pop(), self.name)
        return count


def _projection(node):
    """The ``rw.linear`` feeding an attention input, through an optional ``rw.rope`` and
    an optional per-head norm before it (Qwen3's and Gemma 3's QK-norm, which then reads
    its part of the fused projection)."""
    if is_op(node, "rope"):
        node = node.args[0]
    if is_op(node, "head_rms_norm") and len(node.users) == 1:
        node = node.args[0]
    return node if is_op(node, "linear") and len(node.users) == 1 else None


def _fuse(ir: IR, projections, x, pass_name: str) -> bool:
    q = projections[0]
    weights = [linear_parts(p)[1] for p in projections]
    biases = [linear_parts(p)[2] for p in projections]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return False  # a bias on some projections only: leave them alone
    sizes = [ir.weight(w.target).shape[0] for w in weights]
    w_name = sibling_name(weights[0].target, "qkv_proj")
    concat_weight(ir, weights, w_name)
    b_name = sibling_name(biases[0].target, "qkv_proj") if biases[0] is not None else None
    if b_name is not None:
        concat_weight(ir, biases, b_name)
    g = ir.graph
    with g.inserting_before(first_in_graph(ir, projections)):
        w = g.get_attr(w_name)
        b = g.get_attr(b_name) if b_name is not None else None
        qkv = mark(call(ir, torch.ops.rw.linear.default, (x, w, b), "qkv"), q, pass_name)
        parts = mark(call(ir, torch.ops.aten.split_with_sizes.default, (qkv, sizes, -1), "qkv_split"),
                     q, pass_name)
        for i, (old, short) in enumerate(zip(projections, "qkv")):
            new = mark(call(ir, operator.getitem, (parts, i), short), old, pass_name)
            old.replace_all_uses_with(new)
    return True
