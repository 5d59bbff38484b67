"""The non-tensor arguments of each op and what they may hold.

One rule per argument, beside the ops, so that ``verify`` (after every pass) and the
artifact loader refuse the same values. ``window=-5`` once changed the tokens of a loaded
IR; now it names itself.
"""
from __future__ import annotations

import math

import torch

from rewriter.drafts.heads import MAX_HEADS
from rewriter.ops.registry import OPS
from rewriter.values import MAX_INT, within_context


MAX_WORLD = 1024  # ranks of one tensor-parallel model: more is a mistake, not a cluster


def _int(low: int, high: int = MAX_INT):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            return f"an integer in [{low}, {high}]"
    return check


def _finite_positive(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return "a finite number > 0"


def _bool(v):
    if not isinstance(v, bool):
        return "true or false"


def _one_of(*choices):
    def check(v):
        if not isinstance(v, str) or v not in choices:
            return f"one of {', '.join(map(repr, choices))}"
    return check


def _head_list(v):
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_INT for i in v) \
            or list(v) != sorted(set(v)):
        return "a non-empty sorted list of distinct KV head indices"


def _gate_list(v):
    if not isinstance(v, (list, tuple)) or not v or any(
            isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= 1 for g in v):
        return "a non-empty list of numbers in [0, 1]"


def _merge_settings(v):
    """MiniCache's ``[t, gamma, retain]``: SLERP's t, the retention share, the side
    buffer's capacity as a share of the sequence (``runtime.merged_cache``)."""
    if not isinstance(v, (list, tuple)) or len(v) != 3 or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1 for x in v):
        return "[t, gamma, retain], three numbers in [0, 1]"


def _optional(rule):
    def check(v):
        return None if v is None else rule(v) and f"None or {rule(v)}"
    return check


ATTRIBUTES: dict[str, dict[str, callable]] = {
    "embedding": {"scale": _optional(_finite_positive)},
    "rms_norm": {"eps": _finite_positive, "unit_offset": _bool},
    "head_rms_norm": {"eps": _finite_positive, "head_dim": _int(1), "unit_offset": _bool},
    "layer_norm": {"eps": _finite_positive},
    "add_rms_norm": {"eps": _finite_positive, "unit_offset": _bool},
    "all_reduce": {"world_size": _int(2, MAX_WORLD)},
    "all_reduce_add_rms_norm": {"eps": _finite_positive, "world_size": _int(2, MAX_WORLD),
                                "two_shot_tokens": _optional(_int(1))},
    "gelu": {"approximate": _one_of("none", "tanh")},
    "rotary": {"scaling": _finite_positive},
    "rope": {"head_dim": _int(1)},
    "linear_int4": {"group_size": _int(2)},
    # Hydra's heads read the path drafted so far (EAGLE's 1): no more tokens than heads
    "next_tokens": {"count": _int(1, MAX_HEADS)},
    "eagle_layer": {"num_heads": _int(1), "num_kv_heads": _int(1),
                    "rope_theta": _finite_positive, "eps": _finite_positive},
    "select_tokens": {"layer": _int(0), "num_heads": _int(1), "num_kv_heads": _int(1),
                      "head_dim": _int(1), "top_k": _int(1), "recent": _int(0)},
    "select_pages": {"layer": _int(0), "num_heads": _int(1), "num_kv_heads": _int(1),
                     "head_dim": _int(1), "page": _int(1), "budget": _int(1),
                     "recent": _int(0)},
    "attention": {"layer": _int(0), "num_heads": _int(1), "num_kv_heads": _int(1),
                  "head_dim": _int(1), "scale": _finite_positive, "causal": _bool,
                  "window": _optional(_int(1)), "sinks": _optional(_int(0)),
                  "full_heads": _optional(_head_list), "gates": _optional(_gate_list),
                  "kv_source": _optional(_int(0)), "merge_with": _optional(_int(0)),
                  "merge": _optional(_merge_settings)},
}

# Token counts the runtime sizes a layer's state by: a ring's slots and sink layout
# (``sinks + window``), a selection's width (``top_k`` or ``budget``, plus ``recent``).
# Together they may not pass the model's context length, which the schema above does not
# know: ``check_context`` is applied by the verifier (after every pass, and at load) and,
# naming their own parameters, by the passes that write them. A plain sliding window
# (no sinks) sizes nothing: the cache is the sequence's, and the artifact loader ties the
# window to the config's ``sliding_window``.
CONTEXT_BOUNDED = {"attention": ("sinks", "window"), "select_tokens": ("top_k", "recent"),
                   "select_pages": ("budget", "recent")}


def check_context(name: str, bound: dict, context: int) -> None:
    """``ValueError`` when the ``CONTEXT_BOUNDED`` counts of a call of ``rw.<name>`` (its
    arguments by name, ``op_arguments``) add up past ``context``, naming them."""
    keys = CONTEXT_BOUNDED.get(name)
    if keys is None or (name == "attention" and bound["sinks"] is None):
        return
    within_context(f"rw.{name}", context, **{k: bound[k] for k in keys})


