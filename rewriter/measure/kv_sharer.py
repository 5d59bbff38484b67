"""Which layers may read another's KV cache without training: a calibrated search.

Both rules add sharing pairs (a later layer reads an earlier layer's cache) one at a time,
keeping a pair only while the model's final hidden states over the calibration text stay
close to the original's (their mean cosine at least ``threshold``), until ``budget``
layers read another's cache or no candidate is left:

- ``"kvsharer"`` (KVSharer, arXiv 2410.18517): candidates in order of the Euclidean
  distance between the two layers' caches averaged over the text, most dissimilar first
  (the paper's finding);
- ``"measured"``: candidates in order of their own measured cost, each pair applied
  alone first (one forward pass per candidate), cheapest first. The distance is a proxy
  for the cost the search then measures anyway; ranking by the cost itself spends the
  acceptance tests on pairs likely to pass.

Each pair's reader reads its owner's cache (an owner that reads another's is replaced by
that one, so no chains form); the IR given is not changed.
"""
from __future__ import annotations

import copy

import torch
from torch import Tensor, fx

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.sharing import attention_by_layer, share
from rewriter.measure.calibrate import sequence_inputs
from rewriter.measure.kv_similarity import distance, layer_kv
from rewriter.ops import OPS

RULES = ("kvsharer", "measured")


def search(ir: IR, ids: Tensor, budget: int, threshold: float, rule: str) -> tuple[dict, dict]:
    """``({reader: owner}, report)`` over calibration ``ids`` ``[B, T]``; the report holds
    each tried pair's hidden-state cosine and whether it was kept."""
    layers = sorted(attention_by_layer(ir.graph))
    reference = _final_hidden(ir, ids)
    candidates = _candidates(ir, ids, layers, reference, rule)
    pairs: dict[int, int] = {}
    tried = []
    for owner, reader in candidates:
        if len(pairs) >= budget:
            break
        if reader in pairs or reader in pairs.values():
            continue  # a reader already, or an owner others read
        trial = {**pairs, reader: pairs.get(owner, owner)}
        score = _score(ir, trial, ids, reference)
        tried.append({"pair": [reader, trial[reader]], "cosine": score,
                      "kept": score >= threshold})
        if score >= threshold:
            pairs = trial
    return pairs, {"rule": rule, "threshold": threshold, "tried": tried,
                   "cosine": _score(ir, pairs, ids, reference) if pairs else 1.0}


def _candidates(ir: IR, ids: Tensor, layers: list[int], reference: Tensor,
                rule: str) -> list[tuple[int, int]]:
    """``(owner, reader)`` pairs, earlier layer first, in the order ``rule`` tries them."""
    pairs = [(a, b) for i, a in enumerate(layers) for b in layers[i + 1:]]
    if rule == "kvsharer":
        far = distance(layer_kv(ir, ids))
        index = {layer: i for i, layer in enumerate(layers)}
        return sorted(pairs, key=lambda p: -float(far[index[p[0]], index[p[1]]].nan_to_num(-1)))
    cost = {p: _score(ir, {p[1]: p[0]}, ids, reference) for p in pairs}
    return sorted(pairs, key=lambda p: -cost[p])


def _score(ir: IR, pairs: dict, ids: Tensor, reference: Tensor) -> float:
    """The mean cosine of the final hidden states with ``pairs`` shared against ``reference``;
    -1 for a pair that cannot share (other head counts, a ring)."""
    trial = IR(copy.deepcopy(ir.gm), copy.deepcopy(ir.info))
    try:
        share(trial, pairs, "ShareKV(calibrate=...)")
    except PassError:
        return -1.0
    hidden = _final_hidden(trial, ids)
    return float(torch.nn.functional.cosine_similarity(hidden, reference, dim=-1).mean())


def _final_hidden(ir: IR, ids: Tensor) -> Tensor:
    """The LM head's input at every position of ``ids``: ``[B, T, hidden]``, float32."""
    (out,) = ir.graph.find_nodes(op="output")
    logits = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    if not (logits.op == "call_function" and logits.target in (OPS["linear"], OPS["linear_int4"])):
        raise PassError("ShareKV(calibrate=...) compares the LM head's input, and this model's "
                        "logits do not come from a linear head")
    run = fx.Interpreter(ir.gm, garbage_collect_values=False)
    with torch.inference_mode():
        run.run(*sequence_inputs(ir, ids))
    return run.env[logits.args[0]].float()
