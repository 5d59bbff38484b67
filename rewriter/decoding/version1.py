"""Decoding records as written before version 2, read as version-2 records.

Version 1 named a tree strategy after its first drafter: ``"strategy": "medusa"`` with
``"arch"`` (``"medusa"``, ``"hydra"`` or ``"eagle"``) and ``"num_heads"`` (EAGLE's levels
too), and copied chains alone ``"strategy": "lookup"``. Version 2 records a tree with a
``drafter`` (``"none"`` for copied chains alone) and a ``depth``; every other key kept its
name and meaning.
"""
from __future__ import annotations

from rewriter.decoding.records import VERSION

RENAMED = {"arch": "drafter", "num_heads": "depth"}  # a version-1 tree's keys, renamed
ARCHS = ("medusa", "hydra", "eagle")  # version 1's tree drafters ("none" was "lookup")
KINDS = ("self_speculative", "medusa", "lookup")


def problem(r: dict) -> str | None:
    """Why ``r``, a dict with no ``version``, is no version-1 record, or None: checked before
    converting, since a converted record would accept what version 1 refused."""
    kind = r.get("strategy")
    if kind == "tree":
        return "\"version\": 2 in a tree record (version 1 had none)"
    if not isinstance(kind, str) or kind not in KINDS:
        return f"strategy: one of {list(KINDS)} in a version-1 record (no \"version\")"
    if kind == "medusa" and set(RENAMED.values()) & set(r):
        return "a version-1 record (no \"version\") names arch and num_heads, not drafter or depth"
    if kind == "medusa" and not (isinstance(r.get("arch", "medusa"), str)
                                 and r.get("arch", "medusa") in ARCHS):
        return f"arch: one of {list(ARCHS)} in a version-1 record (no \"version\")"
    if kind == "lookup" and "drafter" in r:
        return "a version-1 lookup record (no \"version\") names no drafter"
    return None


def from_version1(r: dict) -> dict:
    """The version-2 form of version-1 record ``r``; a dict that is no version-1 record
    comes back as it is, for ``check_record`` to name what is wrong."""
    kind = r.get("strategy")
    if kind == "self_speculative":
        return {"version": VERSION, **r}
    rest = {k: v for k, v in r.items() if k != "strategy"}
    if kind == "lookup" and "drafter" not in r:
        return {"version": VERSION, "strategy": "tree", "drafter": "none", **rest}
    # a key of both versions at once would be silently dropped by the renaming
    if kind == "medusa" and not set(RENAMED.values()) & set(r):
        return {"version": VERSION, "strategy": "tree",
                **{RENAMED.get(k, k): v for k, v in rest.items()}}
    return r
