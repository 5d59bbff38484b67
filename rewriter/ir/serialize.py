"""The IR as JSON data, and back, with no pickle and no stored code.

A node is ``{"name", "op", "target", "args", "kwargs", "meta"}``. Targets are names:
``rw.<op>`` (looked up in ``rewriter.ops.OPS``), ``aten.<op>.<overload>`` (looked up on
``torch.ops.aten``, accepted only if it is an ATen operator overload) or
``operator.<fn>`` from a short allow-list. ATen ops must be functional (no mutation) and
tagged core or pointwise, or be one of ``EXTRA_ATEN`` (so no file-reading op such as
``aten.from_file``), and their output must be a function of their inputs: no
uninitialised memory (``aten.empty*``), no random numbers, no side effects. Anything else
is refused by name, so loading an IR can only ever build a graph of known operators.

torch.fx writes node names, keyword names and weight paths into the Python source it
generates and runs, so ``graph_from_data`` checks every field of every node before fx
sees it: names are ASCII identifiers that shadow nothing the generated code uses
(``self``, ``torch``, builtins), keyword names are identifiers, weight paths are dotted
identifiers that name no attribute a module already has; one output, last, with one
value; arguments nest at most ``MAX_DEPTH`` deep; rw ops' attributes pass the rules in
``rewriter.ops``. Arguments are JSON values, node references ``{"node": name}``, and
tagged ``tuple``/``dict``/``dtype``/``device``/``slice`` values.
"""
from __future__ import annotations

import builtins
import functools
import keyword
import math
import operator
import re

import torch
from torch import fx

from rewriter.ops import OPS, check_arguments, short_name
from rewriter.values import MAX_INT, shown

OPERATORS = {f.__name__: f for f in (operator.getitem, operator.add, operator.sub, operator.mul,
                                     operator.floordiv, operator.truediv, operator.neg,
                                     operator.mod, operator.pow)}
META_KEYS = ("layer", "role", "pass")
NODE_KEYS = {"name", "op", "target", "args", "kwargs", "meta"}
NODE_KINDS = ("placeholder", "get_attr", "call_function", "output")
# Names the generated code already uses: builtins, the globals fx adds, forward's ``self``.
RESERVED_NAMES = frozenset(dir(builtins)) | {"self", "torch", "device", "inf", "nan",
                                             "fx_pytree", "pytree", "NoneType"}
MAX_DEPTH = 8  # argument nesting; the IRs rewriter writes nest 3 deep at most
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# ATen ops whose result is not a function of their inputs: uninitialised memory or random
# numbers (the tags miss some, e.g. ``empty.memory_format`` is plain core).
NOT_FUNCTIONS = re.compile(r"empty|rand|bernoulli|normal|uniform|multinomial|dropout|poisson"
                           r"|exponential|geometric|cauchy|seed"
                           # raw memory views (an offset past the storage reads out of
                           # bounds), data-dependent sizes, a tensor's value on the host
                           r"|as_strided|nonzero|_local_scalar_dense|^item$")
EXTRA_ATEN = {"t", "linear", "matmul", "softmax", "log_softmax", "contiguous", "reshape",
              "unsqueeze", "squeeze", "transpose", "flatten", "chunk", "split"}
_RW = {op: name for name, op in OPS.items()}


class IRDataError(ValueError):
    """Stored IR data that does not describe a graph this rewriter builds."""


class UnknownOpError(IRDataError):
    """A stored target names no known operator."""


def graph_to_data(gm: fx.GraphModule) -> list[dict]:
    return [_node_to_data(n) for n in gm.graph.nodes]


def graph_from_data(nodes: list[dict], weights: dict[str, torch.Tensor]) -> fx.GraphModule:
    """A GraphModule over ``weights`` (get_attr target -> tensor) from ``graph_to_data``.

    Every node is checked before fx sees it (``IRDataError`` names the node and the
    field): fx writes names, keyword names and weight paths into the Python source it
    generates and runs, so nothing that is not a plain identifier may reach it."""
    if not isinstance(nodes, list) or not nodes:
        raise IRDataError(f"graph must be a non-empty list of nodes, got {shown(nodes)}")
    _check_order(nodes)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for d in nodes:
        _add_node(graph, d, env, weights)
    targets = {n.target for n in graph.find_nodes(op="get_attr")}
    _check_weight_tree(targets)
    try:
        graph.lint()
        return fx.GraphModule({t: weights[t] for t in targets}, graph)
    except Exception as e:  # a safety net: everything fx is given was checked above
        raise IRDataError(f"fx could not build the graph: {e}") from e


