"""``FuseRoPE``: the rotary embedding of q and k moves into the attention op.

    q = rope(q_raw, cos, sin); k = rope(k_raw, cos, sin); attention(q, k, v, ...)
becomes
    attention(q_raw, k_raw, v, ..., cos=cos, sin=sin)

so a backend rotates K in the kernel that writes it into the KV cache (and q on its way
in), instead of writing rotated K to memory and reading it back. Exact: the op applies
the same ``rope`` first.
"""
from __future__ import annotations

import torch

from rewriter.ir.core import IR
from rewriter.ops import op_arguments
from rewriter.ir.nodes import is_op
from rewriter.passes.fusion import FusionPass


class FuseRoPE(FusionPass):
    def fuse(self, ir: IR) -> int:
        count = 0
        for attn in list(ir.graph.find_nodes(op="call_function", target=torch.ops.rw.attention.default)):
            q, k = attn.args[0], attn.args[1]
            if not (is_op(q, "rope") and is_op(k, "rope")) or attn.kwargs.get("cos") is not None:
                continue
            if q.args[1:] != k.args[1:] or len(q.users) != 1 or len(k.users) != 1:
                continue  # different tables or head sizes, or the rotated value is used elsewhere
            cos, sin, head_dim = q.args[1:4]
            if head_dim != _head_dim(attn):
                continue
            attn.args = (q.args[0], k.args[0], *attn.args[2:])
            attn.kwargs = {**attn.kwargs, "cos": cos, "sin": sin}
            attn.meta.pop("val", None)  # it computes something else from other inputs now
            attn.meta["pass"] = self.name
            count += 1
        return count


def _head_dim(attn) -> int:
    return op_arguments("attention", tuple(attn.args), dict(attn.kwargs))["head_dim"]
