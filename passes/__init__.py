"""Passes over the rewriter IR; each file holds one pass or pass family.

``PASSES`` names each pass for the command line and for artifacts
(``--pass layer_skip:speedup=1.5``); ``from_spec`` builds one from such a string.
"""
from __future__ import annotations

import json

from .fuse_add_rms_norm import FuseAddRMSNorm
from .fuse_qkv import FuseQKV
from .fuse_rope import FuseRoPE
from .fuse_swiglu import FuseSwiGLU
from .layer_skip import LayerSkip

PASSES = {"layer_skip": LayerSkip, "fuse_qkv": FuseQKV, "fuse_swiglu": FuseSwiGLU,
          "fuse_add_rms_norm": FuseAddRMSNorm, "fuse_rope": FuseRoPE}

__all__ = ["LayerSkip", "FuseQKV", "FuseSwiGLU", "FuseAddRMSNorm", "FuseRoPE", "PASSES",
           "from_spec"]


def from_spec(spec: str):
    """``"name:key=value,key=value"`` -> a pass; values are JSON (``layers=[1,2]``) or text."""
    name, _, rest = spec.partition(":")
    cls = PASSES.get(name.strip())
    if cls is None:
        raise ValueError(f"unknown pass {name.strip()!r}; available: {', '.join(sorted(PASSES))}")
    params = {}
    for item in _split_top_level(rest):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"pass {name}: parameter {item!r} is not key=value")
        params[key.strip()] = _value(value.strip())
    try:
        return cls(**params)
    except TypeError as e:  # an unknown keyword
        import inspect
        known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        raise ValueError(f"pass {name}: {e.args[0].split('() ')[-1]}; its parameters are "
                         f"{', '.join(known)}") from e


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets (``layers=[1,2],x=3``)."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        items.append(cur)
    return [i for i in items if i.strip()]


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
