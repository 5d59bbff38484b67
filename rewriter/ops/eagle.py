"""The EAGLE draft layer as an op (``rewriter.drafts.eagle`` holds its maths), and the names
of its weights."""
from __future__ import annotations

import torch
from torch import Tensor

from rewriter.drafts import eagle
from rewriter.ops.registry import ShapeError, _dims, _need, _register

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
    weights = (fc_weight, fc_bias, input_norm, q_proj, k_proj, v_proj, o_proj, post_norm,
               gate_proj, up_proj, down_proj, norm)
    shape = _eagle_shape(feature, weights, num_heads, num_kv_heads, rope_theta, eps)
    p = {name: w for (_, name), w in zip(EAGLE_WEIGHTS, weights)}
    out, _ = eagle.step(p, shape, feature, embedded,
                        eagle.empty_cache(shape, feature.shape[0], feature.dtype, feature.device))
    return out
