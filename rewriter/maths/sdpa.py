"""``sdpa``: ``F.scaled_dot_product_attention`` with a faster path for one-query steps of
bfloat16/float16 on a CPU.

On some CPUs ATen's kernel is slow for exactly the call a decode step makes: one query
per head in bfloat16. On a 2-core AMD EPYC without AMX (torch 2.13) it took 0.17 ms for
SmolLM2's 9 query heads over 300 cached keys and 2.1 ms over 4000, where the same call
with two queries takes 0.06 and 0.65: its cost does not grow with the queries, so a
one-token step pays the most per token. On a 2-core Intel Xeon with AMX the same kernel
takes 0.14-0.16 ms over 4096 keys, three times faster than this path. So whether the path
pays is measured on the machine, once a process and dtype (``_choice``), and the kernel
keeps every call where it is not clearly slower; ``REWRITER_SDPA_PATH=on|off`` fixes the
choice by hand. In float32 the kernel is fast (0.03 ms at 300 keys), and on a GPU it is
not this kernel at all; both are left to it.

For short caches the kernel is faster still, and keeps them (``_SMALL``).

The path here computes scores, softmax and the weighted sum in float32 from the bfloat16
inputs and rounds once, at the end: its output is float32 attention rounded (the kernel
also rounds its softmax weights to bfloat16 before the weighted sum, so its error is
larger, never smaller; ``tests/test_sdpa.py``). Queries are grouped under their key/value
head (``enable_gqa``), so the cache is read once per KV head, not once per query head.
``benchmarks/decode_attention.py`` (at commit ef67032) timed both: on the EPYC 1.3-2.1x
faster than the kernel at 128-256 keys, 4-6x at 1024-4096, batch 1 and 4; on the Xeon
2-3.5x slower.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_LOW = (torch.bfloat16, torch.float16)
# float32 elements of K (and as many of V) made at once: rows of a batch are taken in
# groups under this, so 8 rows of an 8k cache do not build 100 MB of copies (measured:
# all 8 at once ran as slowly as the kernel, 33 ms; two rows at a time 7-9 ms).
_CHUNK = 1 << 22
# Below this many (row, query head, key) triples the kernel is faster: this path's few
# extra calls cost about 30 us, the kernel about 0.06 us a triple (SmolLM2's 9 heads at
# batch 1: even at 64 keys, the kernel ahead below, this path ahead from 128).
_SMALL = 1024
# Whether this path pays, by dtype, on this machine: measured at the first call that could
# take it (``_measure``), then kept for the process.
_PAYS: dict = {}
# The measured call: SmolLM2's heads over 1024 keys, batch 1 (there the EPYC's kernel took
# 3.7x the path's time, the Xeon's 0.4x in bfloat16 and about 1.35x in float16), and how much
# faster the path must be to take the calls: a margin so that a machine where the two are
# close (the Xeon in float16) keeps ATen's kernel. Each side's fastest call of ``_RUNS``
# counts: a busy machine only adds time, and the fastest is what the call costs unhindered
# (medians of 15 flipped the choice between processes on a loaded 2-core machine).
_PROBE = (1, 9, 3, 1024, 64)  # batch, query heads, KV heads, keys, head dim
_MARGIN = 1.5
_RUNS = 21
_clock = time.perf_counter  # the probe's clock (a test's fake one)
_LOCK = threading.Lock()  # one probe at a time: two at once would slow each other
# "auto" (measure), "on" (the path wherever it applies), "off" (the kernel always): a
# machine's choice fixed by hand, e.g. for runs that must round the same every time
ENV = "REWRITER_SDPA_PATH"


try:  # private torch APIs: without them tracing is told by torch.compiler alone
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE_TENSOR, FakeTensorMode as _FAKE_MODE
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    _FAKE = (_FAKE_TENSOR, _get_current_dispatch_mode_stack)
except ImportError:
    _FAKE, _FAKE_MODE = None, None


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
         scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """q ``[B, Hq, S, D]``, k/v ``[B, Hkv, T, D]``, ``attn_mask`` bool, broadcast to ``[B,
    Hq, S, T]`` (True = may attend) -> ``[B, Hq, S, D]``, as
    ``F.scaled_dot_product_attention``; a query that may attend to nothing gets zeros."""
    if not _grouped_case(q, k, v, attn_mask, enable_gqa):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                              enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rows = max(1, _CHUNK // max(1, k[0].numel()))
    if rows >= q.shape[0]:
        return _grouped(q, k, v, attn_mask, scale)
    return torch.cat([_grouped(q[b:b + rows], k[b:b + rows], v[b:b + rows],
                               _rows(attn_mask, b, rows), scale)
                      for b in range(0, q.shape[0], rows)])


def _rows(mask: Optional[Tensor], start: int, n: int) -> Optional[Tensor]:
    """The mask of rows ``[start, start + n)``: a mask shared by every row is all of it."""
    return mask if mask is None or mask.shape[0] == 1 else mask[start:start + n]


def _grouped_case(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], gqa: bool) -> bool:
    """The slow kernel's case, with inputs this path reads as SDPA would (heads grouped
    only where SDPA would group them: ``enable_gqa``)."""
    return (q.device.type == "cpu" and q.dim() == 4 and q.shape[2] == 1 and q.shape[0] > 0
            and q.dtype in _LOW and k.dtype == q.dtype and v.dtype == q.dtype
            and k.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0]
            and q.shape[1] % k.shape[1] == 0 and k.shape[3] == q.shape[3]
            and (gqa or q.shape[1] == k.shape[1])
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                  and mask.shape[0] in (1, q.shape[0])
                                  and mask.shape[1] in (1, q.shape[1])
                                  and mask.shape[2:] == (1, k.shape[2])))
            and q.shape[0] * q.shape[1] * k.shape[2] >= _SMALL
            and _pays(q))


def path_taken(dtype: torch.dtype) -> bool:
    """Whether one-query calls in ``dtype`` big enough for the path take it in this process
    (measured now if not yet): for benchmarks to record beside their figures."""
    return dtype in _LOW and _SMALL != math.inf and _choice(dtype)


def _pays(q: Tensor) -> bool:
    """Whether the path is clearly faster than the kernel here in ``q``'s dtype: as the
    environment fixes it, else as measured. While tracing (fake tensors, ``torch.compile``)
    nothing is timed or kept: the kernel, unless the environment says otherwise."""
    if _setting() == "auto" and _tracing(q):
        return False
    return _choice(q.dtype)


def _setting() -> str:
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"{ENV} must be auto, on or off, got {os.environ[ENV]!r}")
    return setting


def _choice(dtype: torch.dtype) -> bool:
    setting = _setting()
    if setting != "auto":
        return setting == "on"
    if dtype not in _PAYS:
        with _LOCK:
            if dtype not in _PAYS:
                _PAYS[dtype] = _measure(dtype)
    return _PAYS[dtype]


def _tracing(q: Tensor) -> bool:
    """Whether ``q`` is being traced rather than computed (so a timing would be wrong):
    ``torch.compile``, or fake tensors (``torch.export``); False where this torch has
    neither way to tell."""
    if torch.compiler.is_compiling():
        return True
    if _FAKE is None:
        return False
    fake, modes = _FAKE
    return isinstance(q, fake) or any(isinstance(m, _FAKE_MODE) for m in modes())


def _measure(dtype: torch.dtype) -> bool:
    """Time the kernel and the path on ``_PROBE``'s call, interleaved, each one's fastest of
    ``_RUNS``: 3-16 ms on the project's CPUs, once a process and dtype."""
    b, hq, hkv, t, d = _PROBE
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g, device="cpu").to(dtype)
               for h, n in ((hq, 1), (hkv, t), (hkv, t)))
    calls = {"kernel": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
             "path": lambda: _grouped(q, k, v, None, 1.0 / math.sqrt(d))}
    times: dict = {name: [] for name in calls}
    with torch.inference_mode():
        for run in range(_RUNS + 2):  # two warm-up calls each
            for name, call in calls.items():
                start = _clock()
                call()
                if run >= 2:
                    times[name].append(_clock() - start)
    return min(times["path"]) * _MARGIN < min(times["kernel"])


