"""``Int4Weights``: linear weights stored in 4 bits, group-wise (``rewriter.maths.int4``; the
rewrite itself, shared with the self-speculative draft, is ``rewriter.ir.int4``).

    y = linear(x, W, b)    ->    y = linear_int4(x, codes, scales, mins, b, group_size=g)

A one-token decode step reads every weight once, so on a CPU it is bound by the bytes of
the weights: 4-bit codes plus one scale and one minimum per group of 32 read 6 bits a
weight instead of 32 (float32) or 16 (bfloat16). The runtime multiplies them without
dequantizing (``runtime.kernels.int4_cpu``) where torch has a kernel for it: CPU,
bfloat16 activations; elsewhere it dequantizes once at lowering (same results, no saving).

Lossy in general (measured: ``benchmarks/quality.py``), but exact for weights that were
already 4-bit in groups of 32: a GGUF file's Q4_0, Q4_1 (SmolLM2's) and Q4_K tensors, whose
dequantized values this re-quantizes to a grid that reads them back bit for bit
(``rewriter.maths.int4``). A Q4_K_M file mixes in wider types (Q5_0, Q6_K, Q8_0) that 4 bits
round; ``exact=True`` rewrites only the linears held exactly and leaves those dense, so the
model's outputs are unchanged. ``ir.info["int4"]`` records how many linears are exact and
how far the stored weights are from the traced ones.
The LM head is left dense unless ``lm_head=True``: SmolLM2's is its Q8_0 embedding, which
4 bits would coarsen. Run it after the fusions: they match dense linears only.
"""
from __future__ import annotations

from rewriter.decoding import TreeDecoding, strategy_of
from rewriter.errors import PassError
from rewriter.maths.int4 import DEFAULT_GROUP, GROUP_SIZES
from rewriter.ir.core import IR
from rewriter.ir.int4 import quantize_linears
from rewriter.ir.pass_manager import Pass


class Int4Weights(Pass):
    def __init__(self, group_size: int = DEFAULT_GROUP, lm_head: bool = False, exact: bool = False):
        if type(group_size) is not int or group_size not in GROUP_SIZES:  # not True, not 32.0
            raise ValueError(f"Int4Weights: group_size must be one of {GROUP_SIZES}, "
                             f"got {group_size!r}")
        if not isinstance(lm_head, bool):
            raise ValueError(f"Int4Weights: lm_head must be true or false, got {lm_head!r}")
        if not isinstance(exact, bool):
            raise ValueError(f"Int4Weights: exact must be true or false, got {exact!r}")
        self.group_size = group_size
        self.lm_head = lm_head
        self.exact = exact

    def run(self, ir: IR) -> IR:
        if self.lm_head and isinstance(strategy_of(ir.info), TreeDecoding):
            raise PassError(f"{self!r}: the tree strategy's rounds read the LM head as a "
                            f"dense linear (MedusaHeads/HydraHeads share it; PromptLookup's "
                            f"rounds return its input too); keep lm_head=False after them")
        info = quantize_linears(ir, self.group_size, self.lm_head, self.name, self.exact)
        if info is None:
            held = " and whose weight 4 bits hold exactly" if self.exact else ""
            raise PassError(f"{self!r} found no linear whose in-features are a multiple of "
                            f"{self.group_size}{held}")
        ir.info["int4"] = info
        return ir
