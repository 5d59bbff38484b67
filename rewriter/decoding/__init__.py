"""The decoding strategy an IR asks for: one record type per strategy, kept by a pass in
``ir.info["decoding"]`` (and so in artifacts), read back with ``strategy_of``.

With no record the runtime decodes one token per step (``PlainDecoding``). A
self-speculative record (``SelfSpeculativeDecoding``)::

    {"version": 2, "strategy": "self_speculative", "skip_layers": [..],
     "skip_attention": [..], "skip_mlp": [..], "max_draft": 4, "threshold": 0.5}

(``draft_weights``, optional: ``"int4"``: the draft reads the same weights in 4 bits,
``Int4Weights``'s codes; the skip set may then be empty.) The runtime drafts with the IR
with those layers and sub-layers bypassed (``rewriter.ir.skip``) and verifies the drafts.

A tree record (``TreeDecoding``): every round verifies a tree of drafted tokens and keeps
the longest path the model agrees with. ``drafter`` says who drafts it::

    {"version": 2, "strategy": "tree", "drafter": "medusa" | "hydra" | "eagle",
     "depth": 4, "tree": [[0], [1], [0, 0], ..], "draft_vocab": 4096 or None,
     "acceptance": "exact" or "typical", "posterior_threshold": 0.09,
     "posterior_alpha": 0.3, "batch_trees": [[4, [[0], [1], [0, 0]]], [8, []]]}

- ``depth``: the levels a round drafts (Medusa and Hydra: one head a level; EAGLE: its
  layer run once a level); ``tree``: paths of ranks (``rewriter.drafts.tree``); ``draft_vocab``:
  the tokens the draft chooses among (the weight ``medusa.vocab``), None: all of them.
- ``batch_trees``, optional: from a batch of 4 rows on verify only those nodes of the
  tree, from 8 on none, which decodes plainly (or, with ``lookup``, verifies copied chains
  alone); a larger batch makes verifying many tokens dearer. ``[1, []]`` first: even one
  row verifies no tree, where no tree pays on the machine.
- ``dynamic``, optional: an integer ``e``: every round re-grows a tree of as many nodes
  from the draft's own probabilities, expanding the ``e`` likeliest nodes of each level
  (``runtime.decoding.tree.dynamic``). EAGLE always does (its ``tree`` only sizes the rounds) and
  has no ``adapt`` or ``batch_trees``.
- ``lookup``, optional: an integer ``L``: every round also verifies a chain of up to
  ``L`` tokens copied from each row's own text after the latest earlier occurrence of its
  last tokens; with ``adapt`` as many of them as pay (``runtime.decoding.tree.lookup``).
- ``adapt``, optional: ``{"accuracy": [[..], ..], "costs": [[1, 0.11, [1.0, 1.01, ..]], ..]}``,
  the heads' held-out rank accuracies and, from each batch size on, one heads call's cost
  and a round's cost verifying 1, 2, .. tokens (at one row as far as the tree and a chain;
  a larger batch's may stop short of the tree: its sub-trees are cut to them), in plain
  decode steps (``rewriter.measure.round_cost``). The runtime then learns the heads' accuracies on
  the text it decodes and re-chooses the sub-tree it verifies (``runtime.decoding.tree.adapt``).

Copied chains alone (``PromptLookup``) are a tree strategy with no drafter::

    {"version": 2, "strategy": "tree", "drafter": "none", "lookup": 4,
     "costs": [[1, [1.0, 1.02, ..]], [2, [..]], ..]}

(``costs``, optional: from each batch size on, a round verifying 1, 2, .. tokens in plain
decode steps, the round's own work included.)

Records written before version 2 (no ``version`` key; ``"strategy"`` ``"medusa"`` with
``"arch"`` and ``"num_heads"``, ``"lookup"``, ``"self_speculative"``) are read as the
records above (``version1``): artifacts saved then load and decode as they did.
``check_record`` is what the artifact loader and the passes apply.
"""
from __future__ import annotations

from typing import Union

from rewriter.decoding.checks import DRAFT_WEIGHTS, DRAFTERS, MAX_DRAFT, MAX_EXPAND, MAX_LOOKUP
from rewriter.decoding.records import VERSION, PlainDecoding, SelfSpeculativeDecoding, TreeDecoding
from rewriter.decoding.version1 import from_version1, problem

Decoding = Union[PlainDecoding, SelfSpeculativeDecoding, TreeDecoding]
RECORDS = {c.KIND: c for c in (SelfSpeculativeDecoding, TreeDecoding)}

__all__ = ["DRAFTERS", "DRAFT_WEIGHTS", "MAX_DRAFT", "MAX_EXPAND", "MAX_LOOKUP", "RECORDS",
           "VERSION", "Decoding", "PlainDecoding", "SelfSpeculativeDecoding", "TreeDecoding",
           "check_record", "check_undecided", "current", "strategy_of"]


def current(r):
    """``r`` in this version's form: a version-1 record read as version 2, anything else
    as it is (``check_record`` says whether it is a record)."""
    return from_version1(r) if isinstance(r, dict) and "version" not in r else r


def check_record(r) -> str | None:
    """Why ``r`` (this version's record or a version-1 one) is not a decoding record, or None."""
    if isinstance(r, dict) and "version" not in r and problem(r):
        return problem(r)
    r = current(r)
    if not isinstance(r, dict) or type(r.get("version")) is not int or r["version"] != VERSION:
        return f"an object with \"version\": {VERSION} (or a version-1 record, with no version)"
    kind = r.get("strategy")
    if not isinstance(kind, str) or kind not in RECORDS:
        return f"strategy: one of {sorted(RECORDS)} (plain decoding is no record at all)"
    return RECORDS[kind].check(r)


def strategy_of(info: dict) -> Decoding:
    """The strategy ``info`` records (checked when it was recorded or loaded)."""
    r = info.get("decoding")
    if r is None:
        return PlainDecoding()
    r = current(r)
    return RECORDS[r["strategy"]].from_record(r)


def check_undecided(ir, who) -> None:
    """``PassError`` unless ``ir`` is a causal LM with no decoding strategy recorded yet
    (``who``: the strategy's pass; a model decodes one way)."""
    from rewriter.errors import PassError
    if not ir.is_causal_lm:
        raise PassError(f"{who!r} needs a causal LM")
    if ir.info.get("decoding") is not None:
        raise PassError(f"{who!r}: the IR already has a decoding strategy "
                        f"({ir.info['decoding']['strategy']}); a model decodes one way")
