"""Frontend: trace a model (``trace``), lift it into canonical ops (``lift``), and record its
layer structure (``annotate``). ``build_ir`` runs all three."""
from __future__ import annotations

import torch
from torch import nn

from rewriter.ir.cacheable import uncacheable

from rewriter.ir.core import IR
from rewriter.ir.shapes import lm_input_specs, propagate_shapes, specs_from_placeholders
from rewriter.ir.layers import layer_spans
from rewriter.frontend.annotate import annotate
from rewriter.frontend.lift import Lifter
from rewriter.frontend.trace import trace


def build_ir(model: nn.Module, example_inputs: tuple | None = None) -> IR:
    device = next(iter(model.parameters()), torch.empty(0)).device
    if device.type == "cpu":
        return _build_ir(model, example_inputs)
    # Traced on the CPU: export on CUDA records guards from CUDA-only kernel choices (the
    # sequence length's alignment) that no graph for every length satisfies. The graph's
    # tensors then move to the model's device, and its shapes are propagated there.
    model.to("cpu")
    try:
        ir = _build_ir(model, tuple(t.cpu() for t in example_inputs) if example_inputs else None)
    finally:
        model.to(device)
    move_graph(ir.gm, device)
    for n in ir.gm.graph.nodes:
        n.meta.pop("val", None)
    propagate_shapes(ir.gm, ir.info["inputs"])
    return ir


def move_graph(gm, device: torch.device) -> None:
    """Every tensor the graph reads (parameters, buffers, and constants held as plain
    attributes) onto ``device``."""
    gm.to(device)
    for n in gm.graph.find_nodes(op="get_attr"):
        *path, name = n.target.split(".")
        owner = gm.get_submodule(".".join(path))
        value = getattr(owner, name)
        if isinstance(value, torch.Tensor) and value.device != device \
                and name not in owner._parameters and name not in owner._buffers:
            setattr(owner, name, value.to(device))


def _build_ir(model: nn.Module, example_inputs: tuple | None) -> IR:
    traced = trace(model, example_inputs)
    specs = lm_input_specs() if traced.is_causal_lm else specs_from_placeholders(traced.gm)
    lifter = Lifter(traced)
    gm = lifter.run(causal_lm=traced.is_causal_lm)
    annotate(gm, traced.scope_prefix, lifter.layer_container)
    propagate_shapes(gm, specs)
    info = {
        "family": model_family(model),
        "causal_lm": traced.is_causal_lm,
        "config": model.config.to_dict() if hasattr(model, "config") else {},
        "inputs": specs,
        "lift_report": lifter.report,
    }
    if traced.is_causal_lm:  # what the KV-cache runtime will refuse, by module path
        left_as_aten = [f.module for f in uncacheable(gm, specs) if f.kind == "attention"]
        info["unlifted_attention"] = list(dict.fromkeys(lifter.unlifted_attention + left_as_aten))
        info["unlifted_embeddings"] = lifter.unlifted_embeddings
    ir = IR(gm, info)
    info["layers"] = layer_spans(gm)
    return ir


def model_family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) or type(model).__name__
