"""``backend="triton"``: the step programs call the Triton templates in ``rewriter.codegen``.

Norms, SwiGLU, RoPE and attention over the cache run as Triton kernels; matrix multiplies
and embeddings stay with torch; ops without a template run their torch reference (the
generic pointwise fuser that would cover them is not built yet). On a CPU the kernels run
only under ``TRITON_INTERPRET=1`` (set before ``rewriter`` is imported), which is how the
tests run them.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from rewriter.ops import REFERENCE

from .attention import Step, write_kv


def available(device: torch.device) -> Optional[str]:
    """None when Triton kernels can run on ``device``, else the reason they cannot."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "backend='triton' needs the triton package: pip install 'rewriter[triton]'"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"backend='triton' runs on CUDA devices (the model is on {device}); on a CPU, set "
            f"TRITON_INTERPRET=1 before importing rewriter to use Triton's interpreter")


def kernels() -> dict:
    from rewriter.codegen import norm, rope, swiglu
    return {**REFERENCE, "rms_norm": norm.rms_norm,
            "add_rms_norm": lambda x, r, w, eps: norm.add_rms_norm(x, r, w, eps),
            "swiglu": swiglu.swiglu, "rope": rope.rope}


def cached_attention(step: Step, q: Tensor, k: Tensor, v: Tensor, slot: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, scale: float, window: Optional[int],
                     cos: Optional[Tensor] = None, sin: Optional[Tensor] = None) -> Tensor:
    """``rw.attention`` over cache slot ``slot``: decode or prefill kernel by step length;
    with ``cos``/``sin`` (``FuseRoPE``) K is rotated by the kernel that writes the cache
    (V with it) and q by the attention kernel: no launch of its own for either."""
    from rewriter.codegen.decode_attention import decode_attention
    from rewriter.codegen.prefill_attention import prefill_attention
    from rewriter.codegen.rope import rope_into_cache
    b, s, _ = q.shape
    k_cache, v_cache = step.cache.k[slot], step.cache.v[slot]
    split = lambda x: x.view(b, s, num_kv_heads, head_dim).transpose(1, 2)  # noqa: E731  [B, Hkv, S, D]
    if cos is not None:  # q is rotated inside the attention kernel
        rope_into_cache(k, cos, sin, head_dim, k_cache, step.pos if step.static else step.start,
                        v=v, v_cache=v_cache)  # K rotated and V, one launch
    else:
        write_kv(step, k_cache, v_cache, split(k), split(v))
    start = step.pad if step.pad is not None else step.once("zeros", lambda: _zeros(b, q.device))
    if s == 1:
        end = step.once("end", lambda: step.pos + 1) if step.static else step.end
        out = decode_attention(q.view(b, num_heads, head_dim), k_cache, v_cache, end, scale,
                               start=start, window=window or 0, cos=cos, sin=sin)
        return out.view(b, 1, num_heads * head_dim)
    return prefill_attention(q, k_cache, v_cache, num_heads, scale, q_start=step.start,
                             start=start, window=window or 0, cos=cos, sin=sin)


def _zeros(b: int, device) -> Tensor:
    return torch.zeros(b, dtype=torch.int64, device=device)
