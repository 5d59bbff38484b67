"""Tracing: a torch module becomes an ATen-level ``fx.GraphModule`` with dynamic sizes.

Hugging Face causal LMs are exported through a thin wrapper that takes token ids and
returns logits (``use_cache=False``), with the batch and sequence dimensions dynamic, so
one trace serves every ``(B, S)``. Any other module is exported with the example inputs
the caller gives; its leading dimensions are left for ``torch.export`` to keep dynamic
where the code allows (``Dim.AUTO``).
"""
from __future__ import annotations

import io
import logging
import sys
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from rewriter.errors import TraceError
from rewriter.ir.shapes import EXAMPLE_BATCH, EXAMPLE_SEQ

# A failing export prints its partial graph (a hundred lines and more) through these
# loggers and straight to sys.stderr before raising: the user gets the one-line TraceError.
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export")
# Rotary embeddings whose tables HF recomputes from the sequence length at run time: the
# trace would freeze one length's table (or fail on a data-dependent guard).
_UNLIFTABLE_ROPE = ("dynamic",)

class CausalLMLogits(nn.Module):
    """``input_ids [B, S] -> logits [B, S, V]`` over a Hugging Face causal LM."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@dataclass
class Traced:
    gm: fx.GraphModule
    root: nn.Module  # the module the graph's nn_module_stack paths are relative to
    scope_prefix: str  # prefix of module paths in the stack that belongs to the wrapper
    input_names: list[str] = field(default_factory=list)
    is_causal_lm: bool = False


def is_hf_causal_lm(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "vocab_size") and hasattr(model, "generate")


def trace(model: nn.Module, example_inputs: tuple | None = None) -> Traced:
    """Export ``model``; raise ``TraceError`` naming the module and the reason on failure."""
    model.eval()
    if is_hf_causal_lm(model):
        return _trace_causal_lm(model)
    if example_inputs is None:
        raise TraceError(
            f"cannot trace {type(model).__name__}: it is not a Hugging Face causal LM, so "
            "pass example_inputs=(tensor, ...) to rewriter.trace() or optimize()"
        )
    if (not isinstance(example_inputs, (tuple, list)) or not example_inputs
            or not all(isinstance(t, torch.Tensor) for t in example_inputs)):
        shown = (type(example_inputs).__name__ if not isinstance(example_inputs, (tuple, list))
                 else "[" + ", ".join(type(t).__name__ for t in example_inputs) + "]")
        raise TraceError(f"example_inputs must be a non-empty tuple or list of tensors, "
                         f"got {shown}")
    dynamic = tuple({d: torch.export.Dim.AUTO for d in range(min(t.dim(), 2))}
                    for t in example_inputs)
    gm = _export(model, tuple(example_inputs), dynamic)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return Traced(gm, model, scope_prefix="", input_names=names)


def _trace_causal_lm(model: nn.Module) -> Traced:
    _check_rope(model)
    vocab = model.config.vocab_size
    max_len = getattr(model.config, "max_position_embeddings", None) or 4096
    ids = torch.randint(0, vocab, (EXAMPLE_BATCH, EXAMPLE_SEQ),
                        generator=torch.Generator().manual_seed(0))
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=max_len)
    gm = _export(CausalLMLogits(model), (ids,), ({0: batch, 1: seq},))
    return Traced(gm, model, scope_prefix="model.", input_names=["input_ids"], is_causal_lm=True)


def _export(module: nn.Module, args: tuple, dynamic_shapes) -> fx.GraphModule:
    name = type(module.model if isinstance(module, CausalLMLogits) else module).__name__
    try:
        try:
            with torch.no_grad(), _quiet_export():
                ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as e:
            if "Constraints violated" not in str(e):
                raise
            # Older torch (2.11) cannot prove guards such as min(16*s, 32*s) == 16*s for
            # every length; deferring them to run-time asserts exports the same graph.
            with torch.no_grad(), _quiet_export():
                ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False,
                                         prefer_deferred_runtime_asserts_over_guards=True)
    except Exception as e:  # export raises many types; the user needs the first line of one
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TraceError(f"cannot trace {name}: {type(e).__name__}: {reason}") from e
    gm = ep.module()
    _drop_export_guards(gm)
    return gm


_RUNTIME_ASSERTS = (torch.ops.aten._assert_scalar.default,
                    torch.ops.aten.sym_constrain_range_for_size.default)


def _check_rope(model: nn.Module) -> None:
    """Refuse, before tracing, a rotary embedding the lifter cannot lift, by its type."""
    config = model.config
    for key in ("rope_scaling", "rope_parameters"):
        for rope_type in _rope_types(getattr(config, key, None)):
            if any(bad in rope_type for bad in _UNLIFTABLE_ROPE):
                raise TraceError(
                    f"cannot trace {type(model).__name__}: its {key} has rope_type "
                    f"{rope_type!r}, which recomputes the rotary table from the sequence "
                    f"length; rewriter lifts static rotary embeddings only")


def _rope_types(params) -> list[str]:
    """Every ``rope_type`` (or legacy ``type``) in a rope dict, or a dict of them per
    layer type (Gemma 3)."""
    if not isinstance(params, dict):
        return []
    found = [str(params[k]) for k in ("rope_type", "type") if k in params]
    return found + [t for v in params.values() for t in _rope_types(v)]


@contextmanager
def _quiet_export():
    """The export loggers at ERROR and no stack traces recorded while tracing, both restored
    after; what export writes to stderr is held back, and passed on only if the export
    succeeds (a warning the user should see) rather than raises (the partial graph it
    prints then)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    held = io.StringIO()
    # Nothing reads a node's stack_trace, and recording one per node (a Python traceback,
    # symbolized, its source lines read) was a tenth of a real model's trace time.
    stack_traces = getattr(torch.fx.config, "do_not_emit_stack_traces", None)
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with redirect_stderr(held):
            yield
        sys.stderr.write(held.getvalue())
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)
        if stack_traces is None:
            del torch.fx.config.do_not_emit_stack_traces
        else:
            torch.fx.config.do_not_emit_stack_traces = stack_traces


def _drop_export_guards(gm: fx.GraphModule) -> None:
    """Remove the input-shape guard module ``ep.module()`` inserts; the IR checks its own."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    for node in list(gm.graph.nodes):  # deferred shape asserts: the IR checks its own shapes
        if node.target in _RUNTIME_ASSERTS:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
