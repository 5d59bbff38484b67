"""``Int4Weights``: linear weights stored in 4 bits, group-wise (``rewriter.maths.int4``).

    y = linear(x, W, b)    ->    y = linear_int4(x, codes, scales, mins, b, group_size=g)

A one-token decode step reads every weight once, so on a CPU it is bound by the bytes of
the weights: 4-bit codes plus one scale and one minimum per group of 32 read 6 bits a
weight instead of 32 (float32) or 16 (bfloat16). The runtime multiplies them without
dequantizing (``runtime.kernels.int4_cpu``) where torch has a kernel for it: CPU,
bfloat16 activations; elsewhere it dequantizes once at lowering (same results, no saving).

Lossy in general (measured: ``benchmarks/quality.py``), but exact for a model that was
already 4-bit: SmolLM2's GGUF file is Q4_1, whose weights this re-quantizes to their own
codes. ``ir.info["int4"]`` records how far the stored weights are from the traced ones.
The LM head is left dense unless ``lm_head=True``: SmolLM2's is its Q8_0 embedding, which
4 bits would coarsen. Run it after the fusions: they match dense linears only.
"""
from __future__ import annotations

import torch

from rewriter.decoding import TreeDecoding, strategy_of
from rewriter.errors import PassError
from rewriter.maths.int4 import GROUP_SIZES, dequantize, quantize
from rewriter.ir.core import IR
from rewriter.ir.pass_manager import Pass
from rewriter.passes.fusion import call, is_op, linear_parts, mark


class Int4Weights(Pass):
    def __init__(self, group_size: int = 32, lm_head: bool = False):
        if type(group_size) is not int or group_size not in GROUP_SIZES:  # not True, not 32.0
            raise ValueError(f"Int4Weights: group_size must be one of {GROUP_SIZES}, "
                             f"got {group_size!r}")
        if not isinstance(lm_head, bool):
            raise ValueError(f"Int4Weights: lm_head must be true or false, got {lm_head!r}")
        self.group_size = group_size
        self.lm_head = lm_head

    def run(self, ir: IR) -> IR:
        if self.lm_head and isinstance(strategy_of(ir.info), TreeDecoding):
            raise PassError(f"{self!r}: the tree strategy's rounds read the LM head as a "
                            f"dense linear (MedusaHeads/HydraHeads share it; PromptLookup's "
                            f"rounds return its input too); keep lm_head=False after them")
        head = _lm_head(ir)
        done, error, scale = 0, 0.0, 0.0
        for node in list(ir.graph.find_nodes(op="call_function", target=torch.ops.rw.linear.default)):
            x, w, b = linear_parts(node)
            weight = ir.weight(w.target) if w.op == "get_attr" else None
            if node.meta.get("role") == "draft_head":
                continue  # the heads stay as trained; they are small next to the model
            if (weight is None or weight.dim() != 2 or not weight.is_floating_point()
                    or weight.shape[1] % self.group_size or (node is head and not self.lm_head)):
                continue
            codes, scales, mins = quantize(weight, self.group_size)
            error = max(error, (dequantize(codes, scales, mins, self.group_size)
                                - weight.float()).abs().max().item())
            scale = max(scale, weight.float().abs().max().item())
            _replace(ir, node, (x, b), w.target, (codes, scales, mins), self.group_size, self.name)
            done += 1
        if not done:
            raise PassError(f"{self!r} found no linear whose in-features are a multiple of "
                            f"{self.group_size}")
        ir.prune()
        ir.info["int4"] = {"linears": done, "group_size": self.group_size,
                           "max_abs_error": error, "max_abs_weight": scale}
        return ir


def _lm_head(ir: IR):
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
