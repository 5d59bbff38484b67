"""Bypassing decoder layers and sub-layers: the draft of self-speculative decoding.

A layer is bypassed by letting the residual stream flow past it (its output replaced by
its input); its attention (or MLP) sub-layer alone by replacing that sub-layer's residual
add ``x + branch(x)`` with ``x``. Dead nodes then go, an attention op with them, so a
draft program neither computes nor writes the caches of what it skips. The other ops keep
their ``layer`` attribute, i.e. their cache id (``runtime.kv_cache``).
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from rewriter.errors import PassError
from rewriter.ir.core import IR

_ADDS = (operator.add, torch.ops.aten.add.Tensor)


def residual_adds(ir: IR, index: int) -> list[fx.Node]:
    """The residual adds of layer ``index`` in graph order: ``[attention's, MLP's]`` in a
    sequential (pre-norm) block; ``PassError`` for any other structure (a parallel block
    such as GPT-NeoX's or Phi's has one add for both, and a fused add + norm has none)."""
    adds = [n for n in ir.graph.nodes if n.meta.get("layer") == index
            and n.meta.get("role") == "residual" and n.op == "call_function" and n.target in _ADDS]
    span = next((s for s in ir.layers if s["index"] == index), None)
    if span is None:
        raise PassError(f"layer {index} has no single residual stream in and out; it cannot "
                        f"be skipped")
    if (len(adds) != 2 or ir.node(span["input"]) not in adds[0].args
            or adds[0] not in adds[1].args or adds[1].name != span["output"]):
        raise PassError(f"layer {index} is not an attention block then an MLP block, each "
                        f"added to the residual stream, so its sub-layers cannot be skipped "
                        f"alone (skip the whole layer)")
    return adds


def skipped(ir: IR, layers=(), attention=(), mlp=()) -> IR:
    """A copy of ``ir`` (nodes copied, weights shared) with ``layers`` bypassed whole and the
    attention or MLP sub-layers of ``attention`` / ``mlp`` bypassed."""
    spans = {s["index"]: s for s in ir.layers}
    subs = {i: residual_adds(ir, i) for i in sorted(set(attention) | set(mlp))}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(ir.graph, env))
    new = {old.name: n for old, n in env.items()}
    bypass: dict[fx.Node, fx.Node] = {}  # a bypassed node -> the stream that flows past it
    cuts = [(new[spans[i]["output"]], new[spans[i]["input"]]) for i in layers]
    for i, (attn_add, mlp_add) in subs.items():
        if i in mlp:
            cuts.append((new[mlp_add.name], new[attn_add.name]))
        if i in attention:
            cuts.append((new[attn_add.name], new[spans[i]["input"]]))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for out, inp in sorted(cuts, key=lambda c: order[c[0]]):  # in graph order: runs chain through
        bypass[out] = bypass.get(inp, inp)
        out.replace_all_uses_with(bypass[out])
    graph.eliminate_dead_code()
    info = {**ir.info, "layers": [s for s in ir.layers if s["index"] not in set(layers)]}
    return IR(fx.GraphModule(ir.gm, graph), info)


def check_skip_set(ir: IR, layers, attention, mlp, empty_ok: bool = False) -> None:
    """``PassError`` unless the skip set names existing layers, leaves at least one layer's
    attention and MLP, and names sub-layers only where they can be skipped alone; and skips
    something, unless ``empty_ok`` (a draft that differs from the model otherwise)."""
    present = sorted(s["index"] for s in ir.layers)
    for name, ids in (("skip_layers", layers), ("skip_attention", attention), ("skip_mlp", mlp)):
        missing = [i for i in ids if i not in present]
        if missing:
            raise PassError(f"{name}: layer {missing[0]} is not in the model (layers "
                            f"{present[0]}..{present[-1]})" if present else
                            f"{name}: the frontend found no decoder layers in this model")
    both = set(layers) & (set(attention) | set(mlp))
    if both:
        raise PassError(f"layer {min(both)} is in skip_layers and also has a sub-layer skipped")
    whole = set(layers) | (set(attention) & set(mlp))
    if not layers and not attention and not mlp and not empty_ok:
        raise PassError("the skip set is empty: the draft would be the model itself")
    if len(whole) == len(present):
        raise PassError("the skip set skips every layer: the draft would not use the model")
    joined = layer_joining_fusion(ir)
    if (layers or attention or mlp) and joined:
        raise PassError(f"run it before {joined}: a fused add + norm joins two layers, "
                        f"so neither can be skipped alone")
    for i in sorted(set(attention) | set(mlp)):
        residual_adds(ir, i)


def layer_joining_fusion(ir: IR) -> str | None:
    """The name of a fusion that ran on ``ir`` and made ops that belong to two layers (an
    add + norm across a layer border, alone or with the sum over ranks before it)."""
    done = ir.info.get("fusions", {})
    return next((p for p in ("FuseAddRMSNorm", "FuseAllReduceRMSNorm") if done.get(p)), None)
