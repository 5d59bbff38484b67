"""Linears rewritten to 4-bit weights (``rw.linear_int4``, the layout of ``rewriter.maths.int4``):
what the ``Int4Weights`` pass does to a model, and the self-speculative strategy to its
draft (``runtime.decoding.self_spec``), written once below both.

    y = linear(x, W, b)    ->    y = linear_int4(x, codes, scales, mins, b, group_size=g)
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.nodes import DRAFT_HEAD, call, is_op, linear_parts, mark
from rewriter.maths.int4 import dequantize, quantize


def quantize_linears(ir: IR, group_size: int, lm_head: bool, pass_name: str,
                     exact: bool = False) -> Optional[dict]:
    """Rewrite ``ir``'s dense linears (not the draft heads, nor the LM head unless
    ``lm_head``) whose in-features are a multiple of ``group_size`` to 4 bits, the new
    nodes marked as ``pass_name``'s; with ``exact``, only those whose 4-bit form reads
    back as their weight bit for bit (a Q4_0, Q4_1 or Q4_K tensor of a GGUF file), the
    others left dense. What ``ir.info["int4"]`` records of them, or None where no linear
    qualified (``ir`` then unchanged)."""
    head = lm_head_of(ir)
    done, exact_done, error, scale = 0, 0, 0.0, 0.0
    for node in list(ir.graph.find_nodes(op="call_function", target=torch.ops.rw.linear.default)):
        x, w, b = linear_parts(node)
        weight = ir.weight(w.target) if w.op == "get_attr" else None
        if node.meta.get("role") == DRAFT_HEAD:
            continue  # the heads stay as trained; they are small next to the model
        if (weight is None or weight.dim() != 2 or not weight.is_floating_point()
                or weight.shape[1] % group_size or (node is head and not lm_head)):
            continue
        if not torch.isfinite(weight).all():
            raise PassError(f"Int4Weights: {w.target} holds NaN or infinite values; no grid "
                            f"of 4-bit codes holds them")
        codes, scales, mins = quantize(weight, group_size)
        off = (dequantize(codes, scales, mins, group_size) - weight.float()).abs().max().item()
        if exact and off:
            continue
        error, exact_done = max(error, off), exact_done + (off == 0)
        scale = max(scale, weight.float().abs().max().item())
        _replace(ir, node, (x, b), w.target, (codes, scales, mins), group_size, pass_name)
        done += 1
    if not done:
        return None
    ir.prune()
    return {"linears": done, "exact_linears": exact_done, "group_size": group_size,
            "max_abs_error": error, "max_abs_weight": scale}


def lm_head_of(ir: IR) -> Optional[fx.Node]:
    """The LM head: the linear the frontend marked ``head``, else the one whose output is
    the graph's output (the logits); None when there is neither."""
    for n in ir.graph.find_nodes(op="call_function", target=torch.ops.rw.linear.default):
        if n.meta.get("role") == "head":
            return n
    out = next(iter(ir.graph.find_nodes(op="output"))).args[0]
    return out if is_op(out, "linear") else None


def _replace(ir: IR, node, inputs, weight_name: str, tensors, group_size: int, pass_name: str):
    x, b = inputs
    base = weight_name.removesuffix(".weight")
    names = [f"{base}.int4_{part}" for part in ("codes", "scales", "mins")]
    for name, t in zip(names, tensors):
        ir.add_weight(name, t)
    g = ir.graph
    with g.inserting_before(node):
        reads = [g.get_attr(n) for n in names]
        new = call(ir, torch.ops.rw.linear_int4.default, (x, *reads, b), node.name)
        new.kwargs = {"group_size": group_size}
    node.replace_all_uses_with(mark(new, node, pass_name))
    g.erase_node(node)
