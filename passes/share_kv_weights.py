"""Adapted weights for ``ShareKV(weights=FILE)``: the tensors ``rewriter train-share``
trained (``rewriter.training.train_share``) so a model not trained to share its KV cache
works with the map it was adapted to.

Which tensors sharing changes, found in the IR (any model rewriter loads, GGUF included):
each owner's K and V projections and what only they feed (a per-layer k norm, a bias),
walking back from the attention op's ``k`` and ``v`` inputs through rotations, reshapes
and norms to the linear op; with ``queries``, the readers' query projections the same way
from ``q``. Their weights are named as the IR names them (``model.layers.2.self_attn.
k_proj.weight``), which is how the file keys them.

The file is safetensors with JSON metadata, read as hostile: format and version, the
sharing map ``{reader: owner}`` it was trained for, the model's identity (its LM head's
first weights and the attention layers' shape), and the training's report. ``load_into``
refuses by name a file made for another map or model, a tensor the map does not train,
one it lacks, or one of the wrong shape, dtype or with NaN or infinite values.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

import torch
from torch import fx

from rewriter.drafts.heads import ASSETS as HEADS_ASSETS, PROBE, probe_of
from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.nodes import attention_args
from rewriter.ir.sharing import attention_by_layer
from rewriter.ops import OPS
from rewriter.values import parse_json

FORMAT, VERSION = "rewriter-share-kv", 1
ASSETS = HEADS_ASSETS.parent / "share_kv"  # rewriter/assets/ (passes/ installs elsewhere)
SHIPPED = ("default",)  # adapted for the shipped default model's CLA2 (every=2)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def resolve(weights: Union[str, os.PathLike]) -> Path:
    """A weights file's path: a shipped name (``default``) or a path."""
    if isinstance(weights, str) and weights in SHIPPED:
        return ASSETS / f"{weights}.safetensors"
    return Path(weights)


def projection_weights(node) -> list[str]:
    """The weights (IR names) on the way from the linear op that makes ``node`` to it:
    the linear's weight and bias, and the norms after it; [] without such a linear."""
    names: list[str] = []
    while isinstance(node, fx.Node) and node.op == "call_function":
        names += [a.target for a in node.args[1:] if isinstance(a, fx.Node) and a.op == "get_attr"]
        if node.target in (OPS["linear"], OPS["linear_int4"]):
            return names
        node = node.args[0] if node.args else None
    return []


def trained_names(ir: IR, pairs: dict[int, int], queries: bool) -> dict[str, list[str]]:
    """``{"kv": [...], "q": [...]}``: the weights adaptation trains in the shared IR (the
    owners' K/V projections; with ``queries``, the readers' query projections)."""
    by_layer = attention_by_layer(ir.graph)
    kv, q = [], []
    for owner in sorted(set(pairs.values())):
        args = attention_args(by_layer[owner])
        kv += projection_weights(args["k"]) + projection_weights(args["v"])
    if queries:
        for reader in sorted(pairs):
            q += projection_weights(attention_args(by_layer[reader])["q"])
    return {"kv": list(dict.fromkeys(kv)), "q": list(dict.fromkeys(q))}


def identity(ir: IR) -> dict:
    """What identifies the model a file was trained for: its LM head's first weights and
    its attention layers' count, KV heads and head size."""
    (out,) = ir.graph.find_nodes(op="output")
    logits = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    head = logits.args[1] if isinstance(logits, fx.Node) and len(logits.args) > 1 else None
    probe = probe_of(ir.weight(head.target).float()) if isinstance(head, fx.Node) \
        and head.op == "get_attr" else None
    by_layer = attention_by_layer(ir.graph)
    first = attention_args(next(iter(by_layer.values())))
    return {"layers": len(by_layer), "num_kv_heads": first["num_kv_heads"],
            "head_dim": first["head_dim"], "probe": probe}


def save(path: Union[str, os.PathLike], tensors: dict, pairs: dict[int, int], model: dict,
         trained: dict) -> None:
    """Write the adapted tensors with the map and model they belong to (atomically)."""
    from rewriter.files import tensor_files
    meta = {"format": FORMAT, "version": str(VERSION),
            "sources": json.dumps({str(r): o for r, o in sorted(pairs.items())}),
            "model": json.dumps(model), "trained": json.dumps(trained)}
    tensor_files.save(path, tensors, meta)


