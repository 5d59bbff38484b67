"""Triton backend: kernel templates for the fused operators and attention over the KV
cache, and generated kernels for the pointwise groups no template covers.

    norm.py               rms_norm, add_rms_norm
    swiglu.py             silu(gate) * up
    rope.py               rotary embedding on folded heads; K (and V) into the cache
    decode_attention.py   one token over the cache: GQA, split (flash-decoding), q RoPE, window +
                          sinks, per-head token lists, any layer's cache
    prefill_attention.py  causal flash attention over the cache, q RoPE
    online_softmax.py     the per-block softmax update both attention kernels share
    partition.py          pointwise groups on the graph (networkx)
    pointwise.py          their generated Triton source (sympy indices), cache, launcher
    aot.py                compile what a run launched for a GPU that is not here (sm_80/90)

Importing the templates imports triton; ``TEMPLATES`` lists them for dumps.
"""
from __future__ import annotations

import os


def interpreted() -> bool:
    """Kernels run under Triton's CPU interpreter. It multiplies bfloat16 operands of
    ``tl.dot`` as raw bit patterns (triton-lang/triton#11584, unsupported upstream), so the
    attention templates give ``tl.dot`` float32 operands there; on a GPU they stay bf16."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check(ok: bool, kernel: str, problem: str) -> None:
    """Arguments are checked before a launch: a kernel reads and writes through raw
    pointers, so a wrong shape would be an out-of-bounds access, not an error."""
    if not ok:
        raise ValueError(f"{kernel}: {problem}")


def row_warps(block: int) -> int:
    """Warps for a program that holds one row of ``block`` elements in registers: 4 warps
    (128 threads) below 2048 elements, 8 below 8192, then 16: a thread keeps <= 16-32 values."""
    return 4 if block < 2048 else 8 if block < 8192 else 16


def __getattr__(name):
    if name == "TEMPLATES":  # imported on use: triton is an optional dependency
        from . import decode_attention, norm, prefill_attention, rope, swiglu
        return [norm, swiglu, rope, decode_attention, prefill_attention]
    raise AttributeError(name)
