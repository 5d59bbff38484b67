"""Layer spans: where the residual stream enters and leaves each decoder layer.

``info["layers"]`` is ``[{"index", "input", "output"}]`` with node names, derived from the
``meta["layer"]`` marks the frontend puts on nodes; the verifier checks it after every pass.
"""
from __future__ import annotations

import torch
from torch import fx

from rewriter.ops import OPS, op_arguments


def layer_spans(gm: fx.GraphModule) -> list[dict]:
    """``[{"index", "input", "output"}]`` for every layer whose border is one value each way.

    A layer's input is the residual stream entering it: the one value from outside the
    layer with the same shape and dtype as the layer's output (the rotary tables and the
    inputs enter too, but they are not that stream).
    """
    shared = _shared_edges(gm)
    by_layer: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if "layer" in n.meta and n.op == "call_function":
            by_layer.setdefault(n.meta["layer"], []).append(n)
    spans = []
    for index in sorted(by_layer):
        nodes = by_layer[index]
        inside = set(nodes)
        # Tuple-valued nodes (a fused add + norm) are not the stream: their parts are; nor
        # is an integer value a layer hands on (TidalDecode's token selection).
        outputs = [n for n in nodes if any(u not in inside and (n, u) not in shared for u in n.users)
                   and isinstance(n.meta.get("val"), torch.Tensor)
                   and n.meta["val"].is_floating_point()]
        if len(outputs) != 1:
            continue
        out_val = outputs[0].meta.get("val")
        inputs = {a for n in nodes for a in n.all_input_nodes
                  if a not in inside and a.op == "call_function" and (a, n) not in shared
                  and a.meta.get("role") != "rope_table" and _like(a.meta.get("val"), out_val)}
        if len(inputs) == 1:
            spans.append({"index": index, "input": inputs.pop().name, "output": outputs[0].name})
    return spans


def _like(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.dim() == b.dim())


def _shared_edges(gm: fx.GraphModule) -> set:
    """``(k or v, reader)`` for each attention op reading another layer's cache
    (``kv_source``): the owner's K/V flow into the reader without being the residual stream."""
    edges = set()
    for n in gm.graph.find_nodes(op="call_function", target=OPS["attention"]):
        args = op_arguments("attention", tuple(n.args), dict(n.kwargs))
        if args["kv_source"] is not None:
            edges |= {(args["k"], n), (args["v"], n)}
    return edges
