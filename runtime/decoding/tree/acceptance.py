"""Which drafted tokens a round keeps when it samples, or accepts typically
(``acceptance="typical"``): the rules that walk the tree node by node (greedy exact
acceptance is one masked reduction, in ``rounds``).

Sampling accepts child ``c`` with probability ``p'(c)`` and, if it is rejected, removes
``c`` from ``p'`` and renormalises (recursive rejection sampling with one-token proposals:
the output follows the model's distribution exactly); typical acceptance (lossy) accepts a
child whose probability exceeds ``min(threshold, alpha * exp(-entropy))``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.decoding import TreeDecoding

from ...sampling import draw, warp
from ...settings import GenerationSettings


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