def op_arguments(name: str, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call of ``rw.<name>`` by their schema names, defaults filled in;
    ``ValueError`` for too many, unknown, repeated or missing ones."""
    schema = OPS[name]._schema.arguments
    if len(args) > len(schema):
        raise ValueError(f"rw.{name} takes {len(schema)} arguments, got {len(args)}")
    bound = {a.name: v for a, v in zip(schema, args)}
    for key, v in kwargs.items():
        if key in bound or key not in {a.name for a in schema}:
            raise ValueError(f"rw.{name}: unexpected or repeated argument {key!r}")
        bound[key] = v
    for a in schema:
        if a.name not in bound:
            if not a.has_default_value():
                raise ValueError(f"rw.{name}: missing argument {a.name!r}")
            bound[a.name] = a.default_value
    return bound


def check_arguments(name: str, args: tuple, kwargs: dict, is_tensor=None) -> dict:
    """``op_arguments``, each attribute checked by its rule and each tensor argument by
    ``is_tensor`` (e.g. "is an fx node"); ``ValueError`` names the argument and the value."""
    bound = op_arguments(name, args, kwargs)
    rules = ATTRIBUTES.get(name, {})
    for a in OPS[name]._schema.arguments:
        v = bound[a.name]
        optional = isinstance(a.type, torch.OptionalType)
        if isinstance(a.type.getElementType() if optional else a.type, torch.TensorType):
            if is_tensor is not None and not (is_tensor(v) or (optional and v is None)):
                raise ValueError(f"rw.{name}: {a.name} must be a tensor, got {v!r}")
            continue
        rule = rules.get(a.name)
        why = rule(v) if rule is not None else None
        if why:
            raise ValueError(f"rw.{name}: {a.name} must be {why}, got {v!r}")
    together = _TOGETHER.get(name)
    if together is not None:
        together(bound)
    return bound


# Rules that span several arguments of one op: each takes the op's bound arguments.

def _check_pages(bound: dict) -> None:
    if bound["budget"] < bound["page"]:
        raise ValueError(f"rw.select_pages: budget={bound['budget']} must hold at least one "
                         f"page of {bound['page']} tokens")


def _check_int4(bound: dict) -> None:
    if bound["group_size"] % 2:
        raise ValueError(f"rw.linear_int4: group_size={bound['group_size']} must be even "
                         "(two codes a byte)")


def _check_attention(bound: dict) -> None:
    if bound["num_heads"] % bound["num_kv_heads"]:
        raise ValueError(f"rw.attention: num_heads={bound['num_heads']} is not a multiple of "
                         f"num_kv_heads={bound['num_kv_heads']}")
    if bound["sinks"] is not None and bound["window"] is None:
        raise ValueError(f"rw.attention: sinks={bound['sinks']} needs a window (the sinks are "
                         "kept beside the last window keys)")
    if bound["kv_source"] is not None and bound["kv_source"] == bound["layer"]:
        raise ValueError(f"rw.attention: kv_source={bound['kv_source']} is its own layer: an "
                         f"owner names no source")
    if (bound["merge_with"] is None) != (bound["merge"] is None) \
            or bound["merge_with"] is not None and bound["merge_with"] == bound["layer"]:
        raise ValueError(f"rw.attention: merge_with={bound['merge_with']} and merge="
                         f"{bound['merge']} come together and name another layer (MiniCache)")
    if bound["select"] is not None and bound["sinks"] is not None:
        raise ValueError("rw.attention: select (TidalDecode) and sinks (a ring cache) do not "
                         "go together: the ring has dropped what a selection may name")
    if bound["select"] is not None and bound["window"] is not None:
        raise ValueError(f"rw.attention: select (TidalDecode, Quest) and window="
                         f"{bound['window']} do not go together: the selection replaces the "
                         f"causal window")
    if bound["rotary"] is not None and bound["sinks"] is None:
        raise ValueError("rw.attention: rotary (StreamingLLM's sink positions) needs sinks")
    _check_duo(bound)
    if (bound["cos"] is None) != (bound["sin"] is None):
        raise ValueError("rw.attention: cos and sin come together (both or neither)")


def _check_duo(bound: dict) -> None:
    """``full_heads`` split a sink + window layer's KV heads; ``gates`` has one per KV head."""
    heads, full = bound["num_kv_heads"], bound["full_heads"]
    if full is not None and bound["sinks"] is None:
        raise ValueError(f"rw.attention: full_heads={list(full)} needs sinks (the other heads "
                         f"keep a sink + window cache)")
    if full is not None and (full[-1] >= heads or len(full) == heads):
        raise ValueError(f"rw.attention: full_heads={list(full)} must name some, not all, of "
                         f"the {heads} KV heads (0 .. {heads - 1})")
    if bound["gates"] is not None and len(bound["gates"]) != heads:
        raise ValueError(f"rw.attention: gates has {len(bound['gates'])} values for "
                         f"{heads} KV heads")


_TOGETHER = {"select_pages": _check_pages, "linear_int4": _check_int4, "attention": _check_attention}
