"""Shape propagation: fake tensors with symbolic sizes on every node.

The graph is run on fake inputs whose leading sizes are symbols of one ``ShapeEnv``; each
node's ``meta["val"]`` gets the resulting fake tensor and ``meta["shape"]`` its sizes as
sympy expressions in the user-facing symbols ``B`` (batch) and ``S`` (sequence).
"""
from __future__ import annotations

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.passes.fake_tensor_prop import FakeTensorProp


SYMBOL_NAMES = ("B", "S")
# Example sizes for tracing and shape propagation. Neither is 0 or 1 (those get
# specialised) and they differ from each other and from typical model widths.
EXAMPLE_BATCH, EXAMPLE_SEQ = 2, 7


def propagate_shapes(gm: fx.GraphModule, input_specs: list[dict]) -> None:
    """Fill ``meta["val"]``/``meta["shape"]`` given ``input_specs`` (one per placeholder):
    ``{"shape": [..], "dtype": "int64", "dynamic": [dims]}`` with example sizes."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    fakes, renames = [], {}
    for spec in input_specs:
        real = torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]))
        dyn = [DimDynamic.DYNAMIC if d in spec["dynamic"] else DimDynamic.STATIC
               for d in range(real.dim())]
        fake = mode.from_tensor(real, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dyn))
        for d in spec["dynamic"]:
            expr = fake.shape[d].node.expr
            if isinstance(expr, sympy.Symbol) and expr not in renames and d < len(SYMBOL_NAMES):
                renames[expr] = sympy.Symbol(SYMBOL_NAMES[d], positive=True, integer=True)
        fakes.append(fake)
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    for n in gm.graph.nodes:
        n.meta["shape"] = _sympy_shape(n.meta.get("val"), renames)


def _sympy_shape(val, renames):
    if isinstance(val, torch.Tensor):
        return tuple(_expr(s, renames) for s in val.shape)
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
