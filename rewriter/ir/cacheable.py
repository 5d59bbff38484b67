"""Can this causal-LM IR run over a KV cache? Which of its nodes mix positions outside
``rw.attention``?

The runtime feeds a step only its new tokens and gives each ``rw.attention`` op the earlier
tokens' keys and values from the cache. Everything else in the graph must therefore be
*position-wise*: the value at one position may depend on that position's token and its
``positions`` entry, never on other positions of the step or on the step's length. A node
that breaks this computes right logits when the IR is called on a whole sequence, and
wrong tokens from the second generated one on. Three kinds are found:

- ``attention``: attention left as ATen (``scaled_dot_product_attention``): the frontend
  did not lift it, so it would attend over the step's tokens only;
- ``length``: a value made from the sequence length alone (an ``arange(S)`` position
  index, a causal mask, a buffer sliced to ``S``): in a one-token step it restarts at 0;
- ``mixing``: a value computed across the sequence dimension (scores with ``S`` twice in
  their shape, a softmax, sum or cumsum over ``S``, a matmul contracting ``S``).

The check reads the symbolic shapes (``meta["shape"]``, ``S`` = the sequence length) that
shape propagation leaves on every node.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from rewriter.errors import UncacheableError
from rewriter.ir.shapes import lm_input_specs, propagate_shapes

aten = torch.ops.aten

ATEN_ATTENTION = {
    "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
}
# Ops whose ``dim`` arguments only rename or broadcast dimensions: S stays where it is.
_LAYOUT = {"unsqueeze", "squeeze", "transpose", "permute", "view", "reshape", "expand",
           "flatten", "unflatten", "_unsafe_view", "t", "contiguous", "clone"}
_MATMUL = {"mm": 0, "bmm": 0, "matmul": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1}
_KIND_TEXT = {
    "attention": "attention left as ATen, not lifted into rw.attention",
    "length": "values made from the sequence length alone (position indices, masks)",
    "mixing": "computations across the sequence dimension",
}
_MAX_NAMES = 8


@dataclass(frozen=True)
class Finding:
    kind: str  # "attention", "length" or "mixing"
    node: fx.Node
    module: str  # the Hugging Face module it came from, or "" (e.g. a loaded IR)


def uncacheable(gm: fx.GraphModule, input_specs: list[dict] | None = None) -> list[Finding]:
    """Every node of ``gm`` the KV-cache runtime could not run right, in graph order."""
    if any(n.op != "output" and "shape" not in n.meta for n in gm.graph.nodes):
        propagate_shapes(gm, input_specs or lm_input_specs())
    from_input = _reads_inputs(gm)
    found = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or _is_size(n):
            continue  # reading a size (sym_size) is not computing with positions
        kind = _kind(n, from_input)
        if kind is not None:
            found.append(Finding(kind, n, module_path(n)))
    return found


def check_cacheable(ir) -> None:
    """Raise ``UncacheableError`` naming what the runtime cannot cache in ``ir``."""
    parts = []
    unlifted = _names(ir.info.get("unlifted_attention"))
    embeddings = _names(ir.info.get("unlifted_embeddings"))
    findings = uncacheable(ir.gm, ir.info.get("inputs"))
    known = {"attention": unlifted, "length": embeddings, "mixing": []}
    for kind in ("attention", "length", "mixing"):
        names = known[kind] + [_where(f) for f in findings
                               if f.kind == kind and f.module not in known[kind]]
        if names:
            parts.append(f"{_KIND_TEXT[kind]}: {_listing(names)}")
    if parts:
        family = ir.info.get("family") or "this model"
        raise UncacheableError(
            f"cannot generate with {family}: the KV-cache runtime caches only attention "
            f"lifted into rw.attention and needs everything else to work position by "
            f"position, so tokens after the first would be wrong; found {'; '.join(parts)}. "
            "Calling the optimized model for logits (without a cache) still gives right values")


def module_path(node: fx.Node) -> str:
    """Path of the innermost module ``node`` was traced in, as in the user's model."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return ""
    path = stack[-1][0]
    # A causal LM is traced through the frontend's ``CausalLMLogits`` wrapper, whose
    # ``model`` attribute holds the user's model: its paths start with ``model.``.
    outer = stack[0][1] if isinstance(stack[0][1], str) else getattr(stack[0][1], "__name__", "")
    if outer.endswith("CausalLMLogits"):
        path = path[len("model."):] if path.startswith("model.") else ""
    return path


