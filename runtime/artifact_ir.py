"""An artifact's ``ir.json`` data and weights -> a verified IR, or one ``ArtifactError``.

What the contents may say, checked in this order (every failure names the file and the
field, node or weight, never a raw IndexError from deep inside fx or torch):

1. ``ir.json`` is ``{"graph", "weights", "info"}`` and each field has its type
   (``check_info``); ``weights`` names a tensor of the weights file for every weight the
   graph reads, and the file holds no tensor that nothing reads;
2. the graph is rebuilt by ``rewriter.ir.serialize.graph_from_data``: identifiers only,
   known functional ops, attributes by the rules in ``rewriter.ops``;
3. shapes propagate over the real weights (a mis-shaped weight fails here, by op) and
   the IR verifies; its layer spans are the ones ``info`` records;
4. the manifest, the config, the weights and the IR agree (``runtime.artifact_agreement``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import torch

from rewriter.decoding import current
from rewriter.errors import ArtifactError, VerificationError
from rewriter.ir.core import IR
from rewriter.ir.layers import layer_spans
from rewriter.ir.serialize import IRDataError, check_weight_path, graph_from_data
from rewriter.ir.shapes import lm_input_specs, propagate_shapes
from rewriter.ir.verify import verify

from .artifact_agreement import check_agreement
from .artifact_info import check_info
from rewriter.values import shown


class Paths(NamedTuple):
    """Where the parts came from, for messages."""
    ir: Path
    manifest: Path
    weights: Path


IR_KEYS = {"graph", "weights", "info"}


def ir_from_data(ir_data, weights: dict[str, torch.Tensor], manifest: dict, where: Paths) -> IR:
    """The IR that ``ir_data`` (parsed ``ir.json``) describes over ``weights`` (the
    weights file's tensors by stored name), checked against ``manifest``."""
    try:
        return _ir_from_data(ir_data, weights, manifest, where)
    except ArtifactError:
        raise
    except Exception as e:  # a safety net behind the checks: none known to reach it
        raise ArtifactError(f"{where.ir}: cannot be read ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from e


def _ir_from_data(ir_data, weights: dict, manifest: dict, where: Paths) -> IR:
    if not isinstance(ir_data, dict) or set(ir_data) != IR_KEYS:
        keys = sorted(ir_data) if isinstance(ir_data, dict) else type(ir_data).__name__
        raise ArtifactError(f"{where.ir}: must hold exactly {sorted(IR_KEYS)}, got {keys}")
    info = ir_data["info"]
    try:
        check_info(info)
    except ValueError as e:
        raise ArtifactError(f"{where.ir}: info: {e}") from None
    if info.get("decoding") is not None:  # an older version's record, read as this version's
        info = {**info, "decoding": current(info["decoding"])}
    by_name = _weights_by_name(ir_data["weights"], weights, where)
    try:
        gm = graph_from_data(ir_data["graph"], by_name)
    except IRDataError as e:
        raise ArtifactError(f"{where.ir}: {e}") from None
    unread = sorted(set(by_name) - {n.target for n in gm.graph.find_nodes(op="get_attr")})
    if unread:
        raise ArtifactError(f"{where.ir}: weights lists {_few(unread)}, which no node reads")
    ir = IR(gm, info)
    _check_inputs(ir, where)
    _propagate(ir, where)
    _check_sizes(ir, where)
    try:
        verify(ir)
    except VerificationError as e:
        raise ArtifactError(f"{where.ir}: {e}") from None
    if layer_spans(gm) != info["layers"]:
        raise ArtifactError(f"{where.ir}: info layers {shown(info['layers'], 120)} are not the "
                            f"graph's layer spans {shown(layer_spans(gm), 120)}")
    check_agreement(ir, manifest, where)
    return ir


def _weights_by_name(names, stored: dict[str, torch.Tensor], where: Paths) -> dict:
    """IR weight name -> tensor; every stored tensor is used, every named one exists."""
    if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
        raise ArtifactError(f"{where.ir}: weights must map weight names to stored tensor "
                            f"names, got {shown(names, 120)}")
    for name in names:
        try:
            check_weight_path(name)
        except IRDataError as e:
            raise ArtifactError(f"{where.ir}: {e}") from None
    missing = sorted({v for v in names.values() if v not in stored})
    if missing:
        raise ArtifactError(f"{where.ir}: weights names {_few(missing)}, which {where.weights} "
                            f"does not hold")
    extra = sorted(set(stored) - set(names.values()))
    if extra:
        raise ArtifactError(f"{where.weights}: holds {_few(extra)}, which {where.ir} does not "
                            f"use")
    return {name: stored[s] for name, s in names.items()}


def _check_inputs(ir: IR, where: Paths) -> None:
    """One placeholder per input spec; a causal LM's are ``input_ids`` and ``positions``."""
    placeholders = list(ir.graph.find_nodes(op="placeholder"))
    specs = ir.info["inputs"]
    if ir.is_causal_lm and specs != lm_input_specs():
        raise ArtifactError(f"{where.ir}: info inputs of a causal LM must be {lm_input_specs()}, "
                            f"got {shown(specs, 120)}")
    if len(placeholders) != len(specs):
        raise ArtifactError(f"{where.ir}: the graph has {len(placeholders)} inputs, info inputs "
                            f"describes {len(specs)}")


def _propagate(ir: IR, where: Paths) -> None:
    """Fake-tensor shapes over the real weights; the op's own check says what does not fit."""
    try:
        propagate_shapes(ir.gm, ir.info["inputs"])
    except Exception as e:  # fake propagation raises whatever the op raises
        text = str(e)
        node = re.search(r"While executing %(\w+)", text)
        where_in = f"node {node.group(1)}: " if node else ""
        raise ArtifactError(f"{where.ir}: {where_in}shapes do not propagate over "
                            f"{where.weights.name}: {text.splitlines()[0] if text else type(e).__name__}") from e


# A node may hold at most this many times the elements of the largest weight, at one token
# of one sequence (B = S = 1): a model's activations are far smaller than its weights, and a
# few bytes of ir.json must not make generate allocate terabytes (aten.full, repeat, expand).
SIZE_FACTOR = 16


def _check_sizes(ir: IR, where: Paths) -> None:
    import sympy
    largest = max((t.numel() for t in ir.weights().values()), default=1)
    limit = SIZE_FACTOR * max(largest, 1024)
    for n in ir.graph.nodes:
        for shape in _shapes(n.meta.get("shape")):
            try:
                numel = int(sympy.prod([_at_one_token(d) for d in shape]))
            except (TypeError, ValueError):  # a size in other symbols: data-dependent
                raise ArtifactError(f"{where.ir}: node {n.name}: its size {shown(shape, 120)} "
                                    f"depends on more than batch and sequence") from None
            if numel > limit:
                raise ArtifactError(f"{where.ir}: node {n.name}: {numel} elements at one token "
                                    f"(shape {shown(shape, 120)}), more than {SIZE_FACTOR}x the "
                                    f"largest weight: refused, it would exhaust memory")


def _at_one_token(size):
    """A size expression with batch and sequence (the symbols B and S) set to 1."""
    return size.subs({s: 1 for s in size.free_symbols if s.name in ("B", "S")})


def _shapes(shape) -> list:
    """The tensor shapes in a node's ``meta["shape"]``: a tuple of sizes, a tuple of such
    (several outputs), or a single size expression (a sym_size node: no tensor)."""
    import sympy
    if not isinstance(shape, (tuple, list)):
        return []
    if all(isinstance(d, sympy.Basic) for d in shape):
        return [shape]
    return [s for part in shape for s in _shapes(part)]


def _few(names: list, limit: int = 3) -> str:
    shown = ", ".join(map(repr, names[:limit]))
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


