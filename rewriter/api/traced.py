"""``trace()``: trace and lift a model once, then ``optimize`` it with many pipelines.

    traced = rewriter.trace(model, tokenizer=tokenizer)
    fused = rewriter.optimize(traced, passes=[FuseQKV(), FuseSwiGLU()])
    skip = rewriter.optimize(traced, passes=[LayerSkip(speedup=1.5)])

Tracing (``torch.export``) and lifting take most of ``optimize``'s time, so comparing
pipelines pays for them once. Each ``optimize`` of a traced model works on its own copy of
the lifted IR: one pipeline's passes never change another's. The copies share the weights
(passes replace a weight, they never write into one), so a copy costs no memory.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import fx, nn

from rewriter.frontend import build_ir
from rewriter.ir.core import IR
from rewriter.ir.verify import verify
from rewriter.runtime.chat import split_tokenizer
from rewriter.values import check_flag


class TracedModel:
    """A model traced and lifted into the IR, before any pass: ``rewriter.optimize`` takes
    it in place of the model. ``tokenizer`` is the one ``optimize`` keeps when it is given
    none; ``seconds`` is how long tracing and lifting took."""

    def __init__(self, ir: IR, tokenizer=None, seconds: float = 0.0):
        self._ir = ir
        self.tokenizer = tokenizer
        self.seconds = seconds

    @property
    def ir(self) -> IR:
        """A copy of the lifted IR (to print or study; changing it leaves this one alone)."""
        return copy_ir(self._ir)

    @property
    def device(self) -> torch.device:
        return next(iter(self._ir.weights().values()), torch.empty(0)).device

    def __repr__(self) -> str:
        return f"TracedModel({self._ir.summary()}, {self.seconds:.1f} s to trace)"


def trace(model: nn.Module, tokenizer=None, example_inputs: tuple | None = None,
          check: bool = True) -> TracedModel:
    """Trace ``model`` and lift it into the IR once, for ``rewriter.optimize(traced,
    passes)`` as many times as there are pipelines to compare.

    ``tokenizer`` (as ``optimize`` takes it) is kept with every result; ``example_inputs``
    is needed only for modules that are not Hugging Face causal LMs; ``check`` verifies the
    lifted IR. The model's dtype and device are the traced model's: a pipeline that wants
    another dtype traces a copy cast to it.
    """
    check_model(model)
    check_flag("check", check)
    split_tokenizer(tokenizer)  # a tokenizer of the wrong kind fails now, before the trace
    start = time.perf_counter()
    ir = build_ir(model, example_inputs)
    if check:
        verify(ir)
    return TracedModel(ir, tokenizer, time.perf_counter() - start)


def check_model(model) -> None:
    """A model of the wrong kind is a TypeError that says what is expected."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a Hugging Face causal LM) or a "
                        f"model rewriter.trace returned, got {type(model).__name__}; "
                        f"rewriter.from_pretrained reads a checkpoint")


def copy_ir(ir: IR) -> IR:
    """A copy of ``ir`` with its own graph, modules and info, sharing the weights; new nodes
    a pass makes in the copy get the names they would get in ``ir`` itself."""
    memo = {id(t): t for t in _tensors(ir.gm)}
    gm = copy.deepcopy(ir.gm, memo)
    _carry_names(ir.graph, gm.graph)
    return IR(gm, copy.deepcopy(ir.info))


def _tensors(gm: fx.GraphModule):
    """Every tensor the module holds: parameters, buffers, and constants kept as plain
    attributes (the graph's ``get_attr`` targets)."""
    for _, t in gm.named_parameters(remove_duplicate=False):
        yield t
    for _, t in gm.named_buffers(remove_duplicate=False):
        yield t
    for n in gm.graph.find_nodes(op="get_attr"):
        value = gm
        for part in n.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            yield value


def _carry_names(source: fx.Graph, target: fx.Graph) -> None:
    """fx names a new node after the names its graph ever used (erased nodes' too) and a
    counter per base name; a copied graph knows only its live nodes' names, so without
    these a pass would name its nodes differently in a copy, and the IR would read
    differently from the one ``optimize(model)`` prints."""
    names, copied = source._graph_namespace, target._graph_namespace
    copied._used_names |= names._used_names
    copied._base_count.update(names._base_count)
