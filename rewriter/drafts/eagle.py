"""An EAGLE-style draft: one decoder layer that drafts autoregressively over the model's
features.

At position ``i`` the draft reads the model's feature ``f_i`` (its last hidden state, the
LM head's input, after the final norm) beside the embedding of the next token::

    z_i = fc([f_i; e(x_{i+1})])                 fc [H, 2H] with a bias
    g_i = norm(Layer(z_i))                      one Llama decoder layer, its own KV cache
    logits = lm_head(g_i)                       the model's own, frozen: guesses x_{i+2}

and a deeper draft feeds its own output ``g_i`` back in place of the model's ``f_{i+1}``.
Unlike draft heads it attends to the whole context, which is what heads lack on free text.

It is EAGLE-1's ``fc`` over one feature (EAGLE-1 concatenates ``[e; f]``: swap ``fc``'s
halves to read its weights) with a whole Llama layer (EAGLE-1's drops the input norm),
EAGLE-3's final norm and its training-time test; not EAGLE-3's fused low/mid/high-layer
features or its own reduced-vocabulary LM head.

Two forms of the same function:

- ``step``: what decoding runs. New positions in, their output features out, their keys
  and values appended to the caller's cache (positions are the cache's length onwards).
- ``unroll``: what training runs (EAGLE-3's "training-time test"). ``depth`` draft steps at
  every chain start of whole rows at once: step ``s``'s query at position ``i`` (the chain
  started at ``t = i - s + 1``) sees step 1's keys at positions ``<= t`` (made from the
  model's true features) and step ``m``'s key at ``t + m - 1`` for ``m = 2 .. s``: exactly
  the keys ``step`` would hold. ``tests/test_eagle.py`` checks the two agree.

The parameters are a plain ``{name: tensor}`` dict (``LAYER`` names the decoder layer's,
as a Hugging Face Llama layer names them, plus ``fc.weight``, ``fc.bias``,
``norm.weight``), so a file of them is safetensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.maths.sdpa import sdpa

LAYER = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
         "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class Shape:
    """The draft layer's sizes, a Llama layer's: ``hidden``, query heads, key/value heads,
    the MLP's width, RoPE's base and the norms' epsilon."""
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_heads", "intermediate"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"eagle.Shape: {name} must be a positive int, got {v!r}")
        for name in ("rope_theta", "eps"):
            v = getattr(self, name)
            try:  # a huge JSON int converts to no float: refused here, not at the first step
                ok = not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < float(v) < math.inf
            except OverflowError:
                ok = False
            if not ok:
                raise ValueError(f"eagle.Shape: {name} must be a positive finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"eagle.Shape: hidden {self.hidden} must split into {self.heads} "
                             f"heads of an even size, and {self.heads} query heads into "
                             f"{self.kv_heads} key/value heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def of(cls, config) -> "Shape":
        """The shape of a Hugging Face Llama-like config's decoder layer; configs whose
        layer this does not compute (biases, scaled RoPE, another activation or head size)
        are refused."""
        odd = {"attention_bias": getattr(config, "attention_bias", False),
               "mlp_bias": getattr(config, "mlp_bias", False),
               "hidden_act": getattr(config, "hidden_act", "silu") != "silu",
               "head_dim": getattr(config, "head_dim", None) not in
               (None, config.hidden_size // config.num_attention_heads)}
        odd = [k for k, v in odd.items() if v]
        rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
                or {}).get("rope_type", "default")  # scaled RoPE names another type
        if rope != "default":
            odd.append(f"rope_type {rope!r}")
        if odd:
            raise ValueError(f"eagle.Shape.of: a layer with {', '.join(odd)} is not the plain "
                             f"Llama layer this draft computes")
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") \
            or getattr(config, "rope_theta", 10000.0)
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                   config.intermediate_size, float(theta), float(config.rms_norm_eps))


def init(shape: Shape, generator: torch.Generator, norm: Tensor = None) -> dict:
    """Fresh parameters: linears ``N(0, 0.02)`` (a Hugging Face Llama's ``initializer_range``;
    EAGLE's own code keeps PyTorch's defaults), norms one (the final norm a copy of
    ``norm``, the model's own, where given), ``fc``'s bias zero."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    sizes = {"self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
             "mlp.gate_proj.weight": (shape.intermediate, h),
             "mlp.up_proj.weight": (shape.intermediate, h),
             "mlp.down_proj.weight": (h, shape.intermediate), "fc.weight": (h, 2 * h)}
    p = {name: torch.randn(*size, generator=generator) * 0.02 for name, size in sizes.items()}
    p["input_layernorm.weight"] = torch.ones(h)
    p["post_attention_layernorm.weight"] = torch.ones(h)
    p["fc.bias"] = torch.zeros(h)
    p["norm.weight"] = norm.detach().float().clone() if norm is not None else torch.ones(h)
    return p


def _rotation(positions: Tensor, shape: Shape, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """RoPE's ``(cos, sin)`` (the rotate-half form) at ``positions`` ``[L]`` (every row's) or
    ``[B, L]`` (each row's own): ``[L, d]`` or ``[B, 1, L, d]`` in ``dtype``, made once for
    a step's queries and keys alike (``_rotate``)."""
    d = shape.head_dim
    inv = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d)  # [d/2]
    f = positions[..., None].float() * inv  # [.., L, d/2]
    f = torch.cat([f, f], -1)  # [.., L, d]
    cos, sin = f.cos().to(dtype), f.sin().to(dtype)
    if positions.dim() == 2:  # [B, L, d] -> [B, 1, L, d]: one per row, every head alike
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


