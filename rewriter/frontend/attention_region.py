"""What an attention region computes besides attention, before the lifter replaces it.

``rw.attention`` takes the place of every op of an attention module's region, so the
lifter must know each one: layout ops (views, transposes, chunks), the SDPA call, RoPE's
arithmetic on q and k, and OPT's scaling of q (folded into the attention scale). Any other
arithmetic (an extra scale, a norm written inline) would be dropped in silence; such a
region is left as ATen instead, and the runtime refuses it.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from rewriter.frontend.regions import Region

aten = torch.ops.aten

# The arithmetic an attention region may hold besides layout ops and SDPA: RoPE's
# x * cos + rotate_half(x) * sin on q and k (rotate_half negates), and OPT's q scaling.
_ROPE_MATH = {aten.mul.Tensor: 4, aten.add.Tensor: 2, aten.neg.default: 2}
_LAYOUT = {aten.view.default, aten.reshape.default, aten.transpose.int, aten.contiguous.default,
           aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor,
           aten.cat.default, aten.unsqueeze.default, aten.expand.default, operator.getitem,
           aten.scaled_dot_product_attention.default}


def query_scaling(reg: Region, q: fx.Node) -> float | None:
    """``c`` when the region computes ``q * c`` (a constant) and uses q only so."""
    users = [u for u in q.users if u in reg.nodes]
    if len(users) == 1 and users[0].target == aten.mul.Tensor and users[0].args[0] is q \
            and isinstance(users[0].args[1], float):
        return users[0].args[1]
    return None


def unexpected_math(reg: Region, uses_rope: bool, q_scaled: bool,
                    qk_norms: set = frozenset()) -> str | None:
    """Why the region computes more than attention (a reason), or None: the lifter drops
    every op of the region, so any arithmetic it does not account for would be lost
    (``qk_norms``: the region's QK-norm nodes, which the lifter puts back per head)."""
    expected = {op: (n if uses_rope else 0) for op, n in _ROPE_MATH.items()}
    expected[aten.mul.Tensor] += int(q_scaled)
    found = {op: 0 for op in expected}
    for n in reg.nodes:
        if n in qk_norms:
            continue
        if n.target in found:
            found[n.target] += 1
        elif n.target not in _LAYOUT:
            return f"attention computes {n.name} ({n.target}), which rw.attention would drop"
    if found != expected:
        counts = ", ".join(f"{k.__name__}: {v}" for k, v in found.items())
        return f"attention region's arithmetic ({counts}) is not RoPE's"
    return None
