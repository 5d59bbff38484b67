"""Passes over the rewriter IR; each file holds one pass or pass family.

``PASSES`` names each pass for the command line and for artifacts
(``--pass layer_skip:speedup=1.5``); ``from_spec`` builds one from such a string, and
``to_spec`` writes the string back from a pass or an artifact's record of one.
"""
from __future__ import annotations

import inspect
import json

from rewriter.ir.pass_manager import Pass
from rewriter.values import parse_json

from rewriter.passes.draft_heads import HydraHeads, MedusaHeads
from rewriter.passes.duo_attention import DuoAttention
from rewriter.passes.eagle_draft import EagleDraft
from rewriter.passes.fuse_add_rms_norm import FuseAddRMSNorm
from rewriter.passes.fuse_all_reduce_rms_norm import FuseAllReduceRMSNorm
from rewriter.passes.fuse_qkv import FuseQKV
from rewriter.passes.fuse_rope import FuseRoPE
from rewriter.passes.fuse_swiglu import FuseSwiGLU
from rewriter.passes.int4_weights import Int4Weights
from rewriter.passes.layer_skip import LayerSkip
from rewriter.passes.minicache import MiniCache
from rewriter.passes.prompt_lookup import PromptLookup
from rewriter.passes.quest import Quest
from rewriter.passes.self_speculative import SelfSpeculative
from rewriter.passes.share_kv import ShareKV
from rewriter.passes.streaming import StreamingAttention
from rewriter.passes.tensor_parallel import TensorParallel
from rewriter.passes.tidal_decode import TidalDecode

PASSES = {"layer_skip": LayerSkip, "fuse_qkv": FuseQKV, "fuse_swiglu": FuseSwiGLU,
          "fuse_add_rms_norm": FuseAddRMSNorm, "fuse_rope": FuseRoPE, "int4_weights": Int4Weights,
          "self_speculative": SelfSpeculative, "medusa_heads": MedusaHeads,
          "hydra_heads": HydraHeads, "eagle_draft": EagleDraft, "prompt_lookup": PromptLookup,
          "streaming_attention": StreamingAttention,
          "tidal_decode": TidalDecode, "duo_attention": DuoAttention, "quest": Quest,
          "share_kv": ShareKV, "minicache": MiniCache, "tensor_parallel": TensorParallel,
          "fuse_all_reduce_rms_norm": FuseAllReduceRMSNorm}

__all__ = ["LayerSkip", "FuseQKV", "FuseSwiGLU", "FuseAddRMSNorm", "FuseRoPE", "Int4Weights", "SelfSpeculative", "MedusaHeads", "HydraHeads",
           "EagleDraft",
           "PromptLookup", "StreamingAttention", "TidalDecode", "DuoAttention", "Quest", "ShareKV", "MiniCache", "TensorParallel",
           "FuseAllReduceRMSNorm", "PASSES",
           "from_spec", "to_spec"]


def from_spec(spec: str):
    """``"name:key=value,key=value"`` -> a pass; values are JSON (``layers=[1,2]``) or text.

    Text holding a comma, a bracket or a double quote, spaces at either end, or text that
    would read as JSON (``null``, ``12``) is written as a JSON string: in double quotes,
    with ``\\"`` for a quote and ``\\\\`` for a backslash (``weights="/tmp/a,b.safetensors"``;
    ``to_spec`` quotes every text so). Each key may appear once, and only the pass's own
    parameters are accepted; the pass's ``__init__`` then checks the values (types, NaN,
    ranges)."""
    if not isinstance(spec, str):
        raise ValueError(f"a pass spec is a string like 'layer_skip:speedup=1.5', got {spec!r}")
    name, _, rest = spec.partition(":")
    name = name.strip()
    cls = PASSES.get(name)
    if cls is None:
        raise ValueError(f"unknown pass {name!r}; available: {', '.join(sorted(PASSES))}")
    known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    params = {}
    for item in _split_top_level(rest, name):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"pass {name}: parameter {item.strip()!r} is not key=value")
        if key not in known:
            raise ValueError(f"pass {name}: unknown parameter {key!r}; its parameters are "
                             f"{', '.join(known) or 'none'}")
        if key in params:
            raise ValueError(f"pass {name}: parameter {key!r} is given twice")
        params[key] = _value(value.strip(), f"pass {name}: parameter {key!r}")
    return cls(**params)


def to_spec(p) -> str:
    """The spec ``from_spec`` reads back into a pass with the same parameters, from a pass
    or an artifact's record of one (``{"name": "MedusaHeads", "params": {...}}``, as
    ``Engine.pass_specs`` holds): every value as JSON, so text is quoted and any path
    survives."""
    name, params = (p.get("name"), p.get("params")) if isinstance(p, dict) else \
        (p.name, p.params()) if isinstance(p, Pass) else (None, None)
    cli = next((n for n, cls in PASSES.items() if cls.__name__ == name), None)
    if cli is None or not isinstance(params, dict):
        raise ValueError(f"to_spec takes a pass or its record {{name, params}}, got {p!r:.80}")
    try:
        values = [f"{k}={json.dumps(v, allow_nan=False, separators=(',', ':'))}"
                  for k, v in params.items()]  # no spaces: one shell word
    except (TypeError, ValueError) as e:  # a value JSON cannot hold (a tensor, NaN)
        raise ValueError(f"{name}: a parameter has no spec form ({e})") from None
    return f"{cli}:{','.join(values)}" if values else cli


def _split_top_level(text: str, name: str) -> list[str]:
    """Split on commas outside brackets and double-quoted JSON strings (``layers=[1,2],x=3``,
    ``weights="a,b"``); an unclosed quote or bracket is an error, not a value that swallows
    the parameters after it."""
    items, depth, cur, quoted, escaped = [], 0, [], False, False
    for ch in text:
        if quoted:  # a backslash escapes the next character (JSON's \" and \\)
            quoted = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            quoted = True
        elif ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
            continue
        else:
            depth += (ch in "[{(") - (ch in "]})")
            if depth < 0:
                break
        cur.append(ch)
    if quoted or depth:
        what = "a quote is not closed" if quoted else "unbalanced brackets"
        raise ValueError(f"pass {name}: {what} in {text!r:.120}; write text holding quotes or "
                         f'brackets as a JSON string: key="..." with \\" for a quote')
    items.append("".join(cur))
    return [i for i in items if i.strip()]


def _value(text: str, where: str):
    """A spec value: JSON (nested at most ``values.MAX_JSON_DEPTH`` deep), or else text."""
    try:
        return parse_json(text)
    except ValueError as e:
        if text[:1] in '"[{':  # meant as JSON: say why it is not
            raise ValueError(f"{where}: {text!r:.80} is not JSON ({e}); to give it as text, "
                             f'write a JSON string: "..." with \\" for a quote') from None
        return text
