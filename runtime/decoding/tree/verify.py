"""Verifying a round's tree: its layout on the device (``rewriter.drafts.tree.Tree.layout``,
made once and kept across generations and engines: ``kept``), which drafted tokens the
model accepts, and the K/V compaction after it.

Greedy exact acceptance is one masked reduction (``greedy``): the longest path whose every
token is the model's argmax after its parent. Sampling and typical acceptance walk the tree
node by node (``walk``): sampling accepts child ``c`` with probability ``p'(c)`` and, if it
is rejected, removes ``c`` from ``p'`` and renormalises (recursive rejection sampling with
one-token proposals: the output follows the model's distribution exactly); typical
acceptance (lossy) accepts a child whose probability exceeds
``min(threshold, alpha * exp(-entropy))``. The token after the path is the model's.

Compaction (``compact``) moves the accepted path's K/V rows from ``length + i`` to
``length + depth``; the rest is left behind the row's new length (masked until overwritten).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from rewriter.decoding import TreeDecoding
from rewriter.drafts.tree import Tree

from ...kv_cache import KVCache
from ...sampling import draw, greedy as argmax, warp
from ...settings import GenerationSettings

LAYOUTS = 512  # laid-out trees kept across generations (re-shaped trees repeat: code, chat)

_KEPT: dict = {}  # (what, paths, device) -> a tree's layout or Hydra's plan (``kept``)


def kept(key: tuple, device: torch.device, make: Callable[[], Any]):
    """``make()``, kept across generations and engines by ``key`` and device (the most
    recent ``LAYOUTS``): a layout is a few tensors copied from the host, and each copy
    waits for a GPU's queued work. What is kept is only read, never written."""
    key = (*key, str(device))
    value = _KEPT.pop(key, None)
    if value is None:
        value = make()
        while len(_KEPT) >= LAYOUTS:
            del _KEPT[next(iter(_KEPT))]  # the least recently used
    _KEPT[key] = value
    return value


def host_layout(tree: Tree) -> dict:
    """``tree.layout()``'s ``parent``, ``depth`` and ``rank`` as host lists: the same
    numbering, made without a device (a plan made mid-generation reads nothing back)."""
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    return {"parent": [-1] + [index.get(p[:-1], 0) for p in tree.paths],
            "depth": [0] + [len(p) for p in tree.paths], "rank": [-1] + [p[-1] for p in tree.paths]}


class Greedy(NamedTuple):
    """Greedy acceptance's verdict, read back once: per row the accepted path (node indices,
    root excluded) and the token after it; the heads' tree's own accepted depth (where a
    copied chain was verified beside it, else None); the verified tokens on the host
    ``[B][m]`` with the accepted node ``[B]`` and the token after it ``[B]`` on the device;
    and the ``extra`` tensors' rows on the host (None where none were given)."""
    paths: list
    bonus: list
    tree_depth: Optional[list]
    read: tuple
    extra: Optional[list]


def greedy(logits: Tensor, tokens: Tensor, lay: dict, heads: Optional[list[bool]],
           extra: list[Tensor]) -> Greedy:
    """Greedy exact acceptance of ``tokens`` ``[B, m]`` laid out as ``lay``. ``heads``: per
    verified node, whether the heads drafted it (not a copied chain), to report the heads'
    tree's own depth; ``extra``: ``[B, n]`` tensors read back with the verdict."""
    target = argmax(logits)  # [B, m]
    parent, depth = lay["parent"], lay["depth"]
    m, device = tokens.shape[1], tokens.device
    right = tokens == target[:, parent.clamp_min(0)]  # [B, m]: the model's choice after its parent
    right[:, 0] = True  # the root: the model's own
    # a node is accepted when it and every ancestor are right (one masked reduction,
    # not a Python pass over the nodes: this runs every round)
    ok = ~((~right)[:, None, :] & lay["ancestors"][None]).any(-1)  # [B, m]
    # the accepted nodes form one path, its deepest taken (siblings hold different
    # tokens, except a copied chain's first token, which may repeat a head's: then
    # both branches are the model's own text, and the deepest is still exact)
    best = torch.where(ok, depth[None] * m + torch.arange(m, device=device), -1).argmax(1)
    bonus = target[torch.arange(len(best), device=device), best]  # [B]
    parts = [best[:, None], bonus[:, None]]
    if heads is not None:  # the heads' nodes' own best
        drafted = torch.tensor(heads[:m], device=device)
        parts.append(torch.where(ok & drafted[None], depth[None], 0).amax(1)[:, None])
    # one read back a round (on a GPU each one waits for the queued work):
    # [B, 2 (+ 1) + m (+ extra)]
    read = torch.cat([*parts, tokens, *extra], 1).tolist()
    c = len(parts)
    return Greedy([lay["paths"][row[0]] for row in read], [row[1] for row in read],
                  [row[2] for row in read] if c == 3 else None,
                  ([row[c:c + m] for row in read], best, bonus),
                  [row[c + m:] for row in read] if extra else None)


def walk(logits: Tensor, tokens: Tensor, children: list, s: GenerationSettings,
         record: TreeDecoding, generator: Optional[torch.Generator]) -> tuple[list, list]:
    """Per row: the accepted path (node indices, root excluded) and the token after it,
    walking the tree from the root (``children``: each node's, by index)."""
    typical = record.acceptance == "typical"
    paths, bonus = [], []
    for r in range(tokens.shape[0]):
        node, path = 0, []
        while True:
            row = logits[r, node][None]  # [1, V]
            p = warp(row, s).softmax(-1)[0] if s.do_sample else row.float().softmax(-1)[0]
            chosen = None
            for c in children[node] if node < len(children) else []:
                t = int(tokens[r, c])
                if typical:
                    if typical_accepts(row, t, s, record):
                        chosen = c
                        break
                    continue
                u = torch.rand((), generator=generator, device=p.device)
                if u < p[t]:
                    chosen = c
                    break
                rest = p.clone()
                rest[t] = 0  # rejected: the rest of the distribution, renormalised
                total = rest.sum()
                if total <= 0:  # rounding left no mass: p was all on t (then u < p[t])
                    break
                p = rest / total
            if chosen is None:
                if s.do_sample:
                    extra = int(draw(p[None], generator)[0])
                else:
                    extra = int(row.argmax())
                bonus.append(extra)
                paths.append(path)
                break
            path.append(chosen)
            node = chosen
    return paths, bonus


def typical_accepts(row: Tensor, token: int, s: GenerationSettings,
                    record: TreeDecoding) -> bool:
    """Medusa's typical acceptance on the model's own (temperature-scaled) distribution."""
    logits = row.float() / (s.temperature if s.do_sample else 1.0)
    p = logits.softmax(-1)[0]
    entropy = -(p * p.clamp_min(1e-30).log()).sum()
    limit = torch.minimum(torch.tensor(record.posterior_threshold),
                          record.posterior_alpha * torch.exp(-entropy))
    return bool(p[token] > limit)


def compact(cache: KVCache, length: list[int], paths: list[list[int]], stats: Counter,
            device: torch.device) -> None:
    """Move each row's accepted nodes from ``length + i`` to ``length + depth``."""
    moves = [(r, length[r] + i, length[r] + d) for r, p in enumerate(paths)
             for d, i in enumerate(p, start=1) if i != d]
    if not moves:
        return
    rows, src, dst = torch.tensor(moves, device=device).unbind(1)  # one copy: [n, 3]
    cache.move(rows, src, dst)  # gathered first: sources lie past targets
    stats.update(kv_moves=len(moves))
