"""A tree's layout on the device (``rewriter.drafts.tree.Tree.layout``) and Hydra's level-by-level
drafting plan (``level_plan``), made once and kept across generations and engines (``kept``)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from rewriter.drafts.tree import Tree

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


def level_plan(lay: dict, depth: int, device: Optional[torch.device] = None) -> list[tuple]:
    """Hydra's drafting plan, one entry per tree level ``d``: the depth-``d`` nodes with
    children (``parents``), their paths from the root (``chains`` ``[P, d + 1]``), the
    depth-``d + 1`` nodes (``children``), each child's parent slot in ``parents`` and
    rank, and how many ranks the level needs."""
    host = lambda v: v.tolist() if isinstance(v, Tensor) else list(v)  # noqa: E731
    parent, depth_of, rank = host(lay["parent"]), host(lay["depth"]), host(lay["rank"])
    device = device if device is not None else lay["parent"].device
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    out = []
    for d in range(depth):
        children = [i for i, x in enumerate(depth_of) if x == d + 1]
        parents = sorted({parent[c] for c in children})
        chains = []
        for p in parents:
            chain = [p]
            while chain[-1] > 0:
                chain.append(parent[chain[-1]])
            chains.append(chain[::-1])  # [d + 1]: root .. p
        slot = [parents.index(parent[c]) for c in children]
        out.append((t(parents), t(chains), t(children), t(slot), t([rank[c] for c in children]),
                    max(rank[c] for c in children) + 1, parents))
    return out