def read_meta(path: Path) -> dict:
    """A weights file's metadata, checked: ``{"sources", "model", "trained"}``."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors' own parse errors: a truncated or foreign file
        raise ValueError(f"{path}: not a safetensors file ({' '.join(str(e).split())})") from None
    if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
        raise ValueError(f"{path}: not a {FORMAT} file of version {VERSION}")
    try:
        fields = {k: parse_json(meta.get(k, "")) for k in ("sources", "model", "trained")}
    except ValueError as e:
        raise ValueError(f"{path}: bad metadata ({e})") from None
    sources = fields["sources"]
    if not isinstance(sources, dict) or not all(
            isinstance(r, str) and r.isdigit() and type(o) is int for r, o in sources.items()):
        raise ValueError(f"{path}: bad metadata (sources must map layers to layers)")
    if not isinstance(fields["model"], dict) or not isinstance(fields["trained"], dict):
        raise ValueError(f"{path}: bad metadata (model and trained must be objects)")
    return {**fields, "sources": {int(r): o for r, o in sources.items()}}


def load_into(ir: IR, weights: Union[str, os.PathLike], pairs: dict[int, int], who: str) -> dict:
    """Load the file's tensors into ``ir`` (already shared by ``pairs``) in place of its
    weights of those names; returns the file's metadata. ``PassError`` naming the file and
    the problem when it does not belong to this map and model."""
    path = resolve(weights)
    if not path.is_file():
        raise PassError(f"{who}: {path}: no such weights file")
    try:
        meta = read_meta(path)
    except ValueError as e:
        raise PassError(f"{who}: {e}") from None
    if meta["sources"] != pairs:
        raise PassError(f"{who}: {path} was trained for the sharing map {meta['sources']}; "
                        f"this pass shares {pairs}")
    _check_model(ir, meta["model"], path, who)
    names = trained_names(ir, pairs, queries=True)
    tensors = _read_tensors(ir, path, names, who)
    for name, t in tensors.items():  # fresh tensors: the traced model's stay as they were
        ir.add_weight(name, t.to(ir.weight(name).dtype).clone())
    return meta


def _check_model(ir: IR, model: dict, path: Path, who: str) -> None:
    mine = identity(ir)
    for key in ("layers", "num_kv_heads", "head_dim"):
        if model.get(key) != mine[key]:
            raise PassError(f"{who}: {path} was trained for another model ({key} "
                            f"{model.get(key)!r}; this one has {mine[key]})")
    probe = model.get("probe")
    try:
        same = mine["probe"] is not None and torch.allclose(
            torch.tensor(probe, dtype=torch.float32), torch.tensor(mine["probe"]),
            rtol=0.02, atol=0.02)
    except (TypeError, ValueError, RuntimeError):  # not a [4][8] list of numbers
        same = False
    if not same or list(torch.tensor(mine["probe"]).shape) != list(PROBE):
        raise PassError(f"{who}: {path} was trained for another model (its LM head's "
                        f"weights differ from this model's)")


def _read_tensors(ir: IR, path: Path, names: dict, who: str) -> dict:
    """The file's tensors, each a weight the map trains, all the owners' K/V there, with
    the IR weight's shape, a float dtype and finite values; shapes checked before any
    tensor's data is read."""
    from safetensors import safe_open
    allowed = set(names["kv"]) | set(names["q"])
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        extra, missing = sorted(keys - allowed), sorted(set(names["kv"]) - keys)
        if extra or missing:
            what = f"holds {extra[0]}, which this sharing does not train" if extra else \
                f"lacks {missing[0]}, an owner's K/V weight"
            raise PassError(f"{who}: {path} {what}")
        for name in sorted(keys):
            shape, want = f.get_slice(name).get_shape(), list(ir.weight(name).shape)
            if list(shape) != want:
                raise PassError(f"{who}: {path}: {name} is {list(shape)}; the model's is {want}")
        tensors = {name: f.get_tensor(name) for name in sorted(keys)}
    for name, t in tensors.items():
        if t.dtype not in _FLOATS:
            raise PassError(f"{who}: {path}: {name} is {t.dtype}, not a float tensor")
        # in the model's dtype: 1e5 is finite in float32 and infinite in float16
        if not bool(torch.isfinite(t.to(ir.weight(name).dtype)).all()):
            raise PassError(f"{who}: {path}: {name} holds NaN or infinite values (in the "
                            f"model's {ir.weight(name).dtype})")
    return tensors
