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


def _rms_norm_fake(x, w, eps):
    _check_norm_weight("rms_norm", x, w)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype))


@_register(fake=_rms_norm_fake)
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as Llama does."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _layer_norm_fake(x, w, b, eps):
    _check_norm_weight("layer_norm", x, w)
    _check_norm_weight("layer_norm", x, b)
    return torch.empty_like(x)


@_register(fake=_layer_norm_fake)
def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _add_rms_norm_fake(x, residual, weight, eps):
    _need(x.shape == residual.shape, "add_rms_norm", f"x {_dims(x)} and residual "
          f"{_dims(residual)} differ")
    _check_norm_weight("add_rms_norm", x, weight)
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(x.shape))


@_register(fake=_add_rms_norm_fake)
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a residual add and the norm after it, in
    one op (``FuseAddRMSNorm``), so a kernel reads the stream once and writes both."""
    total = x + residual
    return REFERENCE["rms_norm"](total, weight, eps), total  # the plain function: no re-dispatch
