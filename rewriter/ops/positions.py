"""Rotary position embedding: the cos/sin tables for positions, and the rotation of q or k."""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.ops.registry import _dims, _need, _register


def _rotary_fake(positions, inv_freq, scaling):
    _need(inv_freq.dim() == 1 and inv_freq.is_floating_point(), "rotary",
          f"inv_freq must be a 1-d float tensor, got {inv_freq.dtype} {_dims(inv_freq)}")
    shape = (*positions.shape, 2 * inv_freq.shape[0])  # [B, S, D]
    return (positions.new_empty(shape, dtype=torch.float32),
            positions.new_empty(shape, dtype=torch.float32))


@_register(fake=_rotary_fake)
def rotary(positions: Tensor, inv_freq: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[B, S, 2 * len(inv_freq)]`` for integer ``positions`` ``[B, S]``."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
    return emb.cos() * scaling, emb.sin() * scaling


def _rope_fake(x, cos, sin, head_dim):
    rot = cos.shape[-1]
    _need(cos.shape == sin.shape and rot % 2 == 0 and rot <= head_dim, "rope",
          f"cos {_dims(cos)} / sin {_dims(sin)} must match and rotate an even number of "
          f"at most head_dim={head_dim} features")
    _need(x.dim() == 3 and x.shape[-1] % head_dim == 0, "rope",
          f"x {_dims(x)} is not [B, S, heads * {head_dim}]")
    return torch.empty_like(x)


@_register(fake=_rope_fake)
def rope(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` features of every head of ``x`` ``[B, S, H*D]``."""
    b, s, _ = x.shape
    xh = x.view(b, s, -1, head_dim)  # [B, S, H, D]
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[:, :, None, :], sin.to(x.dtype)[:, :, None, :]  # [B, S, 1, R]
    x_rot, x_pass = xh[..., :rot], xh[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
    return out.reshape(b, s, -1)  # [B, S, H*D]