def _rotate(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    d = t.shape[-1]
    return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin


def _linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T``; ``w`` ``[out, in]``, or packed for oneDNN (``runtime.packed_linear``:
    decoding's bfloat16 weights, ``runtime.decoding.tree.eagle_rows``), which gives the same values."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return x @ w.t()


def _input(p: dict, feature: Tensor, embedded: Tensor) -> Tensor:
    """``fc([feature; embedded])`` ``[B, L, H]``."""
    return _linear(torch.cat([feature, embedded.to(feature.dtype)], -1), p["fc.weight"]) + p["fc.bias"]


def fused(p: dict) -> dict:
    """``p`` with the query, key and value projections stacked into one matrix, and the
    MLP's gate and up projections into another (``qkv.weight``, ``gate_up.weight``, in
    place of the five): a draft step then makes two products fewer. For decoding
    (``runtime.decoding.tree.eagle_rows``); the products' values are the separate ones' (the same dot
    products, made in one call: bitwise equal on the project's Xeon, checked by hand; a test
    holds them to float32 precision)."""
    stacked = {"qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                              "self_attn.v_proj.weight"),
               "gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    out = {k: v for k, v in p.items() if not any(k in parts for parts in stacked.values())}
    return {**out, **{name: torch.cat([p[k] for k in parts]) for name, parts in stacked.items()}}


def _qkv(p: dict, shape: Shape, z: Tensor, positions: Tensor) -> tuple:
    """Queries ``[B, h, L, d]``, keys and values ``[B, kv, L, d]`` of inputs ``z`` ``[B, L, H]``
    at ``positions`` (``_rotation``'s)."""
    b, s, _ = z.shape
    d = shape.head_dim
    x = F.rms_norm(z, (z.shape[-1],), p["input_layernorm.weight"], shape.eps)
    if "qkv.weight" in p:  # one product (``fused``)
        q, k, v = _linear(x, p["qkv.weight"]).split([shape.heads * d, shape.kv_heads * d,
                                                   shape.kv_heads * d], -1)
    else:
        q, k, v = (_linear(x, p[f"self_attn.{n}_proj.weight"]) for n in "qkv")
    q = q.reshape(b, s, shape.heads, d).transpose(1, 2)
    k = k.reshape(b, s, shape.kv_heads, d).transpose(1, 2)
    v = v.reshape(b, s, shape.kv_heads, d).transpose(1, 2)
    cos, sin = _rotation(positions, shape, q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _finish(p: dict, shape: Shape, z: Tensor, a: Tensor) -> Tensor:
    """The output feature ``[B, L, H]`` from the layer's input ``z`` and attention ``a``
    ``[B, h, L, d]``: o_proj and the residual, the MLP and its residual, the final norm."""
    h = z + _linear(a.transpose(1, 2).flatten(2), p["self_attn.o_proj.weight"])  # [B, L, H]
    x = F.rms_norm(h, (h.shape[-1],), p["post_attention_layernorm.weight"], shape.eps)
    if "gate_up.weight" in p:  # one product (``fused``)
        gate, up = _linear(x, p["gate_up.weight"]).chunk(2, -1)
    else:
        gate, up = _linear(x, p["mlp.gate_proj.weight"]), _linear(x, p["mlp.up_proj.weight"])
    h = h + _linear(F.silu(gate) * up, p["mlp.down_proj.weight"])
    return F.rms_norm(h, (h.shape[-1],), p["norm.weight"], shape.eps)


def _repeat(t: Tensor, shape: Shape) -> Tensor:
    return t.repeat_interleave(shape.heads // shape.kv_heads, 1)  # [B, kv, L, d] -> [B, h, L, d]


def step(p: dict, shape: Shape, feature: Tensor, embedded: Tensor, cache: tuple) -> tuple:
    """Decode: the output features ``[B, n, H]`` of ``n`` new positions, given each one's
    feature ``[B, n, H]`` (the model's, or the draft's own from the step before) and the
    next token's embedding ``[B, n, H]``; ``cache`` ``(keys, values)`` ``[B, kv, L, d]``
    holds the ``L`` positions before them. Returns ``(features, (keys, values))``, the
    cache grown by ``n`` (the caller rolls it back by cutting its length)."""
    keys, values = cache
    if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
        raise ValueError("eagle.step: cache must be (keys, values) tensors")
    if feature.shape != embedded.shape or feature.dim() != 3 or feature.shape[-1] != shape.hidden:
        raise ValueError(f"eagle.step: feature and embedded must both be [B, n, {shape.hidden}], "
                         f"got {tuple(feature.shape)} and {tuple(embedded.shape)}")
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[:2] != (
            feature.shape[0], shape.kv_heads) or keys.shape[3] != shape.head_dim:
        raise ValueError(f"eagle.step: the cache must be two [{feature.shape[0]}, "
                         f"{shape.kv_heads}, L, {shape.head_dim}] tensors, got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    past, n = keys.shape[2], feature.shape[1]
    z = _input(p, feature, embedded)
    q, k, v = _qkv(p, shape, z, torch.arange(past, past + n, device=z.device))
    keys, values = torch.cat([keys, k.to(keys.dtype)], 2), torch.cat([values, v.to(values.dtype)], 2)
    # causal among the new positions; every new one sees the whole cache
    mask = torch.ones(n, past + n, dtype=torch.bool, device=z.device).tril(past)
    # one new position in bfloat16 on a CPU is rewriter.maths.sdpa's fast case, as a decode step
    a = sdpa(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[None, None],
             enable_gqa=shape.heads != shape.kv_heads)  # mask [1, 1, n, L + n]
    return _finish(p, shape, z, a), (keys, values)


def tree_step(p: dict, shape: Shape, feature: Tensor, embedded: Tensor, cache: tuple,
              path: tuple | None, position: int) -> tuple:
    """Decode one draft level of a tree: ``P`` nodes at tree depth ``position - L`` (all at
    the same depth), each below its own path of earlier drafted nodes. ``feature`` and
    ``embedded`` ``[P, H]`` as in ``step``; ``cache`` ``(keys, values)`` ``[1, kv, L, d]``
    the accepted text's, shared by every node and left unchanged; ``path`` ``(keys,
    values)`` ``[P, kv, j, d]`` each node's ancestors' below the text (None: ``j = 0``),
    ``position`` ``= L + j``. Returns ``(features [P, H], keys [P, kv, 1, d], values)``:
    each node's output, and its own key and value for its children's ``path``. Equal to
    ``step`` over each node's path alone (``tests/test_eagle.py``)."""
    if feature.dim() != 2 or feature.shape != embedded.shape or feature.shape[-1] != shape.hidden:
        raise ValueError(f"eagle.tree_step: feature and embedded must both be [P, "
                         f"{shape.hidden}], got {tuple(feature.shape)} and {tuple(embedded.shape)}")
    n, kv, d = feature.shape[0], shape.kv_heads, shape.head_dim
    keys, values = _pair(cache, "cache")
    if keys.dim() != 4 or keys.shape != values.shape or keys.shape[:2] != (1, kv) or keys.shape[3] != d:
        raise ValueError(f"eagle.tree_step: the cache must be two [1, {kv}, L, {d}] tensors, "
                         f"got {tuple(keys.shape)} and {tuple(values.shape)}")
    j = 0
    if path is not None:
        pk, pv = _pair(path, "path")
        if pk.dim() != 4 or pk.shape != pv.shape or pk.shape[:2] != (n, kv) or pk.shape[3] != d:
            raise ValueError(f"eagle.tree_step: path must be two [{n}, {kv}, j, {d}] tensors, "
                             f"got {tuple(pk.shape)} and {tuple(pv.shape)}")
        j = pk.shape[2]
    if type(position) is not int or position != keys.shape[2] + j:
        raise ValueError(f"eagle.tree_step: position {position} must be the cache's length "
                         f"{keys.shape[2]} plus the path's {j}")
    pk, pv = path if j else (None, None)
    g, k, v = tree_level(p, shape, feature[None], embedded[None], keys, values,
                         torch.tensor([keys.shape[2]], device=keys.device),
                         (pk[None], pv[None]) if j else None)
    return g[0], k[0], v[0]


def tree_level(p: dict, shape: Shape, feature: Tensor, embedded: Tensor, keys: Tensor,
               values: Tensor, lengths: Tensor, path: tuple | None) -> tuple:
    """``tree_step`` for ``B`` rows at once, unchecked (the runtime's form): ``feature`` and
    ``embedded`` ``[B, P, H]``; row ``r``'s text is ``keys[r, :, :lengths[r]]`` (``keys``,
    ``values`` ``[B, kv, T, d]``, padded past each row's length with finite values: masked
    weights are zero, and zero times NaN is not); ``path`` ``[B, P, kv, j,
    d]`` each node's ancestors' keys and values, or None (``j = 0``). Node positions are
    ``lengths[r] + j``. Returns ``(features [B, P, H], keys [B, P, kv, 1, d], values)``."""
    b, n, h = feature.shape
    kv, d = shape.kv_heads, shape.head_dim
    j = 0 if path is None else path[0].shape[3]
    z = _input(p, feature.reshape(b * n, 1, h), embedded.reshape(b * n, 1, h))  # [B*P, 1, H]
    at = (lengths + j).repeat_interleave(n)[:, None]  # [B*P, 1]: each node's position
    q, k, v = _qkv(p, shape, z, at)  # [B*P, h, 1, d], [B*P, kv, 1, d]
    k, v = k.to(keys.dtype).view(b, n, kv, 1, d), v.to(values.dtype).view(b, n, kv, 1, d)
    own_k = torch.cat([path[0], k], 3) if j else k  # [B, P, kv, j + 1, d]: ancestors and itself
    own_v = torch.cat([path[1], v], 3) if j else v
    a = _tree_attention(q.view(b, n, shape.heads, d), keys, values, lengths, own_k.to(q.dtype),
                        own_v.to(q.dtype), shape)  # [B*P, h, 1, d]
    return _finish(p, shape, z, a)[:, 0].view(b, n, h), k, v


def _tree_attention(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, own_k: Tensor,
                    own_v: Tensor, shape: Shape) -> Tensor:
    """Each node's attention ``[B*P, h, 1, d]``, its queries ``q`` ``[B, P, h, d]``, over
    its row's text (``keys``, ``values`` ``[B, kv, T, d]``, the first ``lengths[r]``) and
    its own path's keys ``[B, P, kv, j + 1, d]``, one softmax over both.

    A row's text keys are read once for its ``P`` nodes and every query head of a group (a
    node's queries as rows of one ``[kv, P * g, d]`` product), not copied ``P`` times and
    repeated per head: on a CPU, bfloat16 ``scaled_dot_product_attention`` over such
    copies cost 0.38 ms a level against 0.07 for this. (bfloat16 products on a CPU go to
    oneDNN, which builds a kernel for every new shape: the runtime passes ``T`` in steps of
    256, ``runtime.decoding.tree.eagle_rows``, so a growing text does not make a new one every round.)"""
    b, n, _, d = q.shape
    kv = shape.kv_heads
    g = shape.heads // kv
    t = keys.shape[2]
    text_k, text_v = keys.to(q.dtype), values.to(q.dtype)  # [B, kv, T, d]
    qg = q.reshape(b, n, kv, g, d)  # head kv * g + i reads key/value head kv (repeat_interleave's)
    rows = qg.permute(0, 2, 1, 3, 4).reshape(b, kv, n * g, d)  # [B, kv, P * g, d]
    on_text = (rows @ text_k.transpose(-1, -2)).view(b, kv, n, g, t).permute(0, 2, 1, 3, 4)  # [B, P, kv, g, T]
    past = torch.arange(t, device=q.device) >= lengths[:, None]  # [B, T]: padding
    on_text = on_text.masked_fill(past[:, None, None, None], float("-inf"))
    on_path = qg @ own_k.transpose(-1, -2)  # [B, P, kv, g, j + 1]
    w = torch.softmax(torch.cat([on_text, on_path], -1).float() / math.sqrt(d), -1).to(q.dtype)
    w_text = w[..., :t].permute(0, 2, 1, 3, 4).reshape(b, kv, n * g, t)  # [B, kv, P * g, T]
    a = (w_text @ text_v).view(b, kv, n, g, d).permute(0, 2, 1, 3, 4) + w[..., t:] @ own_v
    return a.reshape(b * n, shape.heads, 1, d)  # [B, P, kv, g, d] -> [B*P, h, 1, d]


def _pair(v, what: str) -> tuple:
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(isinstance(t, Tensor) for t in v):
        raise ValueError(f"eagle.tree_step: {what} must be (keys, values) tensors")
    return v[0], v[1]


def empty_cache(shape: Shape, batch: int, dtype=torch.float32, device=None) -> tuple:
    """A cache of no positions, for ``step``."""
    t = torch.zeros(batch, shape.kv_heads, 0, shape.head_dim, dtype=dtype, device=device)
    return t, t.clone()


def unroll(p: dict, shape: Shape, features: Tensor, embedded_next: Tensor, depth: int) -> list:
    """Train: ``depth`` draft steps at every position of whole rows. ``features`` ``[B, L,
    H]`` the model's; ``embedded_next`` ``[B, L, H]`` the embedding of ``x_{i+1}`` at
    position ``i``. Returns ``depth`` tensors ``[B, L, H]``: step ``s``'s (1-based) output
    at position ``i`` guesses the feature after ``x_{i+1}`` in the chain started at
    ``i - s + 1`` (at ``i < s - 1`` no chain starts: garbage, not to be read)."""
    if type(depth) is not int or depth < 1:
        raise ValueError(f"eagle.unroll: depth must be a positive int, got {depth!r}")
    if features.shape != embedded_next.shape or features.dim() != 3 or features.shape[-1] != shape.hidden:
        raise ValueError(f"eagle.unroll: features and embedded_next must both be [B, L, "
                         f"{shape.hidden}], got {tuple(features.shape)} and "
                         f"{tuple(embedded_next.shape)}")
    length = features.shape[1]
    pos = torch.arange(length, device=features.device)
    z = _input(p, features, embedded_next)
    q, k1, v1 = _qkv(p, shape, z, pos)
    k1, v1 = _repeat(k1, shape), _repeat(v1, shape)  # [B, h, L, d]
    outs = [_finish(p, shape, z, F.scaled_dot_product_attention(q, k1, v1, is_causal=True))]
    scale = 1.0 / math.sqrt(shape.head_dim)
    chain_k, chain_v = [], []  # steps 2..s: [B, h, L, d] each, at their own positions
    for s in range(2, depth + 1):
        before = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)  # g_{i-1}
        z = _input(p, before, embedded_next)
        q, k, v = _qkv(p, shape, z, pos)
        chain_k.append(_repeat(k, shape))
        chain_v.append(_repeat(v, shape))
        # the context: step 1's keys at j <= t = i - s + 1
        ctx = (q @ k1.transpose(-1, -2)) * scale  # [B, h, L, L]
        ctx = ctx.masked_fill(pos[None, :] > pos[:, None] - s + 1, float("-inf"))
        # the chain's own keys: step m's at i - (s - m), m = 2 .. s (the last: its own)
        scores, vals = [], []
        for m, (km, vm) in enumerate(zip(chain_k, chain_v), start=2):
            shift = min(s - m, length)  # rows shorter than the chain: all padding
            km = torch.cat([torch.zeros_like(km[:, :, :shift]), km[:, :, :length - shift]], 2)
            vals.append(torch.cat([torch.zeros_like(vm[:, :, :shift]), vm[:, :, :length - shift]], 2))
            sc = (q * km).sum(-1, keepdim=True) * scale  # [B, h, L, 1]
            scores.append(sc.masked_fill((pos < shift)[:, None], float("-inf")))
        w = torch.softmax(torch.cat([ctx, *scores], -1), -1)  # [B, h, L, L + s - 1]
        a = w[..., :length] @ v1
        for j, vm in enumerate(vals):
            a = a + w[..., length + j:length + j + 1] * vm
        outs.append(_finish(p, shape, z, a))
    return outs
