"""Token embedding, the projections (dense and 4-bit) and the activations between them."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.maths.int4 import dequantize
from rewriter.ops.registry import _dims, _need, _register


def _embedding_fake(ids, w, scale=None):
    _need(not ids.is_floating_point() and not ids.is_complex(), "embedding",
          f"ids must be integers, got {ids.dtype}")
    _need(w.dim() == 2, "embedding", f"weight must be [rows, features], got {_dims(w)}")
    return w.new_empty((*ids.shape, w.shape[1]))


@_register(fake=_embedding_fake)
def embedding(ids: Tensor, weight: Tensor, scale: Optional[float] = None) -> Tensor:
    """Rows of ``weight`` ``[V, H]`` for integer ``ids`` ``[B, S]`` -> ``[B, S, H]``, times
    ``scale`` when given (Gemma's ``sqrt(hidden)``, held as the weight's dtype rounds it,
    so the product is the one the model computes)."""
    rows = F.embedding(ids, weight)
    return rows if scale is None else rows * scale


def _next_tokens_fake(ids, count):
    _need(ids.dim() == 2 and not ids.is_floating_point() and not ids.is_complex(), "next_tokens",
          f"ids must be [B, S] integers, got {_dims(ids)} {ids.dtype}")
    return ids.new_empty((ids.shape[0], ids.shape[1], count))


@_register(fake=_next_tokens_fake)
def next_tokens(ids: Tensor, count: int) -> Tensor:
    """The ``count`` tokens after each position: ``[B, S]`` -> ``[B, S, count]``, ``out[b, t,
    j] = ids[b, t + 1 + j]`` (0 past the end). Hydra heads read them as the path already
    drafted; in decoding the runtime passes the tree's paths instead."""
    padded = F.pad(ids, (0, count))  # [B, S + count]
    return padded.unfold(1, count, 1)[:, 1:ids.shape[1] + 1].contiguous()  # [B, S, count]


def _linear_fake(x, w, b=None):
    _need(w.dim() == 2 and x.dim() >= 1 and x.shape[-1] == w.shape[1], "linear",
          f"weight {_dims(w)} does not take x {_dims(x)} (in-features must match)")
    _need(b is None or (b.dim() == 1 and b.shape[0] == w.shape[0]), "linear",
          f"bias {_dims(b)} does not fit weight {_dims(w)}")
    _need(x.dtype == w.dtype, "linear", f"x is {x.dtype} but weight is {w.dtype}")
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@_register(fake=_linear_fake)
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias``; ``weight`` is ``[out, in]`` as in ``nn.Linear``."""
    return F.linear(x, weight, bias)


def _linear_int4_fake(x, codes, scales, mins, bias=None, group_size=32):
    _need(codes.dim() == 2 and codes.dtype == torch.uint8, "linear_int4",
          f"codes must be uint8 [out, in / 2], got {codes.dtype} {_dims(codes)}")
    out, width = codes.shape[0], 2 * codes.shape[1]
    _need(x.dim() >= 1 and x.shape[-1] == width, "linear_int4",
          f"codes {_dims(codes)} hold {width} in-features, x {_dims(x)} has {x.shape[-1]}")
    _need(group_size > 0 and width % group_size == 0, "linear_int4",
          f"in-features {width} are not a whole number of groups of {group_size}")
    for name, t in (("scales", scales), ("mins", mins)):
        _need(t.shape == (out, width // group_size) and t.dtype == x.dtype, "linear_int4",
              f"{name} must be {x.dtype} [{out}, {width // group_size}], got {t.dtype} {_dims(t)}")
    _need(bias is None or (bias.dim() == 1 and bias.shape[0] == out), "linear_int4",
          f"bias {_dims(bias)} does not fit {out} out-features")
    return x.new_empty((*x.shape[:-1], out))


@_register(fake=_linear_int4_fake)
def linear_int4(x: Tensor, codes: Tensor, scales: Tensor, mins: Tensor,
                bias: Optional[Tensor] = None, group_size: int = 32) -> Tensor:
    """``linear`` whose weight is stored in 4 bits (``Int4Weights``).

    ``W[o, i] = code[o, i] * scales[o, i // g] + mins[o, i // g]`` with ``g = group_size``
    and ``code`` in 0..15; ``codes`` ``[out, in / 2]`` holds two per byte, column ``2j``
    in the low nibble and ``2j + 1`` in the high one (the layout of ``rewriter.maths.int4``).
    """
    weight = dequantize(codes, scales, mins, group_size)  # float32 [out, in], as kernels do
    return F.linear(x, weight.to(x.dtype), bias)


@_register()
def silu(x: Tensor) -> Tensor:
    return F.silu(x)


@_register()
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return F.gelu(x, approximate=approximate)


def _swiglu_fake(gu):
    _need(gu.dim() >= 1 and gu.shape[-1] % 2 == 0, "swiglu",
          f"gate_up {_dims(gu)} must have an even last dimension [gate | up]")
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


@_register(fake=_swiglu_fake)
def swiglu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[..., 2F]`` -> ``[..., F]``
    (``FuseSwiGLU``: the gate and up projections became one GEMM)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
