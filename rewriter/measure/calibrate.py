"""Choosing ``SelfSpeculative``'s skip set with a cost model timed where the model will run.

Speed-up of a draft that skips a set of sub-layers, drafting ``k`` tokens a round::

    tokens per round   E = (1 - a^(k+1)) / (1 - a)      a: chance a draft token is accepted
    cost of a round    C = k * c_draft + c_verify(k + 1) (in plain decode steps)
    speed-up           E / C

``a`` is measured teacher-forced: the draft's argmax against the full model's at every
position of the calibration text, one forward each (no generation). ``c_draft`` is the
share of the weight bytes the draft still reads (a batch-1 step on a CPU is bound by them;
the LM head and embeddings always stay). ``c_verify(S)`` is timed by a measurer
(``rewriter.ir.pass_manager.Measurer``; ``rewriter.optimize`` gives the runtime's): the
decode program over ``S`` tokens against one, on the backend and device that will run it.

The search ranks every attention and MLP sub-layer by the agreement the draft loses when
it alone is skipped, per weight byte it saves, then scores every prefix of that ranking
and keeps the best
(``budget`` caps the prefix length). The evenly spread set of ``LayerSkip`` is scored
by the same model, for comparison (``predicted_speedup``).
"""
from __future__ import annotations

import time

import torch

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.pass_manager import Measurer
from rewriter.ir.skip import residual_adds, skipped
from rewriter.values import context_length


class ShortContext(PassError):
    """A timing needs more positions than the model's context: the pass that asked for it
    adds which of its own parameters to lower."""


def search(ir: IR, prompts: list[list[int]], max_draft: int, budget: int | None,
           measurer: Measurer) -> dict:
    """``{"skip_attention", "skip_mlp", "max_draft", "predicted_speedup", "agreement",
    "verify_cost", "seconds"}`` for the IR's best skip set found, verify costs timed by
    ``measurer``."""
    start = time.perf_counter()
    ids = calibration_batch(ir, prompts)
    target = _argmax(ir, ids)
    verify = measurer.verify_cost(ir, max_draft + 1)
    sizes = _unit_bytes(ir)
    total = sum(t.numel() * t.element_size() for t in ir.weights().values())
    units = [u for u in sizes if _skippable(ir, u[1])]

    def score(skip: set) -> tuple[float, float, int]:
        agree = _agreement(ir, skip, ids, target)
        c_draft = 1 - sum(sizes[u] for u in skip) / total
        return (*best_k(agree, c_draft, verify, max_draft), agree)

    alone = {u: _agreement(ir, {u}, ids, target) for u in units}
    # cheapest first: agreement lost per weight byte saved
    order = sorted(units, key=lambda u: (1 - alone[u]) / max(sizes[u], 1))[:budget]
    chosen: set = set()
    best = (1.0, 0, 1.0)
    for n in range(1, len(order) + 1):  # every prefix of the ranking: the best one wins
        trial = score(set(order[:n]))
        if trial[0] > best[0]:
            chosen, best = set(order[:n]), trial
    report = {"skip_attention": sorted(i for kind, i in chosen if kind == "attention"),
              "skip_mlp": sorted(i for kind, i in chosen if kind == "mlp"),
              "max_draft": max(1, best[1]), "predicted_speedup": best[0], "agreement": best[2],
              "verify_cost": verify, "seconds": time.perf_counter() - start}
    return report


def best_k(agree: float, c_draft: float, verify: list[float], max_draft: int) -> tuple[float, int]:
    """(predicted speed-up, draft length) of the best ``k`` in ``1..max_draft``."""
    best = (0.0, 1)
    for k in range(1, max_draft + 1):
        tokens = k + 1 if agree >= 1 else (1 - agree ** (k + 1)) / (1 - agree)
        best = max(best, (tokens / (k * c_draft + verify[k + 1]), k))  # k drafts: k + 1 verified
    return best


