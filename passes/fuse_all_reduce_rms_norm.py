"""``FuseAllReduceRMSNorm``: a sum over ranks, the residual add and the RMSNorm as one op.

    s = all_reduce(x); h = add(residual, s); n = rms_norm(h, w)     (either operand order)
    s = all_reduce(x); n, h = add_rms_norm(residual, s, w)          (``FuseAddRMSNorm``'s)
become
    n, h = all_reduce_add_rms_norm(x, residual, w, eps, world_size, two_shot_tokens)

so the ranks can run the three as one step: all-reduce then add + norm, or from
``two_shot_tokens`` tokens up reduce-scatter over tokens, add + norm of this rank's share,
all-gather (``runtime.collectives``; ``None``, the default, leaves the threshold to the
device: two-shot above 128 tokens on CUDA, never on CPUs). Exact: the op computes the same
sum, add and norm (``add_rms_norm`` is its reference); the forms differ only in which rank
adds which tokens.

It runs on an IR ``TensorParallel`` has split (an IR without sums over ranks is refused
by name; a split IR with no site, GPT-2's LayerNorm blocks, is left as it was, count 0),
before or after ``FuseAddRMSNorm``: the sites and the result are the same. Layers as
``FuseAddRMSNorm`` draws them: the fused op and ``h`` belong to the layer the add closes,
``n`` to the one whose norm it is. The final norm is left alone for the same reason: its
stream value dies, so the fused op would be the last layer's only way out and the layer
would lose its span: a model of ``L`` layers has ``2L - 1`` sites. Structural passes
(``LayerSkip``, ``SelfSpeculative``) run before this one: a fused op joins two layers.
"""
from __future__ import annotations

import operator

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.nodes import call, is_op, mark
from rewriter.ops import OPS, op_arguments
from rewriter.passes.fuse_add_rms_norm import _is_tensor_add
from rewriter.passes.fusion import FusionPass
from rewriter.values import MAX_INT


class FuseAllReduceRMSNorm(FusionPass):
    def __init__(self, two_shot_tokens: int | None = None):
        if two_shot_tokens is not None and (isinstance(two_shot_tokens, bool) or not isinstance(
                two_shot_tokens, int) or not 1 <= two_shot_tokens <= MAX_INT):
            raise ValueError(f"FuseAllReduceRMSNorm: two_shot_tokens must be None (the rule "
                             f"for the device) or an integer in [1, {MAX_INT}], "
                             f"got {two_shot_tokens!r}")
        self.two_shot_tokens = two_shot_tokens

    def fuse(self, ir: IR) -> int:
        if "tensor_parallel" not in ir.info:
            raise PassError(f"{self!r} fuses the sums over ranks that TensorParallel inserts: "
                            f"run TensorParallel(world_size=N) before it")
        count = 0
        for node in list(ir.graph.nodes):
            if is_op(node, "add_rms_norm"):
                count += self._absorb_sum(node)
            elif is_op(node, "rms_norm"):
                count += self._fuse_chain(ir, node)
        return count

    def _absorb_sum(self, node) -> int:
        """``add_rms_norm`` of a sum over ranks becomes the fused op in place: same
        outputs, same layer."""
        args = op_arguments("add_rms_norm", tuple(node.args), dict(node.kwargs))
        found = _sum_operand(args["x"], args["residual"])
        if found is None or args["unit_offset"]:  # Gemma's norm: no fused form (yet)
            return 0
        total, residual = found
        node.target = OPS["all_reduce_add_rms_norm"]
        node.args, node.kwargs = self._fused_args(total, residual, args), {}
        node.meta["pass"] = self.name
        return 1

    def _fuse_chain(self, ir: IR, norm) -> int:
        args = op_arguments("rms_norm", tuple(norm.args), dict(norm.kwargs))
        add = args["x"]
        final = "layer" in getattr(add, "meta", {}) and "layer" not in norm.meta
        if final or args["unit_offset"] or not _is_tensor_add(add):
            return 0
        found = _sum_operand(*add.args)
        if found is None:
            return 0
        with ir.graph.inserting_before(add):
            both = mark(call(ir, OPS["all_reduce_add_rms_norm"], self._fused_args(*found, args),
                             "all_reduce_add_rms_norm"), add, self.name)
            normed = _part(ir, both, 0, "normed", norm, self.name)
            total = _part(ir, both, 1, "residual", add, self.name)
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(total)
        return 1

    def _fused_args(self, total, residual, norm_args: dict) -> tuple:
        summed = op_arguments("all_reduce", tuple(total.args), dict(total.kwargs))
        return (summed["x"], residual, norm_args["weight"], norm_args["eps"],
                summed["world_size"], self.two_shot_tokens)


def _sum_operand(a, b):
    """``(the sum over ranks, the other operand)`` when one of ``a``, ``b`` is an
    ``rw.all_reduce`` read by nothing else (its value is gone once fused), else None."""
    for total, other in ((a, b), (b, a)):
        if is_op(total, "all_reduce") and len(total.users) == 1:
            return total, other
    return None


def _part(ir: IR, both, index: int, name: str, old, pass_name: str):
    """Output ``index`` of the fused op, standing for ``old``: its layer, role and fake
    value (the next site's add reads this before shapes are propagated again, and checks
    it is a tensor of the stream's shape)."""
    node = mark(call(ir, operator.getitem, (both, index), name), old, pass_name)
    if "val" in old.meta:
        node.meta["val"] = old.meta["val"]
    return node
