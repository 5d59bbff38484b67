"""Invariants every IR keeps between passes; a broken one raises ``VerificationError``."""
from __future__ import annotations

import operator

import torch
from torch import fx

from rewriter.errors import VerificationError
from rewriter.ir.core import IR
from rewriter.ops import OPS, check_arguments

_RW_NAMES = {op: name for name, op in OPS.items()}


def verify(ir: IR, shapes: bool = True) -> None:
    """Lint, weights, layer spans; with ``shapes``, also every tensor's shape and layers."""
    try:
        ir.graph.lint()
    except Exception as e:  # lint raises RuntimeError with fx's own wording
        raise VerificationError(f"graph lint failed: {e}") from e
    names = {n.name: n for n in ir.graph.nodes}
    for n in ir.graph.nodes:
        _check_node(ir, n, shapes)
    if not shapes:
        return
    seen = set()
    for span in ir.layers:
        for end in ("input", "output"):
            if span[end] not in names:
                raise VerificationError(f"layer {span['index']}: {end} node {span[end]} is gone")
        if span["index"] in seen:
            raise VerificationError(f"layer {span['index']} appears twice")
        seen.add(span["index"])


def _check_node(ir: IR, n: fx.Node, shapes: bool) -> None:
    if n.op == "get_attr":
        try:
            ir.weight(n.target)
        except AttributeError:
            raise VerificationError(f"{n.name} reads a missing weight {n.target}") from None
    if n.op not in ("call_function", "placeholder"):
        return
    if n.op == "call_function" and not _known_target(n.target):
        raise VerificationError(f"{n.name} calls {n.target!r}, which is neither an rw nor an ATen op")
    if shapes and n.meta.get("shape") is None and isinstance(n.meta.get("val"), torch.Tensor):
        raise VerificationError(f"{n.name} has no shape")
    if n.op == "call_function" and n.target in _RW_NAMES:
        _check_rw_arguments(n)


def _check_rw_arguments(n: fx.Node) -> None:
    """The op's attributes by the rules beside it (``rewriter.ops.ATTRIBUTES``)."""
    try:
        bound = check_arguments(_RW_NAMES[n.target], n.args, n.kwargs,
                                is_tensor=lambda v: isinstance(v, fx.Node))
    except ValueError as e:
        raise VerificationError(f"{n.name}: {e}") from None
    if _RW_NAMES[n.target] == "attention" and "layer" in n.meta and bound["layer"] != n.meta["layer"]:
        raise VerificationError(f"{n.name}: attention says layer={bound['layer']} but sits in "
                                f"layer {n.meta['layer']}")


def _known_target(target) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) \
        or target is operator.getitem or getattr(target, "__module__", "").startswith("torch")
