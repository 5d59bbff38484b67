"""``FuseAddRMSNorm``: a residual add and the RMSNorm that reads it, as one op.

    h = add(x, residual); n = rms_norm(h, w)
becomes
    n, h = add_rms_norm(x, residual, w)   # h still feeds the rest of the residual stream

A kernel then reads the stream once and writes both outputs. Exact: the op computes the
same add and the same norm.

Most of these pairs straddle a layer border (layer i's last add, layer i+1's input norm).
The fused op and ``h`` belong to layer i (``h`` is the stream leaving it) and ``n`` to
layer i+1, so layer spans stay one value in, one value out. The final norm is left alone:
its stream value would die and leave the last layer without an output. Run structural
passes (``LayerSkip``) before this one: ``LayerSkip`` refuses an IR that has it.
"""
from __future__ import annotations

import operator

import torch

from rewriter.ir.core import IR
from rewriter.ops import op_arguments
from rewriter.ir.nodes import call, mark
from rewriter.passes.fusion import FusionPass


class FuseAddRMSNorm(FusionPass):
    def fuse(self, ir: IR) -> int:
        count = 0
        for norm in list(ir.graph.find_nodes(op="call_function", target=torch.ops.rw.rms_norm.default)):
            add = norm.args[0]
            final = "layer" in add.meta and "layer" not in norm.meta
            if _is_tensor_add(add) and not final:
                _fuse(ir, add, norm, self.name)
                count += 1
        return count


def _is_tensor_add(node) -> bool:
    """``aten.add(a, b)`` of two tensors of the same shape and dtype (no broadcast)."""
    if not (getattr(node, "op", None) == "call_function" and node.target is torch.ops.aten.add.Tensor):
        return False
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return False
    a, b = (_val(x) for x in node.args)
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.shape == b.shape and a.dtype == b.dtype)


def _val(node):
    """The fake value of ``node``; a residual this pass just made has none yet, and is
    shaped like the stream its fused op read."""
    if not isinstance(node, torch.fx.Node):
        return None
    if "val" in node.meta:
        return node.meta["val"]
    if node.target is operator.getitem and node.args[0].target is torch.ops.rw.add_rms_norm.default:
        return _val(node.args[0].args[0])
    return None


def _fuse(ir: IR, add, norm, pass_name: str) -> None:
    x, residual = add.args
    args = op_arguments("rms_norm", tuple(norm.args), dict(norm.kwargs))
    fused = (x, residual, args["weight"], args["eps"]) + ((True,) if args["unit_offset"] else ())
    g = ir.graph
    with g.inserting_before(add):
        both = mark(call(ir, torch.ops.rw.add_rms_norm.default, fused, "add_rms_norm"), add,
                    pass_name)
        normed = mark(call(ir, operator.getitem, (both, 0), "normed"), norm, pass_name)
        total = mark(call(ir, operator.getitem, (both, 1), "residual"), add, pass_name)
    norm.replace_all_uses_with(normed)
    add.replace_all_uses_with(total)
