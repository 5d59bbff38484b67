"""The op tables and the decorator that fills them, with the helpers every shape rule uses.

``OPS`` maps each op's short name to its ``torch.library`` overload (the printer and the
artifact format resolve names through it); ``REFERENCE`` holds the same ops as plain functions.
"""
from __future__ import annotations

import torch

OPS: dict[str, torch._ops.OpOverload] = {}
# The same ops as plain Python functions: the runtime calls these directly, because a
# custom-op dispatch costs ~16 us per call, which at decode time is more than the math.
REFERENCE: dict[str, callable] = {}


def _like_first(x, *args, **kwargs):
    return torch.empty_like(x)


def _register(fake=_like_first):
    """Make the decorated function the op ``rw::<name>``; ``fake`` gives its output shape.

    The shape rules are written out (rather than running the reference on fake tensors)
    because shape propagation runs after every pass and must stay cheap.
    """
    def wrap(fn):
        op = torch.library.custom_op(f"rw::{fn.__name__}", mutates_args=())(fn)
        op.register_fake(fake)
        OPS[fn.__name__] = getattr(torch.ops.rw, fn.__name__).default
        REFERENCE[fn.__name__] = fn
        return op
    return wrap


def short_name(target) -> str:
    """``rw.attention`` for our ops, ``aten.add`` for ATen, the function name otherwise."""
    name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        base = target._schema.name.split("::")[-1]
        return f"{ns}.{base}"
    return name


# Shape rules: each fake checks what its reference would need, so a mis-shaped weight or a
# wrong width fails shape propagation (after every pass, and when an artifact loads)
# with a message that names the op, instead of failing inside a kernel at generate time.

class ShapeError(ValueError):
    """An op's inputs do not fit together (raised while propagating shapes)."""


def _need(ok, op: str, why: str) -> None:
    if not ok:
        raise ShapeError(f"rw.{op}: {why}")


def _dims(t) -> str:
    return "None" if t is None else str(list(t.shape))

