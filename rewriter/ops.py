"""The canonical ops of the IR.

Each op is a ``torch.library`` custom op in the ``rw`` namespace, so a lifted graph stays
an executable ``fx.GraphModule`` (``torch.ops.rw.attention(...)`` runs the reference
implementation) and shape propagation works on fake tensors with symbolic sizes. The
reference implementations are plain torch: they define what each op means, and every
backend is checked against them.

Layouts: activations are ``[B, S, features]``; attention inputs and output keep heads
folded into the last dimension (``[B, S, H * D]``) so the IR needs no view nodes and each
backend picks its own cache layout.

``OPS`` maps each op's short name to its overload: the printer and the artifact format
resolve op names through it, never through ``eval``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

OPS: dict[str, torch._ops.OpOverload] = {}
# The same ops as plain Python functions: the runtime calls these directly, because a
# custom-op dispatch costs ~16 us per call, which at decode time is more than the math.
REFERENCE: dict[str, callable] = {}


def _like_first(x, *args, **kwargs):
    return torch.empty_like(x)


def _register(fake=_like_first):
    """Make the decorated function the op ``rw::<name>``; ``fake`` gives its output shape.

    The shape rules are written out (rather than running the reference on fake tensors)
    because shape propagation runs after every pass and must stay cheap.
    """
    def wrap(fn):
        op = torch.library.custom_op(f"rw::{fn.__name__}", mutates_args=())(fn)
        op.register_fake(fake)
        OPS[fn.__name__] = getattr(torch.ops.rw, fn.__name__).default
        REFERENCE[fn.__name__] = fn
        return op
    return wrap


@_register(fake=lambda ids, w: w.new_empty((*ids.shape, w.shape[1])))
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """Rows of ``weight`` ``[V, H]`` for integer ``ids`` ``[B, S]`` -> ``[B, S, H]``."""
    return F.embedding(ids, weight)


@_register(fake=lambda x, w, b=None: x.new_empty((*x.shape[:-1], w.shape[0])))
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias``; ``weight`` is ``[out, in]`` as in ``nn.Linear``."""
    return F.linear(x, weight, bias)


@_register(fake=lambda x, w, eps: x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype)))
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as Llama does."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@_register()
def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@_register()
def silu(x: Tensor) -> Tensor:
    return F.silu(x)


@_register()
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return F.gelu(x, approximate=approximate)


def _rotary_fake(positions, inv_freq, scaling):
    shape = (*positions.shape, 2 * inv_freq.shape[0])  # [B, S, D]
    return (positions.new_empty(shape, dtype=torch.float32),
            positions.new_empty(shape, dtype=torch.float32))


@_register(fake=_rotary_fake)
def rotary(positions: Tensor, inv_freq: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[B, S, 2 * len(inv_freq)]`` for integer ``positions`` ``[B, S]``."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)  # [B, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
    return emb.cos() * scaling, emb.sin() * scaling


@_register()
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


def _add_rms_norm_fake(x, residual, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(x.shape))


@_register(fake=_add_rms_norm_fake)
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a residual add and the norm after it, in
    one op (``FuseAddRMSNorm``), so a kernel reads the stream once and writes both."""
    total = x + residual
    return REFERENCE["rms_norm"](total, weight, eps), total  # the plain function: no re-dispatch


@_register(fake=lambda gu: gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2)))
def swiglu(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[..., 2F]`` -> ``[..., F]``
    (``FuseSwiGLU``: the gate and up projections became one GEMM)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def attention_mask(q_len: int, k_len: int, window: Optional[int], device) -> Tensor:
    """Boolean ``[q_len, k_len]``: query i (the last ``q_len`` of ``k_len``) sees key j."""
    qi = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    kj = torch.arange(k_len, device=device)[None, :]
    mask = kj <= qi
    if window is not None:
        mask = mask & (qi - kj < window)
    return mask


@_register()
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    causal: bool = True,
    window: Optional[int] = None,
    cos: Optional[Tensor] = None,
    sin: Optional[Tensor] = None,
) -> Tensor:
    """Scaled dot-product attention of one decoder layer; the op that owns the KV cache.

    q ``[B, S, Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``. Query heads are grouped
    over ``Hq / Hkv`` key/value heads (GQA). ``window`` limits each query to the last
    ``window`` keys (sliding-window attention). ``layer`` names the cache slot. With
    ``cos``/``sin`` (``FuseRoPE``), q and k are rotated first, exactly as ``rope`` does, so a
    backend can rotate K in the kernel that writes it into the cache.
    """
    if cos is not None:
        q = REFERENCE["rope"](q, cos, sin, head_dim)
        k = REFERENCE["rope"](k, cos, sin, head_dim)
    b, s, _ = q.shape
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, Hq, S, D]
    kh = k.view(b, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, T, D]
    vh = v.view(b, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, T, D]
    groups = num_heads // num_kv_heads
    kh = kh.repeat_interleave(groups, dim=1)  # [B, Hq, T, D]
    vh = vh.repeat_interleave(groups, dim=1)
    mask = attention_mask(s, kh.shape[2], window, q.device) if causal else None
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)  # [B, S, Hq*D]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def short_name(target) -> str:
    """``rw.attention`` for our ops, ``aten.add`` for ATen, the function name otherwise."""
    name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        base = target._schema.name.split("::")[-1]
        return f"{ns}.{base}"
    return name
