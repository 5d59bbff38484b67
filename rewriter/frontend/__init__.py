"""Frontend: trace a model (``trace``), lift it into canonical ops (``lift``), and record its
layer structure (``annotate``). ``build_ir`` runs all three."""
from __future__ import annotations

from torch import nn

from rewriter.ir.cacheable import uncacheable

from ..ir.core import IR
from ..ir.shapes import lm_input_specs, propagate_shapes, specs_from_placeholders
from ..ir.layers import layer_spans
from .annotate import annotate
from .lift import Lifter
from .trace import trace


def build_ir(model: nn.Module, example_inputs: tuple | None = None) -> IR:
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
