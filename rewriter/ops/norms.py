"""The normalisations: RMSNorm, LayerNorm, and a residual add fused with the RMSNorm after it."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.ops.registry import REFERENCE, _dims, _need, _register


def _check_norm_weight(op: str, x, w) -> None:
    _need(w is None or (w.dim() == 1 and w.shape[0] == x.shape[-1]), op,
          f"weight {_dims(w)} does not fit x {_dims(x)} (one per feature)")


def _rms_norm_fake(x, w, eps, unit_offset=False):
    _check_norm_weight("rms_norm", x, w)
    dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, w.dtype)
    return x.new_empty(x.shape, dtype=dtype)


@_register(fake=_rms_norm_fake)
def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as Llama does; with
    ``unit_offset`` (Gemma's norm) the scale is ``1 + weight`` and the product is taken in
    float32 before the cast (Gemma stores its weights centred on 0)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)
    return weight * h.to(x.dtype)


def _head_rms_norm_fake(x, w, eps, head_dim, unit_offset=False):
    _need(x.dim() == 3 and x.shape[-1] % head_dim == 0, "head_rms_norm",
          f"x {_dims(x)} is not [B, S, heads * {head_dim}]")
    _need(w.dim() == 1 and w.shape[0] == head_dim, "head_rms_norm",
          f"weight {_dims(w)} is not one per feature of a head ({head_dim})")
    dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, w.dtype)
    return x.new_empty(x.shape, dtype=dtype)


@_register(fake=_head_rms_norm_fake)
def head_rms_norm(x: Tensor, weight: Tensor, eps: float, head_dim: int,
                  unit_offset: bool = False) -> Tensor:
    """``rms_norm`` over each head of ``x`` ``[B, S, H*D]`` with one weight ``[D]`` shared by
    the heads: the QK-norm of Qwen3 and Gemma 3, applied to q and k before RoPE."""
    b, s, _ = x.shape
    normed = REFERENCE["rms_norm"](x.view(b, s, -1, head_dim), weight, eps, unit_offset)  # [B,S,H,D]
    return normed.reshape(b, s, -1)  # [B, S, H*D]


def _layer_norm_fake(x, w, b, eps):
    _check_norm_weight("layer_norm", x, w)
    _check_norm_weight("layer_norm", x, b)
    return torch.empty_like(x)


@_register(fake=_layer_norm_fake)
def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _add_rms_norm_fake(x, residual, weight, eps, unit_offset=False):
    _need(x.shape == residual.shape, "add_rms_norm", f"x {_dims(x)} and residual "
          f"{_dims(residual)} differ")
    _check_norm_weight("add_rms_norm", x, weight)
    dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape)


@_register(fake=_add_rms_norm_fake)
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 unit_offset: bool = False) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a residual add and the norm after it, in
    one op (``FuseAddRMSNorm``), so a kernel reads the stream once and writes both."""
    total = x + residual
    return REFERENCE["rms_norm"](total, weight, eps, unit_offset), total  # no re-dispatch
