"""Decoding records as written before version 2, read as version-2 records.

Version 1 named a tree strategy after its first drafter: ``"strategy": "medusa"`` with
``"arch"`` (``"medusa"``, ``"hydra"`` or ``"eagle"``) and ``"num_heads"`` (EAGLE's levels
too), and copied chains alone ``"strategy": "lookup"``. Version 2 records a tree with a
``drafter`` (``"none"`` for copied chains alone) and a ``depth``; every other key kept its
name and meaning.
"""
from __future__ import annotations

from .records import VERSION

RENAMED = {"arch": "drafter", "num_heads": "depth"}  # a version-1 tree's keys, renamed


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