def predicted_speedup(ir: IR, prompts, skip_layers, skip_attention, skip_mlp, max_draft,
                      measurer: Measurer) -> dict:
    """The cost model's prediction for a given skip set (e.g. the evenly spread one)."""
    ids = calibration_batch(ir, prompts)
    target = _argmax(ir, ids)
    verify = measurer.verify_cost(ir, max_draft + 1)
    sizes = _unit_bytes(ir)
    total = sum(t.numel() * t.element_size() for t in ir.weights().values())
    skip = {("attention", i) for i in [*skip_layers, *skip_attention]} | \
        {("mlp", i) for i in [*skip_layers, *skip_mlp]}
    agree = _agreement(ir, skip, ids, target)
    speed, k = best_k(agree, 1 - sum(sizes.get(u, 0) for u in skip) / total, verify, max_draft)
    tokens = (1 - agree ** (max_draft + 1)) / (1 - agree) if agree < 1 else max_draft + 1
    return {"agreement": agree, "best_k": k, "predicted_speedup_best_k": speed,
            "predicted_speedup": tokens / (max_draft * (1 - sum(sizes.get(u, 0) for u in skip) / total)
                                           + verify[max_draft + 1])}


def prompt_length(ir: IR, tokens: int) -> int:
    """Cache positions before a timed step of ``tokens``: 64, or fewer where the model's
    context is shorter (learned position tables have no row past it)."""
    context = context_length(ir.info.get("config", {}))
    if context - tokens < 1:
        raise ShortContext(f"timing a step of {tokens} tokens needs a context of more than "
                           f"{tokens} tokens; the model has {context}")
    return min(64, context - tokens)


def calibration_batch(ir: IR, prompts) -> torch.Tensor:
    """``[B, S]``: calibration prompts cut to the shortest and to the context length, each
    id checked against the vocabulary."""
    if not prompts or not all(isinstance(p, (list, tuple)) and len(p) >= 2 for p in prompts):
        raise ValueError("calibration prompts must be lists of at least 2 token ids")
    vocab = ir.info.get("config", {}).get("vocab_size")
    context = context_length(ir.info.get("config", {}))
    bad = [t for p in prompts for t in p if vocab is not None and not 0 <= t < vocab]
    if bad:
        raise ValueError(f"calibration prompts hold token id {bad[0]}, outside the vocabulary "
                         f"[0, {vocab})")
    width = min(min(len(p) for p in prompts), context)
    return torch.tensor([list(p[:width]) for p in prompts])  # [B, S]: cut to the shortest


def sequence_inputs(ir: IR, ids: torch.Tensor) -> tuple:
    """The whole-sequence graph's inputs for ``ids`` ``[B, S]`` (no padding): the ids on the
    device of the IR's weights (prompts arrive as host lists) and their positions."""
    weight = max((t for t in ir.weights().values() if t.is_floating_point()),
                 key=torch.Tensor.numel, default=None)
    ids = ids.to(weight.device) if weight is not None else ids
    return ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def _argmax(ir: IR, ids: torch.Tensor) -> torch.Tensor:
    """The model's greedy next token at every position of ``ids`` ``[B, S]``."""
    with torch.inference_mode():
        return ir.gm(*sequence_inputs(ir, ids)).argmax(-1)


def _agreement(ir: IR, skip: set, ids: torch.Tensor, target: torch.Tensor) -> float:
    attention = sorted(i for kind, i in skip if kind == "attention")
    mlp = sorted(i for kind, i in skip if kind == "mlp")
    draft = skipped(ir, (), attention, mlp)
    return (_argmax(draft, ids) == target).float().mean().item()


def _skippable(ir: IR, index: int) -> bool:
    try:
        residual_adds(ir, index)
        return True
    except Exception:
        return False


def _unit_bytes(ir: IR) -> dict:
    """``{("attention" | "mlp", layer): weight bytes}`` from the nodes' layer and role marks."""
    sizes: dict = {}
    for n in ir.graph.find_nodes(op="get_attr"):
        users = list(n.users)
        if not users:
            continue
        layer, role = users[0].meta.get("layer"), users[0].meta.get("role")
        if layer is None or role not in ("attn", "mlp"):
            continue
        kind = "attention" if role == "attn" else "mlp"
        t = ir.weight(n.target)
        sizes[kind, layer] = sizes.get((kind, layer), 0) + t.numel() * t.element_size()
    return sizes

