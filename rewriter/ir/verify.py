"""Invariants every IR keeps between passes; a broken one raises ``VerificationError``."""
from __future__ import annotations

import operator

import torch
from torch import fx

from rewriter.errors import VerificationError
from rewriter.ir.core import IR
from rewriter.ir.merging import check_merging
from rewriter.ir.shard import ShardError, check_split
from rewriter.ir.sharing import cache_of, check_sharing
from rewriter.ops import OPS, check_arguments, check_context, op_arguments
from rewriter.values import context_length

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
    check_sharing(ir)
    check_merging(ir)
    if not shapes:
        return
    try:  # the split's walk reads shapes
        check_split(ir)
    except ShardError as e:
        raise VerificationError(str(e)) from None
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
        _check_rw_arguments(ir, n)
    if n.op == "call_function" and n.target is OPS["attention"]:
        _check_sparse_inputs(ir, n)


def _check_rw_arguments(ir: IR, n: fx.Node) -> None:
    """The op's attributes by the rules beside it (``rewriter.ops.ATTRIBUTES``), and the
    token counts the runtime sizes state by against the model's context length."""
    try:
        bound = check_arguments(_RW_NAMES[n.target], n.args, n.kwargs,
                                is_tensor=lambda v: isinstance(v, fx.Node))
        check_context(_RW_NAMES[n.target], bound, context_length(ir.info.get("config", {})))
    except ValueError as e:
        raise VerificationError(f"{n.name}: {e}") from None
    if _RW_NAMES[n.target] == "attention" and "layer" in n.meta and bound["layer"] != n.meta["layer"]:
        raise VerificationError(f"{n.name}: attention says layer={bound['layer']} but sits in "
                                f"layer {n.meta['layer']}")


def _known_target(target) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) \
        or target is operator.getitem or getattr(target, "__module__", "").startswith("torch")


def _check_sparse_inputs(ir: IR, n: fx.Node) -> None:
    """``rotary`` is a RoPE frequency table that fits the head; ``select`` comes from an
    ``rw.select_tokens`` on an earlier layer's own q and k, placed after that layer's
    attention, or (``TidalDecode(select_own=True)``) before it, when that attention reads
    it too (the runtime reads that layer's cache, so any other wiring would select from
    keys the graph never scored)."""
    args = op_arguments("attention", tuple(n.args), dict(n.kwargs))
    rotary, select = args["rotary"], args["select"]
    if rotary is not None:
        table = ir.weight(rotary.target) if rotary.op == "get_attr" else None
        if table is None or table.dim() != 1 or not table.is_floating_point() \
                or not 0 < 2 * table.numel() <= args["head_dim"]:
            raise VerificationError(f"{n.name}: rotary must be the model's RoPE frequencies (a "
                                    f"1-d float weight of at most head_dim/2 = {args['head_dim'] // 2})")
    if select is None:
        return
    if select.op == "call_function" and select.target is OPS["select_pages"]:
        _check_page_selection(ir, n, args, select)
        return
    if not (select.op == "call_function" and select.target is OPS["select_tokens"]):
        raise VerificationError(f"{n.name}: select must come from rw.select_tokens or "
                                f"rw.select_pages, not {select.name}")
    sel = op_arguments("select_tokens", tuple(select.args), dict(select.kwargs))
    source = [a for a in ir.graph.find_nodes(op="call_function", target=OPS["attention"])
              if op_arguments("attention", tuple(a.args), dict(a.kwargs))["layer"] == sel["layer"]]
    if not source:
        raise VerificationError(f"{select.name}: layer={sel['layer']} names no attention")
    src = op_arguments("attention", tuple(source[0].args), dict(source[0].kwargs))
    order = {node: i for i, node in enumerate(ir.graph.nodes)}
    # TidalDecode's selection follows its layer's attention; with select_own it precedes
    # it and that attention reads it too (the keys it scores are then the earlier ones)
    at, first, here = order[select], order[source[0]], order[n]
    placed = at < first <= here if src["select"] is select else first < at < here
    if not placed or (sel["q"], sel["k"]) != (src["q"], src["k"]) \
            or sel["num_kv_heads"] != args["num_kv_heads"] or src["sinks"] is not None \
            or src["cos"] is not None:  # q and k rotated inside the op: the cache's keys are not k
        raise VerificationError(f"{select.name}: it must read layer {sel['layer']}'s own rotated "
                                f"q and k after that layer's attention, or before it when that "
                                f"attention reads it too (a whole cache, {args['num_kv_heads']} "
                                f"KV heads, no rotation inside the op), and before {n.name}")


def _check_page_selection(ir: IR, n: fx.Node, args: dict, select: fx.Node) -> None:
    """Quest: the pages come from this attention's own q and k, its cache (the runtime reads
    that cache's page bounds: its owner's, for a layer sharing another's) and KV heads, and
    the op is used by this attention only."""
    sel = op_arguments("select_pages", tuple(select.args), dict(select.kwargs))
    if (sel["q"], sel["k"]) != (args["q"], args["k"]) or sel["layer"] != cache_of(args) \
            or sel["num_kv_heads"] != args["num_kv_heads"] or list(select.users) != [n] \
            or args["cos"] is not None:
        raise VerificationError(f"{select.name}: it must read {n.name}'s own rotated q and k "
                                f"(cache {cache_of(args)}, {args['num_kv_heads']} KV heads) and "
                                f"feed that attention only")