def _grouped(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """One-query attention of ``_grouped_case``'s inputs, in float32: -> ``[B, Hq, 1, D]``."""
    b, hq, _, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d).float().mul_(scale)  # [B, Hkv, G, D]: head h reads KV head h // G
    scores = qg @ k.float().transpose(-1, -2)  # [B, Hkv, G, T]
    if mask is None:
        weights = scores.softmax(-1)
    else:
        if mask.shape[1] == 1:  # every head alike
            seen = mask.reshape(mask.shape[0], 1, 1, t)  # [B or 1, 1, 1, T]
        else:  # per query head, in SDPA's order
            seen = mask.reshape(mask.shape[0], hkv, g, t)  # [B or 1, Hkv, G, T]
        weights = scores.masked_fill_(seen.logical_not(), float("-inf")).softmax(-1)
        sees = seen.any(-1, keepdim=True)  # [B or 1, Hkv or 1, G or 1, 1]
        if not sees.all():  # a query that sees no key: SDPA's CPU kernel gives zeros, softmax NaN
            weights = torch.where(sees, weights, 0.0)
    out = weights @ v.float()  # [B, Hkv, G, D]
    return out.reshape(b, hq, 1, d).to(q.dtype)


@contextlib.contextmanager
def kernel_only():
    """Every call to ATen's kernel while inside: to measure this path against it."""
    global _SMALL
    saved, _SMALL = _SMALL, math.inf
    try:
        yield
    finally:
        _SMALL = saved