# -- the three kinds ---------------------------------------------------------------------
def _kind(n: fx.Node, from_input: dict) -> str | None:
    name = _aten_name(n.target)
    if name in ATEN_ATTENTION:
        return "attention"
    seq = _seq_dims(n.meta.get("shape"))
    if not from_input[n]:
        # Named where such a value meets the token data, not at every node that built it.
        return "length" if seq and any(from_input.get(u) for u in n.users) else None
    if _is_rw(n.target):
        return None  # position-wise by definition (rw.attention is the cached one)
    if len(seq) >= 2 or _reduces_over_seq(n, name):
        return "mixing"
    return None


def _reads_inputs(gm: fx.GraphModule) -> dict:
    """node -> whether a graph input's data flows into it (reading a size does not count)."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            out[n] = True
        else:
            out[n] = any(out.get(a, False) for a in n.all_input_nodes if not _is_size(a))
    return out


def _reduces_over_seq(n: fx.Node, name: str) -> bool:
    """Whether ``n`` combines values of different positions: a ``dim`` argument naming a
    dimension of size ``S`` (sum, softmax, cumsum, cat, gather...), or a matmul that
    contracts over ``S``, or a convolution over it."""
    if name in _MATMUL:
        a = n.args[_MATMUL[name]]
        shape = _shape(a)
        return bool(shape) and _has_seq(shape[-1])
    if name.startswith("convolution") or name.startswith("conv"):
        shape = _shape(n.args[0])
        return any(_has_seq(d) for d in (shape or ())[2:])
    if name in _LAYOUT or not isinstance(n.target, torch._ops.OpOverload):
        return False
    if name in ("slice", "select", "narrow") and _shape(n) == _shape(n.args[0]):
        return False  # a slice that keeps every position
    ref = _reference_tensor(n)
    shape = _shape(ref)
    if not shape:
        return False
    for dim in _dim_args(n):
        if isinstance(dim, int) and not isinstance(dim, bool) and -len(shape) <= dim < len(shape):
            if _has_seq(shape[dim]):
                return True
    return False


def _dim_args(n: fx.Node) -> list:
    dims = []
    for i, arg in enumerate(n.target._schema.arguments):
        if arg.name not in ("dim", "dims"):
            continue
        value = n.kwargs.get(arg.name, n.args[i] if i < len(n.args) else None)
        dims.extend(value if isinstance(value, (list, tuple)) else [value])
    return dims


def _reference_tensor(n: fx.Node):
    """The tensor a ``dim`` argument indexes: the first tensor argument (or list's first)."""
    for a in n.args:
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], fx.Node):
            return a[0]
        if isinstance(a, fx.Node):
            return a
    return None


# -- helpers ------------------------------------------------------------------------------
def _shape(node):
    shape = node.meta.get("shape") if isinstance(node, fx.Node) else None
    return shape if isinstance(shape, tuple) and all(isinstance(d, sympy.Expr) for d in shape) else None


def _seq_dims(shape) -> list[int]:
    if not isinstance(shape, tuple):
        return []
    return [i for i, d in enumerate(shape) if isinstance(d, sympy.Expr) and _has_seq(d)]


def _has_seq(d) -> bool:
    return isinstance(d, sympy.Expr) and any(s.name == "S" for s in d.free_symbols)


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (int, torch.SymInt))


def _is_rw(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "rw"


def _aten_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target.overloadpacket.__name__
    return getattr(target, "__name__", "")


def _where(f: Finding) -> str:
    """The module path when the node still knows it (a loaded IR does not), else the node
    and its layer."""
    layer = f.node.meta.get("layer")
    node = f"node {f.node.name}" + (f" in layer {layer}" if isinstance(layer, int) else "")
    if f.kind == "attention":
        return f.module or node
    return f"{f.module} ({node})" if f.module else node


def _names(value) -> list[str]:
    """A list of module paths from ``ir.info`` (anything else there is ignored: the graph
    check below finds the same modules)."""
    if not isinstance(value, list):
        return []
    return [v for v in value if isinstance(v, str)]


def _listing(names: list[str]) -> str:
    unique = list(dict.fromkeys(names))
    shown = ", ".join(unique[:_MAX_NAMES])
    return shown + (f" and {len(unique) - _MAX_NAMES} more" if len(unique) > _MAX_NAMES else "")