def _check_order(nodes: list) -> None:
    """One output, last, with one value; placeholders before every call."""
    kinds = [d.get("op") if isinstance(d, dict) else None for d in nodes]
    if kinds.count("output") != 1 or kinds[-1] != "output":
        raise IRDataError(f"the graph must end in exactly one output node "
                          f"({kinds.count('output')} output nodes, the last node is {kinds[-1]!r})")
    first_call = kinds.index("call_function") if "call_function" in kinds else len(kinds)
    if "placeholder" in kinds[first_call:]:
        raise IRDataError("placeholders must come before every call_function node")


def _add_node(graph: fx.Graph, d, env: dict, weights: dict) -> None:
    name, op = _check_fields(d, env)
    args = _decode(d.get("args", []), env, name, 0)
    kwargs = {k: _decode(v, env, name, 0) for k, v in d.get("kwargs", {}).items()}
    if op in ("placeholder", "get_attr", "output") and (args if op != "output" else len(args) != 1):
        raise IRDataError(f"node {name}: a {op} node takes "
                          f"{'one value' if op == 'output' else 'no arguments'}, got {shown(d['args'])}")
    if op != "call_function" and kwargs:
        raise IRDataError(f"node {name}: a {op} node takes no keyword arguments")
    if op == "output":
        graph.output(args[0])
        return
    if op == "placeholder":
        node = graph.create_node("placeholder", name, name=name)
    elif op == "get_attr":
        target = d["target"]
        check_weight_path(target, name)
        if target not in weights:
            raise IRDataError(f"node {name}: weight {target!r} is not in the weights file")
        node = graph.create_node("get_attr", target, name=name)
    else:
        fn = resolve_target(d["target"], name)
        if fn in _RW:
            try:
                check_arguments(_RW[fn], tuple(args), kwargs, lambda v: isinstance(v, fx.Node))
            except ValueError as e:
                raise IRDataError(f"node {name}: {e}") from None
        elif _holds_nan((args, kwargs)):  # JSON readers accept NaN; no IR we write holds one
            raise IRDataError(f"node {name}: a NaN constant (it would make the logits NaN)")
        node = graph.create_node("call_function", fn, tuple(args), kwargs, name=name)
    if node.name != name:  # fx renamed it: it would shadow a builtin or a global
        raise IRDataError(f"bad node name {name!r} (reserved in the code fx generates)")
    node.meta.update(d.get("meta", {}))
    env[name] = node


def _holds_nan(value) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda v: found.append(isinstance(v, float) and math.isnan(v)))
    return any(found)


def _check_fields(d, env: dict) -> tuple[str, str]:
    """(name, op) of a node dict whose every field has the type it must have."""
    if not isinstance(d, dict):
        raise IRDataError(f"a node must be an object, got {shown(d)}")
    name = d.get("name")
    if not is_identifier(name) or name in env or name in RESERVED_NAMES:
        raise IRDataError(f"bad node name {shown(name)} (not a Python identifier, reserved, "
                          f"or repeated)")
    unknown = set(d) - NODE_KEYS
    if unknown:
        raise IRDataError(f"node {name}: unknown fields {sorted(unknown)}")
    op = d.get("op")
    if op not in NODE_KINDS:
        raise IRDataError(f"node {name}: unsupported node kind {shown(op)}")
    has_target = op in ("get_attr", "call_function")
    if has_target != ("target" in d) or (has_target and not isinstance(d["target"], str)):
        raise IRDataError(f"node {name}: a {op} node {'needs a target name' if has_target else 'has no target'}"
                          f", got {shown(d.get('target'))}")
    if not isinstance(d.get("args", []), list):
        raise IRDataError(f"node {name}: args must be a list, got {shown(d['args'])}")
    kwargs = d.get("kwargs", {})
    if not isinstance(kwargs, dict) or not all(map(is_identifier, kwargs)):
        raise IRDataError(f"node {name}: kwargs must be an object keyed by identifiers, got "
                          f"{shown(kwargs)}")
    _check_meta(d.get("meta", {}), name)
    return name, op


