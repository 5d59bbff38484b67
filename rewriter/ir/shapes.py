"""Shape propagation: fake tensors with symbolic sizes on every node.

The graph is run on fake inputs whose leading sizes are symbols of one ``ShapeEnv``; each
node's ``meta["val"]`` gets the resulting fake tensor and ``meta["shape"]`` its sizes as
sympy expressions in the user-facing symbols ``B`` (batch) and ``S`` (sequence).
"""
from __future__ import annotations

from functools import reduce

import sympy
import torch
from torch._guards import detect_fake_mode
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


SYMBOL_NAMES = ("B", "S")
# Example sizes for tracing and shape propagation. Neither is 0 or 1 (those get
# specialised) and they differ from each other and from typical model widths.
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 7


def propagate_shapes(gm: fx.GraphModule, input_specs: list[dict]) -> None:
    """Fill ``meta["val"]``/``meta["shape"]`` on every node.

    Incremental where it can be: nodes that still hold a fake value (from tracing or an
    earlier propagation) keep it, and only nodes without one (new nodes, or nodes a pass
    changed and cleared) are computed, from their inputs' fake values. A graph with no fake
    values at all is propagated from fresh symbolic inputs built from ``input_specs``.
    A pass that changes what an existing node computes must delete its ``meta["val"]``.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    mode = detect_fake_mode([p.meta.get("val") for p in placeholders
                             if isinstance(p.meta.get("val"), torch.Tensor)])
    if mode is None or mode.shape_env is None:
        mode = _fresh_propagation(gm, input_specs)
    else:
        _incremental_propagation(gm, mode)
    renames = _symbol_names(placeholders)
    for n in gm.graph.nodes:
        if n.meta.get("_shape_of") is not n.meta.get("val"):
            n.meta["shape"] = _sympy_shape(n.meta.get("val"), renames)
            n.meta["_shape_of"] = n.meta.get("val")


def _fresh_propagation(gm: fx.GraphModule, input_specs: list[dict]) -> FakeTensorMode:
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    fakes, symbols = [], {}  # (dim, example size) -> SymInt, shared between inputs
    device = graph_device(gm)
    for spec in input_specs:
        real = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
        dyn = [DimDynamic.DYNAMIC if d in spec["dynamic"] else DimDynamic.STATIC
               for d in range(real.dim())]
        shared = [symbols.get((d, n)) for d, n in enumerate(real.shape)]
        if fakes and all(s is not None for d, s in enumerate(shared) if d in spec["dynamic"]):
            # input_ids and positions are both [B, S]: the same symbols, not new ones
            sizes = [shared[d] if d in spec["dynamic"] else n for d, n in enumerate(real.shape)]
            with mode:
                fakes.append(torch.zeros(sizes, dtype=real.dtype, device=device))
            continue
        fake = mode.from_tensor(real, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dyn))
        for d in spec["dynamic"]:
            symbols.setdefault((d, real.shape[d]), fake.shape[d])
        fakes.append(fake)
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return mode


def graph_device(gm: fx.GraphModule) -> torch.device:
    """Where the graph's weights live (its inputs are made there too); the CPU for a graph
    without any."""
    for t in [*gm.parameters(), *gm.buffers()]:
        return t.device
    return torch.device("cpu")


def _incremental_propagation(gm: fx.GraphModule, mode: FakeTensorMode) -> None:
    for n in gm.graph.nodes:
        if "val" in n.meta or n.op in ("placeholder", "output"):
            continue
        if n.op == "get_attr":
            real = reduce(getattr, n.target.split("."), gm)
            n.meta["val"] = mode.from_tensor(real, static_shapes=True)
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        with mode:
            n.meta["val"] = n.target(*args, **kwargs)


def _symbol_names(placeholders: list[fx.Node]) -> dict:
    """Map the first placeholder's dynamic sizes to B, S (the names users read)."""
    renames = {}
    val = placeholders[0].meta.get("val") if placeholders else None
    if isinstance(val, torch.Tensor):
        for d, size in enumerate(val.shape[:len(SYMBOL_NAMES)]):
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                renames[size.node.expr] = sympy.Symbol(SYMBOL_NAMES[d], positive=True, integer=True)
    return renames


def _sympy_shape(val, renames):
    if isinstance(val, torch.Tensor):
        return tuple(_expr(s, renames) for s in val.shape)
    if isinstance(val, torch.SymInt):
        return _expr(val, renames)  # a size value (sym_size): its expression
    if isinstance(val, (tuple, list)):
        return tuple(_sympy_shape(v, renames) for v in val)
    return None


def _expr(size, renames):
    if isinstance(size, torch.SymInt):
        return size.node.expr.xreplace(renames)
    return sympy.Integer(int(size))


def lm_input_specs() -> list[dict]:
    """Inputs of a lifted causal LM: ``input_ids`` and ``positions``, both ``[B, S]``."""
    spec = {"shape": [EXAMPLE_BATCH, EXAMPLE_SEQ], "dtype": "int64", "dynamic": [0, 1]}
    return [dict(spec), dict(spec)]


def specs_from_placeholders(gm: fx.GraphModule) -> list[dict]:
    """Input specs read off the placeholders' fake values from tracing."""
    specs = []
    for p in gm.graph.find_nodes(op="placeholder"):
        val = p.meta["val"]
        shape, dynamic = [], []
        for d, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt):
                dynamic.append(d)
                shape.append(int(s.node.hint) if s.node.hint is not None else EXAMPLE_SEQ)
            else:
                shape.append(int(s))
        specs.append({"shape": shape, "dtype": str(val.dtype).removeprefix("torch."),
                      "dynamic": dynamic})
    return specs
