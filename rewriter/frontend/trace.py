"""Tracing: a torch module becomes an ATen-level ``fx.GraphModule`` with dynamic sizes.

Hugging Face causal LMs are exported through a thin wrapper that takes token ids and
returns logits (``use_cache=False``), with the batch and sequence dimensions dynamic, so
one trace serves every ``(B, S)``. Any other module is exported with the example inputs
the caller gives; its leading dimensions are left for ``torch.export`` to keep dynamic
where the code allows (``Dim.AUTO``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ..errors import TraceError
from ..ir.shapes import EXAMPLE_BATCH, EXAMPLE_SEQ



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
            "pass example_inputs=(tensor, ...) to optimize()"
        )
    dynamic = tuple({d: torch.export.Dim.AUTO for d in range(min(t.dim(), 2))}
                    for t in example_inputs)
    gm = _export(model, tuple(example_inputs), dynamic)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return Traced(gm, model, scope_prefix="", input_names=names)


def _trace_causal_lm(model: nn.Module) -> Traced:
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
        with torch.no_grad():
            ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # export raises many types; the user needs the first line of one
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TraceError(f"cannot trace {name}: {type(e).__name__}: {reason}") from e
    gm = ep.module()
    _drop_export_guards(gm)
    return gm


def _drop_export_guards(gm: fx.GraphModule) -> None:
    """Remove the input-shape guard module ``ep.module()`` inserts; the IR checks its own."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.recompile()
