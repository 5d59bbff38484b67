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

from rewriter.drafts.heads import MAX_HEADS
from rewriter.maths.int4 import dequantize
from rewriter.maths.mask import visible
from rewriter.values import MAX_INT, within_context

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


# Shape rules: each fake checks what its reference would need, so a mis-shaped weight or a
# wrong width fails shape propagation (after every pass, and when an artifact loads)
# with a message that names the op, instead of failing inside a kernel at generate time.

class ShapeError(ValueError):
    """An op's inputs do not fit together (raised while propagating shapes)."""


def _need(ok, op: str, why: str) -> None:
    if not ok:
        raise ShapeError(f"rw.{op}: {why}")


def _dims(t) -> str:
    return "None" if t is None else str(list(t.shape))


def _check_norm_weight(op: str, x, w) -> None:
    _need(w is None or (w.dim() == 1 and w.shape[0] == x.shape[-1]), op,
          f"weight {_dims(w)} does not fit x {_dims(x)} (one per feature)")


def _embedding_fake(ids, w):
    _need(not ids.is_floating_point() and not ids.is_complex(), "embedding",
          f"ids must be integers, got {ids.dtype}")
    _need(w.dim() == 2, "embedding", f"weight must be [rows, features], got {_dims(w)}")
    return w.new_empty((*ids.shape, w.shape[1]))


@_register(fake=_embedding_fake)
def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """Rows of ``weight`` ``[V, H]`` for integer ``ids`` ``[B, S]`` -> ``[B, S, H]``."""
    return F.embedding(ids, weight)


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


@_register()
def silu(x: Tensor) -> Tensor:
    return F.silu(x)


@_register()
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return F.gelu(x, approximate=approximate)


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


def attention_mask(q_len: int, k_len: int, window: Optional[int], device,
                   sinks: Optional[int] = None) -> Tensor:
    """Boolean ``[q_len, k_len]``: query i (the last ``q_len`` of ``k_len``) sees key j:
    the last ``window`` keys, and with ``sinks`` the first ``sinks`` keys too (StreamingLLM)."""
    qi = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    kj = torch.arange(k_len, device=device)[None, :]
    return visible(qi, kj, window, sinks)


def _attention_fake(q, k, v, layer, num_heads, num_kv_heads, head_dim, scale, causal=True,
                    window=None, cos=None, sin=None, sinks=None, rotary=None, select=None,
                    full_heads=None, gates=None):
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    _need(q.dim() == 3 and q.shape[-1] == q_width, "attention",
          f"q {_dims(q)} is not [B, S, num_heads * head_dim = {q_width}]")
    for name, t in (("k", k), ("v", v)):
        _need(t.dim() == 3 and t.shape[-1] == kv_width and t.shape[:2] == q.shape[:2], "attention",
              f"{name} {_dims(t)} is not [B, S, num_kv_heads * head_dim = {kv_width}] like q {_dims(q)}")
    if cos is not None or sin is not None:
        _need(cos is not None and sin is not None, "attention", "cos and sin come together")
        _rope_fake(q, cos, sin, head_dim)
    return torch.empty_like(q)


