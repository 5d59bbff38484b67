"""The IR as text: one line per node with its op, arguments, shape/dtype, layer and role.

    %rms_norm = rw.rms_norm(%embedding, @model.layers.0.input_layernorm.weight, eps=1e-06)  f32[B, S, 64]  # L0 norm
"""
from __future__ import annotations

import torch
from torch import fx

from rewriter.ops import short_name

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int64: "i64", torch.int32: "i32", torch.bool: "bool", torch.int8: "i8",
           torch.uint8: "u8"}


def format_type(val, shape) -> str:
    if isinstance(val, torch.Tensor):
        dims = ", ".join(str(s) for s in shape) if shape is not None else ""
        return f"{_DTYPES.get(val.dtype, str(val.dtype))}[{dims}]"
    if isinstance(val, torch.SymInt):
        return f"int({shape})"
    if isinstance(val, (tuple, list)) and shape is not None:
        return "(" + ", ".join(format_type(v, s) for v, s in zip(val, shape)) + ")"
    return ""


def format_arg(a) -> str:
    if isinstance(a, fx.Node):
        return f"@{a.target}" if a.op == "get_attr" else f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(format_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, float):
        return f"{a:.6g}"
    if isinstance(a, torch.dtype):
        return _DTYPES.get(a, str(a))
    return repr(a) if isinstance(a, str) else str(a)


def format_call(n: fx.Node) -> str:
    args = [format_arg(a) for a in n.args]
    schema = getattr(n.target, "_schema", None)
    if schema is not None and n.target.namespace == "rw":
        # Name the attributes (non-node arguments) of our own ops: layer=3, eps=1e-06.
        formal = schema.arguments
        args = [s if "Tensor" in str(formal[i].type) else f"{formal[i].name}={s}"
                for i, s in enumerate(args)]
    args += [f"{k}={format_arg(v)}" for k, v in n.kwargs.items()]
    return f"{short_name(n.target)}({', '.join(args)})"


def format_node(n: fx.Node) -> str | None:
    if n.op in ("placeholder", "get_attr"):
        return None
    if n.op == "output":
        return "  return " + format_arg(n.args[0])
    call = format_call(n) if n.op == "call_function" else f"{n.op}[{n.target}]"
    typ = format_type(n.meta.get("val"), n.meta.get("shape"))
    where = " ".join(x for x in (
        f"L{n.meta['layer']}" if "layer" in n.meta else "", n.meta.get("role", ""),
        "" if n.meta.get("pass") in (None, "trace", "lift") else f"[{n.meta['pass']}]") if x)
    line = f"  %{n.name} = {call}"
    return f"{line:<96} {typ:<18}" + (f" # {where}" if where else "")


def format_graph(gm: fx.GraphModule, title: str = "") -> str:
    inputs = [f"{p.name}: {format_type(p.meta.get('val'), p.meta.get('shape'))}"
              for p in gm.graph.find_nodes(op="placeholder")]
    lines = [title] if title else []
    lines.append(f"def forward({', '.join(inputs)}):")
    layer = None
    for n in gm.graph.nodes:
        if n.meta.get("layer") != layer and n.op == "call_function":
            layer = n.meta.get("layer")
            if layer is not None:
                lines.append(f"  # ── layer {layer}")
        text = format_node(n)
        if text is not None:
            lines.append(text.rstrip())
    return "\n".join(lines)
