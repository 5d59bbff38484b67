"""``ShareKV``: layers read an earlier layer's KV cache instead of keeping their own.

    k_r = k_proj_r(x_r); v_r = v_proj_r(x_r); attention(q_r, k_r, v_r, layer=r)
becomes
    attention(q_r, k_o, v_o, layer=r, kv_source=o)

for each reader ``r`` and its owner ``o`` (an earlier layer): the reader's K/V projections
(and their norms and rotations) die, so they leave the IR and the artifact's weights, and
the runtime allocates one cache per owner, written by the owner alone
(``rewriter.ir.sharing``). Which layers share:

- ``sources={r: o, ...}``: an explicit map (a calibration's result, e.g. KVSharer's);
- ``every=k``: Cross-Layer Attention's groups of ``k`` adjacent layers, the lowest of each
  owning (CLA2 is ``every=2``);
- ``last=n``: the last ``n`` layers read the last layer before them, as Gemma 3n does;
- ``calibrate=prompts, budget=n``: up to ``n`` readers found by a search on the model's
  own text (``rewriter.measure.kv_sharer``: ``rule="kvsharer"``, the paper's order, or
  ``"measured"``), each kept while the final hidden states keep a mean cosine of
  ``threshold`` with the model's; the map found becomes ``sources`` (``report`` holds
  every pair tried).

``weights=FILE`` (or ``"default"``, the shipped default model's CLA2) then loads the
owners' K/V projections (and readers' query projections) that ``rewriter train-share``
adapted to this map (``share_kv_weights``): a file made for another map or model is
refused by name.

Lossy on a model not trained for it (the readers' own K/V are gone): measure it
(``benchmarks/kv_sharing.py``). The sparse caches come after it and follow the owners: a
reader keeps its owner's ring (StreamingAttention, DuoAttention's heads) and selects its
own Quest pages from its owner's; TidalDecode's reused selections are refused.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.nodes import attention_args
from rewriter.ir.pass_manager import Pass
from rewriter.ir.sharing import attention_by_layer, share
from rewriter.measure.calibrate import calibration_batch
from rewriter.measure.kv_sharer import RULES, search
from rewriter.passes.share_kv_weights import SHIPPED, load_into
from rewriter.values import MAX_INT, check_prompts, is_int, path_problem


class ShareKV(Pass):
    def __init__(self, sources: Optional[dict] = None, every: Optional[int] = None,
                 last: Optional[int] = None, calibrate: Optional[Sequence] = None,
                 budget: Optional[int] = None, threshold: float = 0.95, rule: str = "measured",
                 weights: Optional[Union[str, os.PathLike]] = None):
        given = [name for name, v in (("sources", sources), ("every", every), ("last", last),
                                      ("calibrate", calibrate)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"ShareKV: give exactly one of sources={{reader: owner}}, every=k, "
                             f"last=n or calibrate=prompts, got {', '.join(given) or 'none'}")
        _check_search(calibrate, budget, threshold, rule)
        self.calibrate = check_prompts("ShareKV", calibrate) if calibrate is not None else None
        self.budget, self.threshold, self.rule = budget, float(threshold), rule
        self.report: Optional[dict] = None
        if every is not None and (not is_int(every) or not 2 <= every <= MAX_INT):
            raise ValueError(f"ShareKV: every must be an integer >= 2 (layers a group), got {every!r}")
        if last is not None and (not is_int(last) or not 1 <= last <= MAX_INT):
            raise ValueError(f"ShareKV: last must be an integer >= 1, got {last!r}")
        self.sources = _checked_sources(sources) if sources is not None else None
        self.every = int(every) if every is not None else None
        self.last = int(last) if last is not None else None
        if weights is not None and path_problem(weights) is not None:
            raise ValueError(f"ShareKV: weights must be a file's path or a shipped name "
                             f"({', '.join(SHIPPED)}), got {weights!r:.200}")
        self.weights = os.fspath(weights) if weights is not None else None

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.params().items() if v is not None and
                 (self.calibrate is not None or k not in ("threshold", "rule"))}
        if self.calibrate is not None:
            shown["calibrate"] = f"<{len(self.calibrate)} prompts>"
        return f"ShareKV({', '.join(f'{k}={v}' if k == 'calibrate' else f'{k}={v!r}' for k, v in shown.items())})"

    def run(self, ir: IR) -> IR:
        by_layer = attention_by_layer(ir.graph)
        if not by_layer:
            raise PassError(f"{self!r}: the IR has no rw.attention op")
        if ir.info.get("fusions", {}).get("FuseQKV"):
            raise PassError(f"{self!r} must run before FuseQKV: a fused projection would keep "
                            f"computing the readers' K and V with their queries")
        if any(attention_args(n)[k] is not None for n in by_layer.values()
               for k in ("sinks", "select")):
            raise PassError(f"{self!r} must run before StreamingAttention, DuoAttention, Quest "
                            f"and TidalDecode: a reader's sparse cache follows its owner's")
        if any(attention_args(n)["merge_with"] is not None for n in by_layer.values()):
            raise PassError(f"{self!r} cannot follow MiniCache: a merged pair's cache holds "
                            f"merged directions, not one layer's keys and values")
        if ir.info.get("decoding") is not None:
            raise PassError(f"{self!r} must run before the speculative strategy "
                            f"({ir.info['decoding']['strategy']}), which times the model as it is")
        if self.calibrate is not None:  # the search's map, kept as the explicit one
            self.sources, self.report = search(ir, calibration_batch(ir, self.calibrate),
                                               self.budget, self.threshold, self.rule)
        pairs = self.pairs(sorted(by_layer))
        share(ir, pairs, repr(self))
        if self.weights is not None:  # after the share: the owners' weights are the ones kept
            load_into(ir, self.weights, pairs, repr(self))
        return ir

    def pairs(self, layers: list[int]) -> dict[int, int]:
        """``{reader: owner}`` over the attention layers present (ascending ids)."""
        if self.sources is not None:
            missing = sorted((set(self.sources) | set(self.sources.values())) - set(layers))
            if missing:
                raise PassError(f"{self!r}: layer {missing[0]} has no attention (layers "
                                f"{layers[0]}..{layers[-1]})")
            return dict(self.sources)
        if self.every is not None:
            return {r: layers[i - i % self.every] for i, r in enumerate(layers) if i % self.every}
        if self.last >= len(layers):
            raise PassError(f"{self!r}: the model has {len(layers)} attention layers; at least "
                            f"one must keep its cache for the last {self.last} to read")
        owner = layers[-self.last - 1]
        return {r: owner for r in layers[-self.last:]}


def _check_search(calibrate, budget, threshold, rule) -> None:
    """The calibrated search's settings (``rewriter.measure.kv_sharer``)."""
    if (calibrate is None) != (budget is None):
        raise ValueError("ShareKV: calibrate=prompts and budget=n (layers that may read "
                         "another's cache) come together")
    if budget is not None and (not is_int(budget) or not 1 <= budget <= MAX_INT):
        raise ValueError(f"ShareKV: budget must be an integer >= 1, got {budget!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not -1 <= threshold <= 1:
        raise ValueError(f"ShareKV: threshold must be a cosine in [-1, 1], got {threshold!r}")
    if rule not in RULES:
        raise ValueError(f"ShareKV: rule must be one of {', '.join(RULES)}, got {rule!r}")


def _checked_sources(sources) -> dict[int, int]:
    """``{reader: owner}`` with integer layers (JSON keys arrive as digit strings), each
    owner earlier than its reader and owning its cache."""
    if not isinstance(sources, dict):  # {} shares nothing: the model as it is
        raise ValueError(f"ShareKV: sources must be a {{reader: owner}} map, got {sources!r}")
    pairs = {}
    for reader, owner in sources.items():
        r = int(reader) if isinstance(reader, str) and reader.isdigit() else reader
        if not is_int(r) or not is_int(owner) or not 0 <= owner < r <= MAX_INT:
            raise ValueError(f"ShareKV: sources maps a layer to an earlier one "
                             f"({{reader: owner}}, both >= 0), got {reader!r}: {owner!r}")
        pairs[int(r)] = int(owner)
    chained = sorted(set(pairs) & set(pairs.values()))
    if chained:
        raise ValueError(f"ShareKV: layer {chained[0]} both reads another's cache and is read: "
                         f"map its readers to its owner ({pairs[chained[0]]})")
    return pairs