@_register(fake=_attention_fake)
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
    sinks: Optional[int] = None,
    rotary: Optional[Tensor] = None,
    select: Optional[Tensor] = None,
    full_heads: Optional[list[int]] = None,
    gates: Optional[list[float]] = None,
) -> Tensor:
    """Scaled dot-product attention of one decoder layer; the op that owns the KV cache.

    q ``[B, S, Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``. Query heads are grouped
    over ``Hq / Hkv`` key/value heads (GQA). ``window`` limits each query to the last
    ``window`` keys (sliding-window attention); with ``sinks`` (``StreamingAttention``) also
    the sequence's first ``sinks`` keys, and the runtime keeps that layer's cache in a ring
    of ``sinks + window`` slots. With ``rotary`` (the model's RoPE frequencies) as well, the
    sinks sit at StreamingLLM's positions: just before the window, whatever the query's
    distance from them (``sink_attention``). With ``select`` (``[B, Hkv, S, top_k]`` from
    ``select_tokens``: TidalDecode) a query sees only the selected earlier keys and itself.
    With ``full_heads`` (``DuoAttention``) the sinks and window bind only the other KV heads:
    those listed attend to every earlier key, and the runtime keeps them in a full cache
    beside the others' ring. ``gates`` (one per KV head, ``DuoAttention``'s calibrated
    gates) changes nothing: it records why the heads were split, for the IR and artifacts.
    ``layer`` names the cache slot. With
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
    mask = attention_mask(s, kh.shape[2], window, q.device, sinks) if causal else None
    if select is not None:
        mask = selected_mask(select, kh.shape[2]).repeat_interleave(groups, dim=1)  # [B, Hq, S, T]
    if rotary is not None:
        t = kh.shape[2]
        shift = (torch.arange(t - s, t, device=q.device) - (sinks + window - 1)).clamp(min=0)
        is_sink = (torch.arange(t, device=q.device) < sinks)[None, None, None]  # [1, 1, 1, T]
        out = sink_attention(qh, kh, vh, mask, scale, is_sink, shift.expand(b, s), rotary, head_dim)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    if full_heads is not None:  # DuoAttention: these KV heads' query groups see every key
        full = (torch.arange(num_kv_heads, device=q.device)[:, None]
                == torch.tensor(full_heads, device=q.device)).any(1)  # [Hkv]
        whole = F.scaled_dot_product_attention(
            qh, kh, vh, scale=scale, attn_mask=attention_mask(s, kh.shape[2], None, q.device))
        out = torch.where(full.repeat_interleave(groups)[None, :, None, None], whole, out)
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)  # [B, S, Hq*D]


def selected_mask(select: Tensor, keys: int) -> Tensor:
    """``[B, Hkv, S, keys]``: query i (the last S of ``keys``) sees the keys ``select``
    ``[B, Hkv, S, k]`` names (-1: none) and itself."""
    b, h, s, _ = select.shape
    mask = torch.zeros(b, h, s, keys + 1, dtype=torch.bool, device=select.device)
    mask.scatter_(-1, torch.where(select < 0, keys, select), True)  # -1 lands in the spare column
    mask = mask[..., :keys]
    own = torch.arange(keys - s, keys, device=select.device)  # [S]
    mask[..., torch.arange(s, device=select.device), own] = True
    return mask


def _select_tokens_fake(q, k, layer, num_heads, num_kv_heads, head_dim, top_k, recent=0):
    _attention_fake(q, k, k, layer, num_heads, num_kv_heads, head_dim, 1.0)
    return q.new_empty((q.shape[0], num_kv_heads, q.shape[1], top_k + recent), dtype=torch.int64)


@_register(fake=_select_tokens_fake)
def select_tokens(q: Tensor, k: Tensor, layer: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, top_k: int, recent: int = 0) -> Tensor:
    """TidalDecode's token selection: for every query and KV head, the ``top_k`` earlier
    positions its head group attends to most (softmax weights of the group's query heads,
    summed), then the ``recent`` positions just before the query, always kept (a local
    window; the top-k is chosen among the keys before it): ``[B, Hkv, S, top_k + recent]``,
    -1 where fewer exist. q ``[B, S, Hq*D]`` and k ``[B, S, Hkv*D]`` are the selection
    layer's (rotated); ``layer`` names its cache, which the runtime reads at decode (a
    prompt is attended densely and selects nothing)."""
    b, s, _ = q.shape
    # never wider than the sequence (the runtime caps at its cache): the same positions, and
    # an artifact that raises its own context cannot size this by top_k
    top_k, recent = min(top_k, s), min(recent, s)
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, Hq, S, D]
    kh = k.view(b, s, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    i = torch.arange(s, device=q.device)
    earlier = torch.ones(s, s, dtype=torch.bool, device=q.device).tril(-1 - recent)  # j < i - recent
    chosen = top_tokens(qh, kh, earlier, top_k)  # [B, Hkv, S, top_k]
    return with_recent(chosen, i.expand(b, num_kv_heads, s), recent)


def _select_pages_fake(q, k, layer, num_heads, num_kv_heads, head_dim, page, budget, recent=0):
    _attention_fake(q, k, k, layer, num_heads, num_kv_heads, head_dim, 1.0)
    return q.new_empty((q.shape[0], num_kv_heads, q.shape[1], budget + recent), dtype=torch.int64)


@_register(fake=_select_pages_fake)
def select_pages(q: Tensor, k: Tensor, layer: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, page: int, budget: int, recent: int = 0) -> Tensor:
    """Quest's page selection: earlier keys in pages of ``page`` tokens, each page bounded
    by the per-channel minimum and maximum of its keys; a query scores a page by the upper
    bound of ``q·k`` over it (``sum_d max(q_d min_d, q_d max_d)``, the largest over its KV
    head's query group) and keeps the ``budget // page`` best pages, then the ``recent``
    positions just before it, always kept (a local window; pages are chosen among those
    with a key before it, and contribute only keys before it): ``[B, Hkv, S, budget +
    recent]`` earlier positions, -1 where fewer exist. q ``[B, S, Hq*D]`` and k ``[B, S,
    Hkv*D]`` are the layer's own (rotated); the runtime keeps the bounds beside the cache
    and selects at decode only (a prompt is attended densely)."""
    b, s, _ = q.shape
    # one page of S tokens holds the same keys as any longer page, and no width exceeds what
    # S tokens can fill: nothing here is sized by page, budget or recent beyond the sequence
    page, recent = min(page, s), min(recent, s)
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2).float()  # [B, Hq, S, D]
    kh = k.view(b, s, num_kv_heads, head_dim).transpose(1, 2).float()  # [B, Hkv, S, D]
    pages = -(-s // page)
    budget = min(budget, pages * page)
    pad = pages * page - s
    blocks = F.pad(kh, (0, 0, 0, pad)).view(b, num_kv_heads, pages, page, head_dim)
    high, low = blocks.cummax(3).values, blocks.cummin(3).values  # prefix bounds in each page
    high, low = high.view(b, num_kv_heads, -1, head_dim), low.view(b, num_kv_heads, -1, head_dim)
    i = torch.arange(s, device=q.device)[:, None]  # [S, 1] queries
    p = torch.arange(pages, device=q.device)[None]  # [1, P]
    last = torch.minimum((p + 1) * page, i) - 1  # [S, P]: page p's last key before query i
    # bounds cover every earlier key of the page (as the runtime's, kept as keys are written);
    # a page is a candidate if it holds a key before the local window
    valid = p * page < i - recent
    idx = last.clamp(min=0).view(1, 1, -1, 1).expand(b, num_kv_heads, -1, head_dim)
    hi = high.gather(2, idx).view(b, num_kv_heads, s, pages, head_dim)  # [B, Hkv, S, P, D]
    lo = low.gather(2, idx).view(b, num_kv_heads, s, pages, head_dim)
    end = (i[:, 0] - recent).expand(b, num_kv_heads, s)  # [B, Hkv, S]: pages give keys before it
    chosen = pages_to_tokens(page_scores(qh, hi, lo, valid), valid, page, budget, end)
    return with_recent(chosen, i[:, 0].expand(b, num_kv_heads, s), recent)


def with_recent(chosen: Tensor, end: Tensor, recent: int, start: Optional[Tensor] = None) -> Tensor:
    """``chosen`` ``[B, Hkv, S, k]`` followed by the ``recent`` positions before ``end``
    (broadcast to ``[B, Hkv, S]``): ``[B, Hkv, S, k + recent]``, -1 for those before
    ``start`` (default 0: the row's first real token)."""
    if recent == 0:
        return chosen
    window = end[..., None] - recent + torch.arange(recent, device=chosen.device)  # [B, Hkv, S, r]
    first = 0 if start is None else start[..., None]
    window = torch.where(window >= first, window, -1).expand(*chosen.shape[:-1], recent)
    return torch.cat([chosen, window], dim=-1)


def page_scores(qh: Tensor, hi: Tensor, lo: Tensor, valid: Tensor) -> Tensor:
    """qh ``[B, Hq, S, D]``, page bounds hi/lo ``[B, Hkv, S, P, D]``, ``valid`` broadcast to
    ``[B, Hkv, S, P]`` -> ``[B, Hkv, S, P]`` upper bounds of ``q·k``, the largest over each
    KV head's query group (-inf for pages without keys)."""
    b, hq, s, d = qh.shape
    hkv = hi.shape[1]
    qg = qh.view(b, hkv, hq // hkv, s, d).transpose(2, 3)  # [B, Hkv, S, G, D]
    # max(q*hi, q*lo) per channel is q*hi where q >= 0 and q*lo where q < 0 (hi >= lo): two
    # products, not two [.., P, D] temporaries. Pages without keys (bounds -inf/+inf) may
    # come out NaN; they are not valid and are masked.
    bound = (qg.clamp(min=0) @ hi.transpose(-1, -2)
             + qg.clamp(max=0) @ lo.transpose(-1, -2))  # [B, Hkv, S, G, P]
    return bound.amax(3).masked_fill(~valid, float("-inf"))


def pages_to_tokens(scores: Tensor, valid: Tensor, page: int, budget: int, end: Tensor,
                    start: Optional[Tensor] = None) -> Tensor:
    """The best ``budget // page`` pages of ``scores`` ``[B, Hkv, S, P]`` as token positions
    ``[B, Hkv, S, budget]``: those in ``[start, end)`` (broadcast to ``[B, Hkv, S]``), -1
    elsewhere and past the chosen pages."""
    b, hkv, s, pages = scores.shape
    n = min(budget // page, pages)
    best = scores.topk(n, dim=-1)  # [B, Hkv, S, n]
    ok = valid.expand(b, hkv, s, pages).gather(-1, best.indices)[..., None]  # [B, Hkv, S, n, 1]
    tokens = best.indices[..., None] * page + torch.arange(page, device=scores.device)  # [.., n, page]
    keep = ok & (tokens < end[..., None, None])
    if start is not None:
        keep = keep & (tokens >= start[..., None, None])
    tokens = torch.where(keep, tokens, -1).flatten(-2)  # [B, Hkv, S, n * page]
    return F.pad(tokens, (0, budget - tokens.shape[-1]), value=-1)


def top_tokens(qh: Tensor, kh: Tensor, allowed: Tensor, top_k: int) -> Tensor:
    """qh ``[B, Hq, S, D]``, kh ``[B, Hkv, T, D]``, ``allowed`` broadcast to ``[B, 1, S, T]``
    -> ``[B, Hkv, S, top_k]`` positions by summed group attention weight, -1 past the
    allowed ones."""
    b, hq, s, d = qh.shape
    hkv, t = kh.shape[1], kh.shape[2]
    g = hq // hkv
    # Query head h reads KV head h // g: one product per KV head over its whole group, so
    # the keys are read once, not copied g times (the cache is what a decode step is bound by).
    qg = qh.float().reshape(b, hkv, g * s, d)  # [B, Hkv, G*S, D]
    scores = (qg @ kh.float().transpose(-1, -2)).view(b, hkv, g, s, t) / math.sqrt(d)
    seen = allowed.expand(b, 1, s, t)[:, :, None]  # [B, 1, 1, S, T]
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)
    weights = weights.sum(2)  # [B, Hkv, S, T]
    k = min(top_k, t)
    best, idx = weights.topk(k, dim=-1)  # [B, Hkv, S, k]
    ok = seen[:, :, 0].expand(b, hkv, s, t).gather(-1, idx)
    idx = torch.where(ok, idx, -1)
    return F.pad(idx, (0, top_k - k), value=-1)


def sink_attention(qh: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                   is_sink: Tensor, shift: Tensor, inv_freq: Tensor, head_dim: int) -> Tensor:
    """Attention with StreamingLLM's sink positions: qh ``[B, H, S, D]``, keys/values
    ``[B, H, K, D]`` (heads already matched), ``mask`` and ``is_sink`` boolean, broadcast to
    ``[B, H, S, K]``. Keys hold RoPE at their true positions; a query ``shift`` ``[B, S]``
    positions past the end of a full cache (``sinks + window``) scores the sinks as if they
    sat just before its window, i.e. with itself rotated back by ``shift``. Inside the
    window every distance is the true one, so only the sinks' columns change."""
    b, h, s, d = qh.shape
    scores = qh @ keys.transpose(-1, -2) * scale  # [B, H, S, K]
    cos, sin = REFERENCE["rotary"](shift, inv_freq, 1.0)  # [B, S, R]
    flat = qh.transpose(1, 2).reshape(b, s, h * d)  # [B, S, H*D]
    back = REFERENCE["rope"](flat, cos, -sin, head_dim).view(b, s, h, d).transpose(1, 2)
    scores = torch.where(is_sink, back @ keys.transpose(-1, -2) * scale, scores)
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype)
    return probs @ values  # [B, H, S, D]


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


# ---------------------------------------------------------------------------- attributes
# The non-tensor arguments of each op and what they may hold: one rule per argument, here
# beside the ops, so that ``verify`` (after every pass) and the artifact loader refuse the
# same values. ``window=-5`` once changed the tokens of a loaded IR; now it names itself.

# The EAGLE draft layer's weights, in its op's argument order: (argument, eagle's name)
EAGLE_WEIGHTS = (("fc_weight", "fc.weight"), ("fc_bias", "fc.bias"),
                 ("input_norm", "input_layernorm.weight"), ("q_proj", "self_attn.q_proj.weight"),
                 ("k_proj", "self_attn.k_proj.weight"), ("v_proj", "self_attn.v_proj.weight"),
                 ("o_proj", "self_attn.o_proj.weight"),
                 ("post_norm", "post_attention_layernorm.weight"),
                 ("gate_proj", "mlp.gate_proj.weight"), ("up_proj", "mlp.up_proj.weight"),
                 ("down_proj", "mlp.down_proj.weight"), ("norm", "norm.weight"))


def _eagle_shape(x, weights, num_heads, num_kv_heads, rope_theta, eps):
    """``rewriter.drafts.eagle.Shape`` of the op's weights (the MLP's width from ``gate_proj``),
    each weight checked against it by name."""
    from rewriter.drafts import eagle
    h = x.shape[-1]
    gate = weights[8]
    _need(gate.dim() == 2, "eagle_layer", f"gate_proj must be [width, {h}], got {_dims(gate)}")
    try:
        shape = eagle.Shape(int(h), num_heads, num_kv_heads, int(gate.shape[0]), rope_theta, eps)
    except ValueError as e:
        raise ShapeError(f"rw.eagle_layer: {e}") from None
    kv, i = shape.kv_heads * shape.head_dim, shape.intermediate
    want = {"fc_weight": (h, 2 * h), "fc_bias": (h,), "input_norm": (h,), "q_proj": (h, h),
            "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h), "post_norm": (h,),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i), "norm": (h,)}
    for (name, _), w in zip(EAGLE_WEIGHTS, weights):
        _need(tuple(w.shape) == want[name], "eagle_layer",
              f"{name} must be {list(want[name])} for hidden {h}, got {_dims(w)}")
    return shape


def _eagle_layer_fake(feature, embedded, *rest):
    _need(feature.dim() == 3 and embedded.shape == feature.shape, "eagle_layer",
          f"feature and embedded must both be [B, S, H], got {_dims(feature)} and {_dims(embedded)}")
    _eagle_shape(feature, rest[:12], *rest[12:])
    return torch.empty_like(feature)


@_register(fake=_eagle_layer_fake)
def eagle_layer(feature: Tensor, embedded: Tensor, fc_weight: Tensor, fc_bias: Tensor,
                input_norm: Tensor, q_proj: Tensor, k_proj: Tensor, v_proj: Tensor,
                o_proj: Tensor, post_norm: Tensor, gate_proj: Tensor, up_proj: Tensor,
                down_proj: Tensor, norm: Tensor, num_heads: int, num_kv_heads: int,
                rope_theta: float, eps: float) -> Tensor:
    """An EAGLE draft layer (``rewriter.drafts.eagle``) over whole rows, teacher-forced: at position
    ``t`` of ``feature`` ``[B, S, H]`` (the model's LM-head input) beside ``embedded``
    ``[B, S, H]`` (the embedding of the token after ``t``), causal over the row, the draft's
    output feature ``[B, S, H]``: the LM head turns it into its guess of the token two after
    ``t``. In decoding the runtime runs the same layer with a cache of its own
    (``runtime.decoding.tree.eagle_rows``)."""
    from rewriter.drafts import eagle
    weights = (fc_weight, fc_bias, input_norm, q_proj, k_proj, v_proj, o_proj, post_norm,
               gate_proj, up_proj, down_proj, norm)
    shape = _eagle_shape(feature, weights, num_heads, num_kv_heads, rope_theta, eps)
    p = {name: w for (_, name), w in zip(EAGLE_WEIGHTS, weights)}
    out, _ = eagle.step(p, shape, feature, embedded,
                        eagle.empty_cache(shape, feature.shape[0], feature.dtype, feature.device))
    return out


def _int(low: int, high: int = MAX_INT):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            return f"an integer in [{low}, {high}]"
    return check


def _finite_positive(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return "a finite number > 0"


def _bool(v):
    if not isinstance(v, bool):
        return "true or false"


def _one_of(*choices):
    def check(v):
        if not isinstance(v, str) or v not in choices:
            return f"one of {', '.join(map(repr, choices))}"
    return check


def _head_list(v):
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_INT for i in v) \
            or list(v) != sorted(set(v)):
        return "a non-empty sorted list of distinct KV head indices"


def _gate_list(v):
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= 1 for g in v):
        return "a non-empty list of numbers in [0, 1]"


def _optional(rule):
    def check(v):
        return None if v is None else rule(v) and f"None or {rule(v)}"
    return check


ATTRIBUTES: dict[str, dict[str, callable]] = {
    "rms_norm": {"eps": _finite_positive},
    "layer_norm": {"eps": _finite_positive},
    "add_rms_norm": {"eps": _finite_positive},
    "gelu": {"approximate": _one_of("none", "tanh")},
    "rotary": {"scaling": _finite_positive},
    "rope": {"head_dim": _int(1)},
    "linear_int4": {"group_size": _int(2)},
    # Hydra's heads read the path drafted so far (EAGLE's 1): no more tokens than heads
    "next_tokens": {"count": _int(1, MAX_HEADS)},
    "eagle_layer": {"num_heads": _int(1), "num_kv_heads": _int(1),
                    "rope_theta": _finite_positive, "eps": _finite_positive},
    "select_tokens": {"layer": _int(0), "num_heads": _int(1), "num_kv_heads": _int(1),
                      "head_dim": _int(1), "top_k": _int(1), "recent": _int(0)},
    "select_pages": {"layer": _int(0), "num_heads": _int(1), "num_kv_heads": _int(1),
                     "head_dim": _int(1), "page": _int(1), "budget": _int(1),
                     "recent": _int(0)},
    "attention": {"layer": _int(0), "num_heads": _int(1), "num_kv_heads": _int(1),
                  "head_dim": _int(1), "scale": _finite_positive, "causal": _bool,
                  "window": _optional(_int(1)), "sinks": _optional(_int(0)),
                  "full_heads": _optional(_head_list), "gates": _optional(_gate_list)},
}

# Token counts the runtime sizes a layer's state by: a ring's slots and sink layout
# (``sinks + window``), a selection's width (``top_k`` or ``budget``, plus ``recent``).
# Together they may not pass the model's context length, which the schema above does not
# know: ``check_context`` is applied by the verifier (after every pass, and at load) and,
# naming their own parameters, by the passes that write them. A plain sliding window
# (no sinks) sizes nothing: the cache is the sequence's, and the artifact loader ties the
# window to the config's ``sliding_window``.
CONTEXT_BOUNDED = {"attention": ("sinks", "window"), "select_tokens": ("top_k", "recent"),
                   "select_pages": ("budget", "recent")}


def check_context(name: str, bound: dict, context: int) -> None:
    """``ValueError`` when the ``CONTEXT_BOUNDED`` counts of a call of ``rw.<name>`` (its
    arguments by name, ``op_arguments``) add up past ``context``, naming them."""
    keys = CONTEXT_BOUNDED.get(name)
    if keys is None or (name == "attention" and bound["sinks"] is None):
        return
    within_context(f"rw.{name}", context, **{k: bound[k] for k in keys})


def op_arguments(name: str, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call of ``rw.<name>`` by their schema names, defaults filled in;
    ``ValueError`` for too many, unknown, repeated or missing ones."""
    schema = OPS[name]._schema.arguments
    if len(args) > len(schema):
        raise ValueError(f"rw.{name} takes {len(schema)} arguments, got {len(args)}")
    bound = {a.name: v for a, v in zip(schema, args)}
    for key, v in kwargs.items():
        if key in bound or key not in {a.name for a in schema}:
            raise ValueError(f"rw.{name}: unexpected or repeated argument {key!r}")
        bound[key] = v
    for a in schema:
        if a.name not in bound:
            if not a.has_default_value():
                raise ValueError(f"rw.{name}: missing argument {a.name!r}")
            bound[a.name] = a.default_value
    return bound


def check_arguments(name: str, args: tuple, kwargs: dict, is_tensor=None) -> dict:
    """``op_arguments``, each attribute checked by its rule and each tensor argument by
    ``is_tensor`` (e.g. "is an fx node"); ``ValueError`` names the argument and the value."""
    bound = op_arguments(name, args, kwargs)
    rules = ATTRIBUTES.get(name, {})
    for a in OPS[name]._schema.arguments:
        v = bound[a.name]
        optional = isinstance(a.type, torch.OptionalType)
        if isinstance(a.type.getElementType() if optional else a.type, torch.TensorType):
            if is_tensor is not None and not (is_tensor(v) or (optional and v is None)):
                raise ValueError(f"rw.{name}: {a.name} must be a tensor, got {v!r}")
            continue
        rule = rules.get(a.name)
        why = rule(v) if rule is not None else None
        if why:
            raise ValueError(f"rw.{name}: {a.name} must be {why}, got {v!r}")
    if name == "select_pages" and bound["budget"] < bound["page"]:
        raise ValueError(f"rw.select_pages: budget={bound['budget']} must hold at least one "
                         f"page of {bound['page']} tokens")
    if name == "attention" and bound["num_heads"] % bound["num_kv_heads"]:
        raise ValueError(f"rw.attention: num_heads={bound['num_heads']} is not a multiple of "
                         f"num_kv_heads={bound['num_kv_heads']}")
    if name == "linear_int4" and bound["group_size"] % 2:
        raise ValueError(f"rw.linear_int4: group_size={bound['group_size']} must be even "
                         "(two codes a byte)")
    if name == "attention" and bound["sinks"] is not None and bound["window"] is None:
        raise ValueError(f"rw.attention: sinks={bound['sinks']} needs a window (the sinks are "
                         "kept beside the last window keys)")
    if name == "attention" and bound["select"] is not None and bound["sinks"] is not None:
        raise ValueError("rw.attention: select (TidalDecode) and sinks (a ring cache) do not "
                         "go together: the ring has dropped what a selection may name")
    if name == "attention" and bound["select"] is not None and bound["window"] is not None:
        raise ValueError(f"rw.attention: select (TidalDecode, Quest) and window="
                         f"{bound['window']} do not go together: the selection replaces the "
                         f"causal window")
    if name == "attention" and bound["rotary"] is not None and bound["sinks"] is None:
        raise ValueError("rw.attention: rotary (StreamingLLM's sink positions) needs sinks")
    if name == "attention":
        _check_duo(bound)
    if name == "attention" and (bound["cos"] is None) != (bound["sin"] is None):
        raise ValueError("rw.attention: cos and sin come together (both or neither)")
    return bound


def _check_duo(bound: dict) -> None:
    """``full_heads`` split a sink + window layer's KV heads; ``gates`` has one per KV head."""
    heads, full = bound["num_kv_heads"], bound["full_heads"]
    if full is not None and bound["sinks"] is None:
        raise ValueError(f"rw.attention: full_heads={list(full)} needs sinks (the other heads "
                         f"keep a sink + window cache)")
    if full is not None and (full[-1] >= heads or len(full) == heads):
        raise ValueError(f"rw.attention: full_heads={list(full)} must name some, not all, of "
                         f"the {heads} KV heads (0 .. {heads - 1})")
    if bound["gates"] is not None and len(bound["gates"]) != heads:
        raise ValueError(f"rw.attention: gates has {len(bound['gates'])} values for "
                         f"{heads} KV heads")
