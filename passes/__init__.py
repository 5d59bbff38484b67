"""Passes over the rewriter IR; each file holds one pass or pass family.

``PASSES`` names each pass for the command line and for artifacts
(``--pass layer_skip:speedup=1.5``); ``from_spec`` builds one from such a string.
"""
from __future__ import annotations

import inspect
import json

from rewriter.passes.draft_heads import HydraHeads, MedusaHeads
from rewriter.passes.duo_attention import DuoAttention
from rewriter.passes.eagle_draft import EagleDraft
from rewriter.passes.fuse_add_rms_norm import FuseAddRMSNorm
from rewriter.passes.fuse_qkv import FuseQKV
from rewriter.passes.fuse_rope import FuseRoPE
from rewriter.passes.fuse_swiglu import FuseSwiGLU
from rewriter.passes.int4_weights import Int4Weights
from rewriter.passes.layer_skip import LayerSkip
from rewriter.passes.prompt_lookup import PromptLookup
from rewriter.passes.quest import Quest
from rewriter.passes.self_speculative import SelfSpeculative
from rewriter.passes.streaming import StreamingAttention
from rewriter.passes.tidal_decode import TidalDecode

PASSES = {"layer_skip": LayerSkip, "fuse_qkv": FuseQKV, "fuse_swiglu": FuseSwiGLU,
          "fuse_add_rms_norm": FuseAddRMSNorm, "fuse_rope": FuseRoPE, "int4_weights": Int4Weights,
          "self_speculative": SelfSpeculative, "medusa_heads": MedusaHeads,
          "hydra_heads": HydraHeads, "eagle_draft": EagleDraft, "prompt_lookup": PromptLookup,
          "streaming_attention": StreamingAttention,
          "tidal_decode": TidalDecode, "duo_attention": DuoAttention, "quest": Quest}

__all__ = ["LayerSkip", "FuseQKV", "FuseSwiGLU", "FuseAddRMSNorm", "FuseRoPE", "Int4Weights", "SelfSpeculative", "MedusaHeads", "HydraHeads",
           "EagleDraft",
           "PromptLookup", "StreamingAttention", "TidalDecode", "DuoAttention", "Quest", "PASSES",
           "from_spec"]


def from_spec(spec: str):
    """``"name:key=value,key=value"`` -> a pass; values are JSON (``layers=[1,2]``) or text.

    Each key may appear once, and only the pass's own parameters are accepted; the pass's
    ``__init__`` then checks the values (types, NaN, ranges)."""
    if not isinstance(spec, str):
        raise ValueError(f"a pass spec is a string like 'layer_skip:speedup=1.5', got {spec!r}")
    name, _, rest = spec.partition(":")
    name = name.strip()
    cls = PASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown pass {name!r}; available: {', '.join(sorted(PASSES))}")
    known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    params = {}
    for item in _split_top_level(rest):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"pass {name}: parameter {item.strip()!r} is not key=value")
        if key not in known:
            raise ValueError(f"pass {name}: unknown parameter {key!r}; its parameters are "
                             f"{', '.join(known) or 'none'}")
        if key in params:
            raise ValueError(f"pass {name}: parameter {key!r} is given twice")
        params[key] = _value(value.strip())
    return cls(**params)


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
