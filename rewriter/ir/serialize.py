"""The IR as JSON data, and back, with no pickle and no stored code.

A node is ``{"name", "op", "target", "args", "kwargs", "meta"}``. Targets are names:
``rw.<op>`` (looked up in ``rewriter.ops.OPS``), ``aten.<op>.<overload>`` (looked up on
``torch.ops.aten``, accepted only if it is an ATen operator overload) or
``operator.<fn>`` from a short allow-list. ATen ops must be functional (no mutation) and
tagged core or pointwise, or be one of ``EXTRA_ATEN`` (so no file-reading op such as
``aten.from_file``). Anything else is refused by name, so loading an IR can only ever build
a graph of known operators. Node names must be Python identifiers and weight paths dotted
identifiers: torch.fx writes both into the Python source it generates for the graph, so an
unchecked name would be code. Arguments are JSON values, node references
``{"node": name}``, and tagged ``tuple``/``dtype``/``device``/``slice`` values.
"""
from __future__ import annotations

import keyword
import operator

import torch
from torch import fx

from ..ops import OPS, short_name

OPERATORS = {f.__name__: f for f in (operator.getitem, operator.add, operator.sub, operator.mul,
                                     operator.floordiv, operator.truediv, operator.neg,
                                     operator.mod, operator.pow)}
META_KEYS = ("layer", "role", "pass")
EXTRA_ATEN = {"t", "linear", "matmul", "softmax", "log_softmax", "contiguous", "reshape",
              "unsqueeze", "squeeze", "transpose", "flatten", "chunk", "split"}
_RW = {op: name for name, op in OPS.items()}


class UnknownOpError(ValueError):
    """A stored target names no known operator."""


def graph_to_data(gm: fx.GraphModule) -> list[dict]:
    return [_node_to_data(n) for n in gm.graph.nodes]


def graph_from_data(nodes: list[dict], weights: dict[str, torch.Tensor]) -> fx.GraphModule:
    """A GraphModule over ``weights`` (get_attr target -> tensor) from ``graph_to_data``."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for d in nodes:
        name, op = d["name"], d["op"]
        if not _is_identifier(name) or name in env:
            raise ValueError(f"bad node name {name!r} (not a Python identifier, or repeated)")
        args = _decode(d.get("args", []), env, name)
        kwargs = {k: _decode(v, env, name) for k, v in d.get("kwargs", {}).items()}
        if op == "output":
            graph.output(args[0])
            continue
        if op == "placeholder":
            node = graph.placeholder(name)
        elif op == "get_attr":
            check_weight_path(d["target"], name)
            if d["target"] not in weights:
                raise ValueError(f"node {name}: weight {d['target']!r} is not in the weights file")
            node = graph.get_attr(d["target"])
        elif op == "call_function":
            node = graph.call_function(resolve_target(d["target"], name), tuple(args), kwargs)
        else:
            raise ValueError(f"node {name}: unsupported node kind {op!r}")
        node.name = name
        meta = d.get("meta", {})
        node.meta.update({k: meta[k] for k in META_KEYS if k in meta
                          and isinstance(meta[k], (int, str)) and not isinstance(meta[k], bool)})
        env[name] = node
    graph.lint()
    return fx.GraphModule(weights, graph)


def _is_identifier(name) -> bool:
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def check_weight_path(path, node: str = "weights") -> None:
    """A weight name is dotted identifiers (or indices, as in ``layers.0``)."""
    parts = path.split(".") if isinstance(path, str) else [None]
    if not all(p is not None and (_is_identifier(p) or p.isdigit()) for p in parts):
        raise ValueError(f"node {node}: bad weight name {path!r}")


def allowed_aten(op) -> bool:
    """Functional ATen ops tagged core or pointwise, and the few in ``EXTRA_ATEN``."""
    if op._schema.is_mutable:
        return False
    tags = set(op.tags)
    return (torch.Tag.core in tags or torch.Tag.pointwise in tags
            or op._schema.name.split("::")[-1] in EXTRA_ATEN)


def target_name(target) -> str:
    if target in _RW:
        return f"rw.{_RW[target]}"
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and allowed_aten(target):
        return f"aten.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if OPERATORS.get(getattr(target, "__name__", None)) is target:
        return f"operator.{target.__name__}"
    raise ValueError(f"cannot store op {short_name(target)}: only rw ops, functional core or "
                     f"pointwise ATen ops and basic operator targets have a data form")


def resolve_target(name: str, node: str):
    """The operator a stored target name means, or ``UnknownOpError``."""
    ns, _, rest = name.partition(".")
    found = None
    if ns == "rw":
        found = OPS.get(rest)
    elif ns == "operator":
        found = OPERATORS.get(rest)
    elif ns == "aten" and rest.count(".") == 1:
        op, overload = rest.split(".")
        packet = getattr(torch.ops.aten, op, None) if op.isidentifier() else None
        found = getattr(packet, overload, None) if packet is not None and overload.isidentifier() else None
        found = found if isinstance(found, torch._ops.OpOverload) and allowed_aten(found) else None
    if found is None:
        raise UnknownOpError(f"node {node}: unknown op {name!r}")
    return found


def _node_to_data(n: fx.Node) -> dict:
    d = {"name": n.name, "op": n.op}
    if n.op == "get_attr":
        d["target"] = n.target
    elif n.op == "call_function":
        d["target"] = target_name(n.target)
    elif n.op not in ("placeholder", "output"):
        raise ValueError(f"node {n.name}: cannot store a {n.op} node")
    d["args"] = _encode(list(n.args), n.name)
    if n.kwargs:
        d["kwargs"] = {k: _encode(v, n.name) for k, v in n.kwargs.items()}
    meta = {k: n.meta[k] for k in META_KEYS if k in n.meta}
    if meta:
        d["meta"] = meta
    return d


def _encode(a, node: str):
    if isinstance(a, fx.Node):
        return {"node": a.name}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, list):
        return [_encode(x, node) for x in a]
    if isinstance(a, tuple):
        return {"tuple": [_encode(x, node) for x in a]}
    if isinstance(a, dict):
        return {"dict": {k: _encode(v, node) for k, v in a.items()}}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, slice):
        return {"slice": [_encode(x, node) for x in (a.start, a.stop, a.step)]}
    if isinstance(a, (torch.memory_format, torch.layout)):
        return {type(a).__name__: str(a).removeprefix("torch.")}
    raise ValueError(f"node {node}: cannot store an argument of type {type(a).__name__}")


def _decode(a, env: dict, node: str):
    if isinstance(a, list):
        return [_decode(x, env, node) for x in a]
    if not isinstance(a, dict):
        return a
    if len(a) != 1:
        raise ValueError(f"node {node}: malformed argument {a!r}")
    (tag, v), = a.items()
    if tag == "node":
        if v not in env:
            raise ValueError(f"node {node}: refers to {v!r}, which is not defined before it")
        return env[v]
    if tag == "tuple":
        return tuple(_decode(x, env, node) for x in v)
    if tag == "dict":
        return {k: _decode(x, env, node) for k, x in v.items()}
    if tag == "slice":
        return slice(*(_decode(x, env, node) for x in v))
    if tag in ("dtype", "memory_format", "layout"):
        value = getattr(torch, v, None) if isinstance(v, str) else None
        if value is None or type(value).__name__ != tag:
            raise ValueError(f"node {node}: unknown {tag} {v!r}")
        return value
    if tag == "device":
        return torch.device(v)
    raise ValueError(f"node {node}: unknown argument tag {tag!r}")
