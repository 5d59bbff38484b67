"""Sink + window caches (``StreamingAttention``): a layer's K/V in a ring of ``sinks +
window`` slots, whatever the sequence's length.

Slots are addressed by a token's *real index* ``r`` in its row (its cache position minus
the row's left padding): the first ``sinks`` real tokens keep slots ``0 .. sinks-1`` for
good, and token ``r >= sinks`` goes to ``sinks + (r - sinks) % window``, overwriting the
token ``window`` before it, which no later query sees. One more slot, the last, takes what
must not be kept (padding, and tokens of a long step that a later token of the same step
overwrites), and is never read. So memory is ``sinks + window + 1`` slots per row, and a
row's sinks are its own first real tokens under left padding too.

Keys are stored as the model computes them: rotated (RoPE) at their true positions. RoPE
scores depend only on the distance between query and key, and StreamingLLM's renumbering
inside the cache keeps every distance inside the window as it was: only the sinks move,
to just before the window. So with the ``rotary`` frequencies (``StreamingAttention``
gives them for rotary models) a query scores the sinks rotated back by how far it is past
a full cache, and no distance ever exceeds ``sinks + window - 1`` (docs/design.md).

What a slot holds follows from how many real tokens the row has written, ``n``, so nothing
but the K/V tensors is stored: the step's first real index is ``start - pad`` and every
mask is computed from it (on the device, so a CUDA-graph decode step can use it too).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.errors import RewriterError
from rewriter.ops import REFERENCE
from rewriter.maths.mask import visible as attention_visible
from rewriter.maths.sdpa import sdpa

from .kernels import KERNELS


def ring_attention(step, q: Tensor, k: Tensor, v: Tensor, spec, cos: Optional[Tensor] = None,
                   sin: Optional[Tensor] = None, rotary: Optional[Tensor] = None,
                   kernel: Optional[Callable] = None) -> Tensor:
    """``rw.attention`` with ``spec.sinks`` (``spec``: the op's ``CacheSpec``): q ``[B, S,
    Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``, K/V kept in the ring of cache
    ``spec.id``; with ``rotary`` the sinks at StreamingLLM's positions
    (``rewriter.ops.sink_attention``). ``kernel`` (a
    backend's ``decode_attention``) serves one-token steps: it reads the visible slots
    through a per-row index and scores the sinks with the query rotated back."""
    num_heads, num_kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    scale, window, sinks = spec.scale, spec.window, spec.sinks
    if cos is not None:
        q, k = KERNELS["rope"](q, cos, sin, head_dim), KERNELS["rope"](k, cos, sin, head_dim)
    b, s, _ = q.shape
    k_ring, v_ring = step.cache.k[spec.id], step.cache.v[spec.id]  # [B, Hkv, C + 1, D]
    size = k_ring.shape[2] - 1  # sinks + window, or fewer for sequences that never wrap
    # A ring shorter than its sinks (sequences shorter than them) holds sinks only, the
    # same under either count, so no score changes; and no step sizes anything by more
    # sinks than the ring has slots (an artifact may claim a context as long as its sinks)
    sinks = min(sinks, size)
    new_k = k.view(b, s, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    new_v = v.view(b, s, num_kv_heads, head_dim).transpose(1, 2)
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, Hq, S, D]
    first = step.once("ring_first", lambda: first_real_index(step, b))  # [B]
    r_new = first[:, None] + torch.arange(s, device=first.device)  # [B, S]
    gqa = num_heads != num_kv_heads
    if s == 1:
        # One token: written first, then read with the ring. It overwrites only the key a
        # window behind it, which it would not see anyway.
        if spec.write:  # else written by the owner this step (ShareKV)
            _write(k_ring, v_ring, new_k, new_v, r_new, first + 1, sinks, window, size)
        held = step.once(("ring_held", window, sinks),
                         lambda: slot_contents(first + 1, sinks, window, size))  # [B, C]
        mask = step.once(("ring_decode", window, sinks),
                         lambda: visible(r_new, held, window, sinks)[:, None])  # [B, 1, 1, C]
        if kernel is not None and step.tree is None:
            out = _kernel_decode(kernel, step, qh, k_ring, v_ring, mask, scale, rotary, r_new,
                                 sinks, window, head_dim, size)
            return out.reshape(b, 1, num_heads * head_dim)  # [B, 1, Hq*D]
        out = _attend(step, qh, k_ring[:, :, :size], v_ring[:, :, :size], mask, scale, gqa,
                      rotary, held, r_new, sinks, window, head_dim)
    else:
        # Several tokens: an early one may need a key a later one overwrites, so they read
        # the ring as it was plus the step's own keys, and are written after.
        keys, values = step_keys(step, spec, k_ring, v_ring, new_k, new_v, size)
        mask = step.once(("ring_step", window, sinks), lambda: _step_mask(first, r_new, sinks,
                                                                          window, size))
        held = step.once(("ring_step_held", window, sinks), lambda: torch.cat(
            [slot_contents(first, sinks, window, size), r_new], dim=1))  # [B, C + S]
        out = _attend(step, qh, keys, values, mask, scale, gqa, rotary, held, r_new, sinks,
                      window, head_dim)
        if spec.write:
            _write(k_ring, v_ring, new_k, new_v, r_new, first + s, sinks, window, size)
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)  # [B, S, Hq*D]


def step_keys(step, spec, k_ring: Tensor, v_ring: Tensor, new_k: Tensor, new_v: Tensor,
               size: int) -> tuple[Tensor, Tensor]:
    """What a multi-token step attends to: the ring as it was, then the step's own K/V
    ``[B, Hkv, C + S, D]``. A ring other layers read (``ShareKV``) keeps them for the
    step, made by its writer: its readers run after the write, which may have overwritten
    keys the step's early tokens see."""
    def make():
        return (torch.cat([k_ring[:, :, :size], new_k], dim=2),  # [B, Hkv, C + S, D]
                torch.cat([v_ring[:, :, :size], new_v], dim=2))
    if spec.write and not spec.read_after:
        return make()
    return step.once(("ring_keys", spec.id), make if spec.write else lambda: _unwritten(spec))


def _unwritten(spec):
    raise RewriterError(f"the ring of cache {spec.id} is read before its owner wrote this "
                        f"step's keys: the owner's attention must run first")


def _attend(step, qh: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
            gqa: bool, rotary: Optional[Tensor], held: Tensor, r_new: Tensor, sinks: int,
            window: int, head_dim: int) -> Tensor:
    """qh ``[B, Hq, S, D]`` over keys/values ``[B, Hkv, K, D]`` whose real indices are
    ``held`` ``[B, K]``: SDPA, with ``rotary`` at StreamingLLM's sink positions."""
    if rotary is None or sinks == 0:
        return sdpa(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # what depends on the step only (the same in every ring layer), made once a step
    lay = step.once(("ring_sinks", window, sinks, held.shape[1], id(rotary), keys.dtype, head_dim),
                    lambda: sink_layout(held, r_new, sinks, window, rotary, keys.dtype,
                                        head_dim))
    return sink_sdpa(qh, keys, values, mask, scale, lay, head_dim)


def sink_layout(held: Tensor, r_new: Tensor, sinks: int, window: int, rotary: Tensor,
                dtype: torch.dtype, head_dim: int) -> dict:
    """The parts of ``sink_sdpa`` fixed by the step: for keys whose real indices are
    ``held`` ``[B, K]`` and queries at ``r_new`` ``[B, S]``, each sink's column (``at``
    ``[B, sinks]``) and which query sees it, the keys' extra features (a one-hot for
    a sink, zeros for the others) and the window keys' mask, and the rotation that takes
    each query back to StreamingLLM's sink positions."""
    n = held.shape[1]
    is_sink = (held >= 0) & (held < sinks)  # [B, K]
    column = torch.where(is_sink, torch.arange(n, device=held.device), n)  # [B, K]
    at = torch.full((len(held), sinks + 1), n, dtype=torch.int64, device=held.device)
    at.scatter_reduce_(1, torch.where(is_sink, held, sinks), column, "amin")
    at = at[:, :sinks]  # n where the row has not written that sink yet
    # the extra features, padded so keys are a multiple of 8 wide (SDPA's fused kernels ask
    # for it on GPUs; zeros change no score)
    extra = -(-(head_dim + sinks) // 8) * 8 - head_dim
    one_hot = F.one_hot(torch.where(is_sink, held, sinks), sinks + 1)[..., :sinks]  # [B, K, sinks]
    features = F.pad(one_hot, (0, extra - sinks))[:, None].to(dtype)  # [B, 1, K, extra]
    shift = (r_new - (sinks + window - 1)).clamp(min=0)  # [B, S]
    cos, sin = REFERENCE["rotary"](shift, rotary, 1.0)  # [B, S, R]
    # which query sees which sink: written (at < n) and not after the query (causal; a
    # padding query, r < 0, sees none)
    seen = (at < n)[:, None] & (torch.arange(sinks, device=held.device) <= r_new[..., None])
    return dict(at=at.clamp(max=n - 1), seen=seen[:, None], features=features,  # seen [B, 1, S, sinks]
                keep=(~is_sink)[:, None, :, None].to(dtype), cos=cos, sin=sin)


def sink_sdpa(qh: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, lay: dict,
              head_dim: int) -> Tensor:
    """``rewriter.ops.sink_attention`` as one SDPA call, so a long prompt step never holds
    its ``[B, Hq, S, K]`` scores (on a CPU, whose SDPA kernel takes a mask and GQA). A
    sink's score needs the query rotated back (per query), so each query carries its
    ``sinks`` sink scores as extra features and each sink key a one-hot in those features
    and zeros in its own: ``[q, s] . [0, e_j] = s_j`` and ``[q, s] . [k, 0] = q . k``. The
    values get as many zero features, since SDPA's fast CPU path wants values as wide as
    keys (8 features more cost 10-13% over plain SDPA on an AMD EPYC; keys wider than
    values fall to its math path, 3x slower). ``lay`` is ``sink_layout``'s."""
    b, hq, s, d = qh.shape
    hkv, n = keys.shape[1], keys.shape[2]
    sinks, extra = lay["at"].shape[1], lay["features"].shape[-1]
    sink_k = keys.gather(2, lay["at"][:, None, :, None].expand(b, hkv, sinks, d))  # [B, Hkv, sinks, D]
    flat = qh.transpose(1, 2).reshape(b, s, hq * d)  # [B, S, Hq*D]
    back = REFERENCE["rope"](flat, lay["cos"], -lay["sin"], head_dim).view(b, s, hkv, hq // hkv, d)
    back = back.permute(0, 2, 3, 1, 4).reshape(b, hkv, hq // hkv * s, d)  # [B, Hkv, G*S, D]
    sink_scores = (back @ sink_k.transpose(-1, -2)).view(b, hq, s, sinks)  # [B, Hq, S, sinks]
    # a sink the query does not see is masked, but its score multiplies zeros in every
    # other column: an overflow (inf) there would make NaN of the query's whole row
    sink_scores = torch.where(lay["seen"], sink_scores, 0)
    wide_k = torch.cat([keys * lay["keep"], lay["features"].expand(b, hkv, n, extra)],
                       dim=-1)  # [B, Hkv, K, D + extra]
    wide_v = F.pad(values, (0, extra))  # [B, Hkv, K, D + extra]
    wide_q = torch.cat([qh, F.pad(sink_scores.to(qh.dtype), (0, extra - sinks))],
                       dim=-1)  # [B, Hq, S, D + extra]
    out = sdpa(wide_q, wide_k, wide_v, attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    return out[..., :d]  # [B, Hq, S, D]


def _kernel_decode(kernel: Callable, step, qh: Tensor, k_ring: Tensor, v_ring: Tensor,
                   mask: Tensor, scale: float, rotary: Optional[Tensor], r_new: Tensor,
                   sinks: int, window: int, head_dim: int, size: int) -> Tensor:
    """One token through a decode kernel: qh ``[B, Hq, 1, D]`` over the ring's slots that
    ``mask`` ``[B, 1, 1, C]`` shows, named by an index ``[B, Hkv, C]`` (-1: not read) ->
    ``[B, Hq, D]``. With ``rotary`` the sink slots are scored by the query rotated back by
    how far it is past a full ring, which is what ``sink_attention`` computes."""
    b, hq, _, d = qh.shape
    hkv = k_ring.shape[1]
    q = qh[:, :, 0].contiguous()  # [B, Hq, D]
    index = step.once(("ring_index", window, sinks), lambda: torch.where(
        mask[:, :, 0], torch.arange(size, device=mask.device), -1))  # [B, 1, C]
    q_sink = None
    if rotary is not None:
        # the rotation back, once a step per frequency table (a model constant, so its id
        # names it for the step): the layers' tables are usually one
        cos, sin = step.once(("ring_back", window, sinks, id(rotary)), lambda: REFERENCE["rotary"](
            (r_new - (sinks + window - 1)).clamp(min=0), rotary, 1.0))  # [B, 1, R]
        back = REFERENCE["rope"](q.view(b, 1, hq * d), cos, -sin, head_dim)  # [B, 1, Hq*D]
        q_sink = back.view(b, hq, d).contiguous()
    # no padding in the ring's slots: every row starts at slot 0 (the same value, under the
    # same key, as the Triton backend's other decode steps)
    start = step.once("zeros", lambda: torch.zeros(b, dtype=torch.int64, device=q.device))
    return kernel(q, k_ring, v_ring, size, scale, start=start,
                  index=index.expand(b, hkv, size), q_sink=q_sink, sink_slots=min(sinks, size))


def first_real_index(step, batch: int) -> Tensor:
    """``[B]``: the real index of the step's first token in each row (negative while the
    row's left padding is being written)."""
    if step.on_device:  # [B], or one position for every row
        start = step.start.expand(batch)
    else:
        start = torch.full((batch,), step.start, dtype=torch.int64, device=step.cache.device)
    return start - step.pad if step.pad is not None else start


def slot_contents(n: Tensor, sinks: int, window: int, size: Optional[int] = None) -> Tensor:
    """``[B, size]``: the real index each slot holds once a row has written ``n`` ``[B]``
    real tokens, -1 where it holds none. ``size`` (default ``sinks + window``) may be
    smaller: a ring for sequences that never wrap it."""
    size = sinks + window if size is None else size
    n = n.clamp(min=0)[:, None]  # [B, 1]
    i = torch.arange(min(sinks, size), device=n.device)[None]  # [1, sinks]
    sink = torch.where(i < n, i, -1)
    j = torch.arange(max(0, size - sinks), device=n.device)[None]  # [1, W]
    m = n - sinks  # tokens past the sinks
    latest = sinks + j + window * ((m - 1 - j).clamp(min=0) // window)  # [B, W]
    return torch.cat([sink.expand(len(n), -1), torch.where(m > j, latest, -1)], dim=1)


def visible(r_q: Tensor, r_k: Tensor, window: int, sinks: int) -> Tensor:
    """``[B, S, K]``: query ``r_q`` ``[B, S]`` sees key ``r_k`` ``[B, K]`` (real indices,
    -1 for none): causal, within the window or one of the sinks."""
    rk = r_k[:, None, :]
    return (rk >= 0) & attention_visible(r_q[:, :, None], rk, window, sinks)


def _step_mask(first: Tensor, r_new: Tensor, sinks: int, window: int, size: int) -> Tensor:
    """``[B, 1, S, C + S]`` for a step of several tokens over the ring as it was and the
    step's own keys; a padding query sees itself only, so its softmax stays finite."""
    old = slot_contents(first, sinks, window, size)  # [B, C]
    mask = visible(r_new, torch.cat([old, r_new], dim=1), window, sinks)  # [B, S, C + S]
    s = r_new.shape[1]
    own = torch.zeros_like(mask)
    own[:, :, old.shape[1]:] = torch.eye(s, dtype=torch.bool, device=mask.device)
    padding = (r_new < 0)[:, :, None]  # [B, S, 1]
    return torch.where(padding, own, mask)[:, None]


def _write(k_ring: Tensor, v_ring: Tensor, new_k: Tensor, new_v: Tensor, r_new: Tensor,
           n_after: Tensor, sinks: int, window: int, size: int) -> None:
    """Store the step's K/V ``[B, Hkv, S, D]`` in their slots; tokens that are padding or
    that a later token of this step overwrites go to the spare last slot (so no slot is
    written twice in one step, whose order indexing does not define)."""
    slot = torch.where(r_new < sinks, r_new, sinks + (r_new - sinks) % window)  # [B, S]
    kept = (r_new >= 0) & ((r_new < sinks) | (r_new >= n_after[:, None] - window))
    slot = torch.where(kept & (slot < size), slot, size)  # a short ring never wraps
    rows = torch.arange(len(slot), device=slot.device)[:, None]  # [B, 1]
    k_ring[rows, :, slot] = new_k.transpose(1, 2)  # [B, S, Hkv, D]
    v_ring[rows, :, slot] = new_v.transpose(1, 2)