def _check_meta(meta, node: str) -> None:
    if not isinstance(meta, dict) or set(meta) - set(META_KEYS):
        raise IRDataError(f"node {node}: meta must be an object with keys from {META_KEYS}, "
                          f"got {shown(meta)}")
    layer = meta.get("layer", 0)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= MAX_INT:
        raise IRDataError(f"node {node}: meta layer must be an integer >= 0, got {shown(layer)}")
    for key in ("role", "pass"):
        if not isinstance(meta.get(key, ""), str):
            raise IRDataError(f"node {node}: meta {key} must be a string, got {shown(meta[key])}")


def is_identifier(name) -> bool:
    """An ASCII Python identifier that is not a keyword (no Unicode: NFKC would make two
    different names one variable in the generated code)."""
    return isinstance(name, str) and _IDENTIFIER.fullmatch(name) is not None \
        and not keyword.iskeyword(name)



def check_weight_path(path, node: str = "weights") -> None:
    """A weight name is dotted identifiers (or indices, as in ``layers.0``), none of which
    is an attribute a module already has (``forward``, ``__class__``, ``training``)."""
    parts = path.split(".") if isinstance(path, str) else [None]
    if not all(p is not None and (is_identifier(p) or p.isdigit()) and not p.startswith("_")
               and p not in _module_attributes() for p in parts):
        raise IRDataError(f"node {node}: bad weight name {shown(path)}")


def _check_weight_tree(targets: set[str]) -> None:
    """No weight is also a module on another weight's path (``a`` and ``a.b``)."""
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[:i]) in targets:
                raise IRDataError(f"weight {'.'.join(parts[:i])!r} is also a module on the path "
                                  f"of weight {t!r}")


@functools.cache
def _module_attributes() -> frozenset:
    return frozenset(dir(fx.GraphModule(torch.nn.Module(), fx.Graph())))




def allowed_aten(op) -> bool:
    """Functional ATen ops tagged core or pointwise, and the few in ``EXTRA_ATEN``; never
    one whose output is not a function of its inputs (``NOT_FUNCTIONS``, seeded random
    ops) or that has side effects."""
    tags = set(op.tags)
    if (op._schema.is_mutable or torch.Tag.nondeterministic_seeded in tags
            or NOT_FUNCTIONS.search(op._schema.name.split("::")[-1])
            or op in fx.node._side_effectful_functions):
        return False
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


def _decode(a, env: dict, node: str, depth: int):
    """A stored argument as a Python value; every JSON shape not listed is refused."""
    if depth > MAX_DEPTH:
        raise IRDataError(f"node {node}: arguments nested deeper than {MAX_DEPTH}")
    if isinstance(a, list):
        return [_decode(x, env, node, depth + 1) for x in a]
    if isinstance(a, int) and not isinstance(a, bool) and not -2**63 <= a < 2**63:
        raise IRDataError(f"node {node}: integer {shown(a, 40)} is out of the 64-bit range")
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if not isinstance(a, dict) or len(a) != 1:
        raise IRDataError(f"node {node}: malformed argument {shown(a)}")
    (tag, v), = a.items()
    if tag == "node":
        if not isinstance(v, str) or v not in env:
            raise IRDataError(f"node {node}: refers to {shown(v)}, which is not defined before it")
        return env[v]
    if tag in ("tuple", "slice") and isinstance(v, list):
        items = [_decode(x, env, node, depth + 1) for x in v]
        if tag == "tuple":
            return tuple(items)
        if len(items) == 3:
            return slice(*items)
    if tag == "dict" and isinstance(v, dict):
        return {k: _decode(x, env, node, depth + 1) for k, x in v.items()}
    if tag in ("dtype", "memory_format", "layout"):
        value = getattr(torch, v, None) if isinstance(v, str) and is_identifier(v) else None
        if value is not None and type(value).__name__ == tag:
            return value
    if tag == "device" and isinstance(v, str) and _DEVICE.fullmatch(v):
        if v.startswith("cuda") and not torch.cuda.is_available():
            raise IRDataError(f"node {node}: places a tensor on {v}, and this machine has no "
                              f"CUDA device")
        return torch.device(v)
    raise IRDataError(f"node {node}: malformed {shown(tag)} argument {shown(v)}")


_DEVICE = re.compile(r"(cpu|cuda)(:[0-9]{1,3})?")  # not meta: it holds no values
