"""Choosing the next token: greedy, or sampling shaped as Hugging Face shapes it.

The order and meaning follow ``transformers`` generation: logits are divided by
``temperature``, then only the ``top_k`` largest are kept, then only the smallest set of
tokens whose probabilities add up to more than ``top_p`` (always at least one). Defaults
are Hugging Face's (``temperature=1.0, top_k=50, top_p=1.0``). On a GPU everything stays
on the device: no host synchronisation per token (on a CPU top-k and top-p look among a
few candidates first, and read back which rows need the whole sort). The settings arrive
checked (``GenerationSettings``): nothing here validates again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.runtime.settings import GenerationSettings


def warp(logits: Tensor, s: GenerationSettings) -> Tensor:
    """Sampling logits ``[B, V]`` (float32) with excluded tokens at ``-inf``."""
    logits = logits.float()
    if s.temperature != 1.0:
        logits = logits / s.temperature
    top_k = s.top_k if s.top_k and s.top_k < logits.shape[-1] else None
    if top_k is None and s.top_p >= 1.0:
        return logits
    fast, ok = _among_candidates(logits, top_k, s.top_p)
    if fast is None:
        return _whole(logits, top_k, s.top_p)
    if not bool(ok.all()):  # rows whose kept tokens may reach past the candidates
        fast[~ok] = _whole(logits[~ok], top_k, s.top_p)
    return fast


def _whole(logits: Tensor, top_k: Optional[int], top_p: float) -> Tensor:
    """``warp``'s top-k and top-p over the whole vocabulary ``[B, V]`` (one sort a row)."""
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties of the k-th stay
    if top_p < 1.0:
        ascending, order = torch.sort(logits, dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)  # [B, V]
        drop = cumulative <= 1.0 - top_p  # the low tail whose mass is <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


# On a CPU top-k and top-p first look among this many of the most likely tokens: sorting
# a whole vocabulary was most of a sampled step's warping (SmolLM2's 49,152 logits on the
# 2-core Xeon: 2.9 ms a row, against 0.15 for the 256 largest), and what they keep is
# usually far fewer tokens.
CANDIDATES = 256


def _among_candidates(logits: Tensor, top_k: Optional[int], top_p: float) -> tuple:
    """``(warped [B, V], ok [B])``: ``warp``'s top-k and top-p over the ``CANDIDATES`` largest
    logits of each row, right where ``ok`` (elsewhere what they keep may reach past the
    candidates); ``(None, None)`` for top-k alone (its one ``topk`` is cheap) and where the
    candidates are not fewer than the vocabulary or than top-k.

    Top-k keeps every logit at least the k-th largest (its ties too, as Hugging Face's
    ``TopKLogitsWarper``). Top-p keeps the smallest set of tokens whose mass is more than
    ``top_p``, as ``TopPLogitsWarper``, which drops the low tail whose ascending cumulative
    mass is at most ``1 - top_p``: it keeps a token while the mass ranked above it is less
    than ``top_p``, and always the most likely one."""
    m = CANDIDATES
    if top_p >= 1.0 or m >= logits.shape[-1] or (top_k is not None and top_k >= m):
        return None, None  # top-k alone needs no sort (measured a little faster whole)
    if logits.device.type != "cpu":  # a GPU sorts fast, and rows falling back would be a
        return None, None  # read back each step (the runtime reads none while sampling)
    vals, at = logits.topk(m, dim=-1)  # [B, m], descending
    ok = torch.ones(len(logits), dtype=torch.bool, device=logits.device)
    if top_k is not None:
        kth = vals[:, top_k - 1:top_k]  # [B, 1]
        ok &= vals[:, -1] < kth[:, 0]  # else the k-th's ties may lie past the candidates
        vals = vals.masked_fill(vals < kth, float("-inf"))
    # top-p: each candidate's share of the whole distribution (after top-k: of the candidates)
    total = (vals if top_k is not None else logits).logsumexp(-1, keepdim=True)  # [B, 1]
    probs = (vals - total).exp()  # [B, m]
    keep = probs.cumsum(-1) - probs < top_p  # the mass ranked above each
    keep[:, 0] = True
    # the nucleus ends inside the candidates, and no token past them ties with one it keeps
    # (ties are kept in no particular order, as by Hugging Face's unstable sort)
    ok &= vals.masked_fill(~keep, float("inf")).amin(-1) > vals[:, -1]
    vals = vals.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, at, vals), ok


def greedy(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)``, 2-5x faster on a CPU: ``max`` over the last dimension returns
    the same index (the first largest, NaN counting as largest, on every device), and its
    CPU kernel is faster (2-core Xeon, torch 2.13, SmolLM2's 49,152 logits in bfloat16:
    0.16 ms against 0.04 for one row, 1.25 ms against 0.27 for a 15-node tree's rows)."""
    return logits.max(-1).indices


def next_token(logits: Tensor, s: GenerationSettings,
               generator: Optional[torch.Generator]) -> Tensor:
    """The chosen token of every row, ``[B]`` int64, from last-position logits ``[B, V]``."""
    if not s.do_sample:
        return greedy(logits)
    return draw(warp(logits, s).softmax(-1), generator)


# False: ``draw`` is ``torch.multinomial`` on a CPU too (``benchmarks/sampled_decode.py``
# at commit ef67032 timed both)
CDF_DRAWS = True


def draw(probs: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """One token a row, ``[B]`` int64, drawn from ``probs`` ``[B, V]`` (non-negative; rows
    need not sum to exactly 1), as ``torch.multinomial(probs, 1)`` draws it.

    On a CPU by the inverse of the cumulative distribution, in float64: a uniform draw
    below the row's total and the first token whose cumulative mass passes it, which has
    mass of its own. ``multinomial`` draws an exponential variate for every token of the
    vocabulary: 0.86 ms a row for SmolLM2's 49,152 on the 2-core Xeon, 3% of a decode step."""
    if probs.dim() != 2:
        raise ValueError(f"sampling.draw: probs must be [B, V], got {tuple(probs.shape)}")
    if probs.device.type != "cpu" or not CDF_DRAWS:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    cum = probs.double().cumsum(-1)  # [B, V]
    total = cum[:, -1:]  # [B, 1]
    if not bool(((total > 0) & total.isfinite()).all()) or bool((probs < 0).any()):
        raise RuntimeError("sampling: a row's probabilities are negative, not finite or all zero")
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device) * total
    # below the total, however the product rounds: some token's cumulative mass passes it
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, u, right=True).squeeze(-1)
