"""The KV cache as data: a table derived from the IR, and the tensors it allocates.

Every ``rw.attention`` names its cache by its ``layer`` attribute, a stable id: passes that
remove layers (``LayerSkip``) or programs that skip them (a self-speculative draft) leave
the other layers' ids as they were, so every program of a model addresses the same caches.
``cache_table(gm)`` is the single description of those caches (heads, head size, window)
that lowering, the allocator, ``kv_bytes_per_token``, artifacts and dumps read.

Each cache is ``[batch, kv_heads, max_len, head_dim]`` for K and for V, written in place at
each row's positions (``runtime.attention.write_kv``), or, for a sliding-window layer, in
a ring of its window's slots (``runtime.window_ring``). A ``DuoAttention`` layer whose KV
heads are split keeps two: its full heads under its id, its streaming heads' ring under
``ring_part(id)``. A ``MiniCache`` pair keeps one: its merged directions under its first
layer's id, with its magnitudes and retained tokens beside them (``KVCache.merged``,
``runtime.merged_cache``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

import torch
from torch import fx

from rewriter.errors import RewriterError
from rewriter.ops import ATTRIBUTES, OPS, op_arguments

# The attention op's non-tensor arguments, read from its schema (``rewriter.ops``).
ATTENTION_PARAMS = tuple(ATTRIBUTES["attention"])
# ``gates`` only records why DuoAttention split a layer: no cache depends on it;
# ``kv_source`` names the cache (``CacheSpec.id``) of a layer that shares another's;
# ``merge_with``/``merge`` become a merged pair's id, ``merge`` and ``second``.
CACHE_PARAMS = tuple(k for k in ATTENTION_PARAMS
                     if k not in ("layer", "gates", "kv_source", "merge_with", "merge"))


def ring_part(cache_id: int) -> tuple:
    """The key of a split layer's ring (its streaming heads) in ``KVCache.k`` / ``.v``."""
    return (cache_id, "ring")


@dataclass(frozen=True)
class CacheSpec:
    """One attention op's cache: ``id`` is its ``layer`` attribute, or the layer whose
    cache it reads (``kv_source``)."""
    id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    window: Optional[int]
    sinks: Optional[int] = None
    full_heads: Optional[tuple] = None  # DuoAttention: KV heads kept whole beside the ring
    page: Optional[int] = None  # Quest: per-page key bounds (max, min) kept beside the cache
    # False for a layer reading a cache another op of its program writes (ShareKV):
    # set by lowering, per program (a draft that skips the owner leaves its first reader
    # to write the same k and v)
    write: bool = True
    # True where a later op of the program reads this cache too (ShareKV): a ring's
    # multi-token step keeps what it attended to for them (``runtime.ring_cache``), and
    # Quest's page bounds take the step's keys at the last op (the readers' selections,
    # like the owner's, score the pages as they were before the step)
    read_after: bool = False
    # MiniCache: the pair's (t, gamma, retain), and whether this is its second layer
    merge: Optional[tuple] = None
    second: bool = False
    # set by ``cache_table``: the window a plain sliding-window cache keeps in a ring
    # (``runtime.window_ring``), the largest of the windows of the ops reading it; None
    # where the cache is kept whole (a global layer, a reader without a window, a cache
    # read by position: a token or page selection, a merged pair) or is a sink ring
    ring_window: Optional[int] = None

    @property
    def ring(self) -> bool:
        """Some heads keep a sink + window ring (``runtime.ring_cache``), so tokens are
        overwritten and cannot be rolled back."""
        return self.sinks is not None

    @property
    def bounded(self) -> bool:
        """Every head is in the ring: memory is bounded, whatever the length."""
        return self.ring and self.full_heads is None

    @property
    def ring_heads(self) -> int:
        return self.num_kv_heads - len(self.full_heads or ()) if self.ring else 0

    def ring_slots(self, max_len: int, slack: int = 0) -> Optional[int]:
        """The slots of a sliding-window ring for sequences of up to ``max_len`` cache
        positions whose steps roll back at most ``slack`` tokens (``runtime.window_ring``:
        the window and the slack); None where the cache is kept whole, or the ring would
        be no smaller."""
        if self.ring_window is None or self.ring_window + slack >= max_len:
            return None
        return self.ring_window + slack

    def parts(self, max_len: int, slack: int = 0) -> list[tuple]:
        """``(key, kv_heads, slots)`` of each tensor pair this cache allocates for sequences
        of up to ``max_len`` tokens: full heads take ``max_len`` slots; a ring holds its
        sinks and its window (no more than the sequences need: then it never wraps) and one
        spare slot that padding writes into; a sliding-window ring its ``ring_slots``."""
        window_ring = self.ring_slots(max_len, slack)
        if window_ring is not None:
            return [(self.id, self.num_kv_heads, window_ring)]
        ring = min(self.sinks + self.window, max_len) + 1 if self.ring else 0
        if self.bounded:
            return [(self.id, self.num_kv_heads, ring)]
        if self.ring:
            return [(self.id, len(self.full_heads), max_len),
                    (ring_part(self.id), self.ring_heads, ring)]
        return [(self.id, self.num_kv_heads, max_len)]

    def side_slots(self, max_len: int) -> int:
        """A merged pair's side buffer: retained tokens per row and KV head."""
        return math.ceil(round(self.merge[2] * max_len, 6)) if self.merge else 0

    def merge_parts(self, max_len: int) -> list[tuple]:
        """``(name, shape after the batch, dtype or None for the cache's)`` of what a
        merged pair keeps beside its directions (``parts``), ``[]`` for other caches."""
        if self.merge is None:
            return []
        h, d, c = self.num_kv_heads, self.head_dim, self.side_slots(max_len)
        return [("magnitude", (h, max_len, 4), None),  # |K|, |V| of the first layer, the second's
                ("side", (h, c, 4, d), None),  # retained tokens' K, V of both layers
                ("side_at", (h, c), torch.int64),  # their positions, -1 where free
                ("retained", (h,), torch.int64),  # side slots in use
                ("overflow", (h,), torch.int64),  # tokens merged because the buffer was full
                ("distance", (h, 2), torch.float32)]  # running min and max angular distance

    def merge_bytes(self, max_len: int, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) * (kind or dtype).itemsize
                   for _, shape, kind in self.merge_parts(max_len))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one slot of every head holds (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def bytes_for(self, tokens: int, dtype: torch.dtype) -> int:
        """Bytes this cache holds for one sequence of ``tokens`` tokens."""
        per_head = 2 * self.head_dim * dtype.itemsize
        bounds = per_head * self.num_kv_heads * -(-tokens // self.page) if self.page else 0
        return bounds + self.merge_bytes(tokens, dtype) + sum(
            per_head * heads * min(tokens, slots) for _, heads, slots in self.parts(tokens))


def attention_params(node: fx.Node) -> dict:
    """The attention op's non-tensor arguments by name, defaults filled in."""
    bound = op_arguments("attention", tuple(node.args), dict(node.kwargs))
    return {k: bound[k] for k in ATTENTION_PARAMS}


def cache_table(gm: fx.GraphModule) -> dict[int, CacheSpec]:
    """``{id: CacheSpec}`` for every ``rw.attention`` of ``gm`` that owns its cache, in
    graph order (a layer reading another's, ``kv_source``, and a merged pair's second
    layer allocate nothing), each plain sliding-window cache with its ``ring_window``."""
    table: dict[int, CacheSpec] = {}
    attention = list(gm.graph.find_nodes(op="call_function", target=OPS["attention"]))
    for n in attention:
        p = attention_params(n)
        if p["kv_source"] is not None or _second(p):
            continue
        if p["layer"] in table:
            raise RewriterError(f"{n.name}: two attention ops name cache {p['layer']} (their "
                                f"layer attribute); each layer's attention needs its own")
        table[p["layer"]] = cache_spec(n)
    windows = _ring_windows(gm, attention)
    return {i: replace(s, ring_window=windows.get(i)) for i, s in table.items()}


def _ring_windows(gm: fx.GraphModule, attention: list) -> dict[int, int]:
    """``{cache id: window}`` of the caches a sliding-window ring can hold: every op that
    reads the cache (its owner, ``kv_source`` readers) has a window and no sinks, split
    heads or merge, and no selection reads it by position (TidalDecode's and Quest's
    selections address cache positions: those caches stay whole)."""
    windows: dict[int, list] = {}
    for n in attention:
        p = attention_params(n)
        owner = p["kv_source"] if p["kv_source"] is not None else p["layer"]
        plain = (p["sinks"] is None and p["full_heads"] is None and p["merge_with"] is None
                 and op_arguments("attention", tuple(n.args), dict(n.kwargs))["select"] is None)
        windows.setdefault(owner, []).append(p["window"] if plain else None)
    for op in ("select_tokens", "select_pages"):
        for n in gm.graph.find_nodes(op="call_function", target=OPS[op]):
            windows.setdefault(op_arguments(op, tuple(n.args), dict(n.kwargs))["layer"], []).append(None)
    return {i: max(w) for i, w in windows.items() if None not in w}


def cache_spec(node: fx.Node) -> CacheSpec:
    """The cache of one ``rw.attention`` node, which is also what its lowered call reads
    (``runtime.attention.cached_attention``): heads, head size, scale, window, and the
    sinks, full heads and page size of the sparse caches."""
    p = attention_params(node)
    params = {k: p[k] for k in CACHE_PARAMS}
    select = op_arguments("attention", tuple(node.args), dict(node.kwargs))["select"]
    if select is not None and select.target is OPS["select_pages"]:  # Quest's bounds
        params["page"] = op_arguments("select_pages", tuple(select.args),
                                      dict(select.kwargs))["page"]
    if params["full_heads"] is not None:
        params["full_heads"] = tuple(params["full_heads"])
    if p["merge_with"] is not None:  # MiniCache: the pair's cache is its first layer's
        return CacheSpec(id=min(p["layer"], p["merge_with"]), merge=tuple(p["merge"]),
                         second=p["merge_with"] < p["layer"], **params)
    return CacheSpec(id=p["layer"] if p["kv_source"] is None else p["kv_source"], **params)


def read_bytes(gm: fx.GraphModule, dtype: torch.dtype, tokens: int) -> int:
    """KV bytes a one-token decode step of one sequence reads with ``tokens`` tokens cached,
    every cache, counting the tokens the step attends to: a whole cache reads every token,
    a sliding window its ``window``, a ring its slots, a layer reading a TidalDecode
    selection its ``top_k + recent + 1`` tokens (a selection layer of the paper's reads
    everything; with ``select_own`` it reads every key and the values of its selection), a
    Quest layer its ``budget + recent + 1`` (the budget in whole pages) and the bounds of
    every page so far.

    Not counted: a second read of keys already counted (a selection layer scoring its keys,
    ``select_own``'s attention over the chosen ones), the float32 copies the scoring makes,
    and what a kernel loads only to mask (a sliding-window ring's slack past its window
    under speculative decoding, ``runtime.window_ring``; a CUDA-graph step spans the
    allocated cache; the Triton kernel skips both).
    Multi-token steps (prompts, speculative verification) attend densely."""
    selected, bounds, scored = {}, {}, set()
    for n in gm.graph.find_nodes(op="call_function", target=OPS["attention"]):
        args = op_arguments("attention", tuple(n.args), dict(n.kwargs))
        sel = args["select"]
        if sel is not None and sel.target is OPS["select_tokens"]:
            p = op_arguments("select_tokens", tuple(sel.args), dict(sel.kwargs))
            selected[args["layer"]] = p["top_k"] + p["recent"] + 1
            if p["layer"] == args["layer"]:  # select_own: it scored every key itself
                scored.add(args["layer"])
        elif sel is not None and sel.target is OPS["select_pages"]:  # Quest: its pages, every page's bounds
            p = op_arguments("select_pages", tuple(sel.args), dict(sel.kwargs))
            selected[args["layer"]] = p["budget"] // p["page"] * p["page"] + p["recent"] + 1
            bounds[args["layer"]] = 2 * -(-tokens // p["page"])  # max and min, per page
    table = cache_table(gm)
    reads = {i: _cache_reads(i, s, dtype, tokens, selected, scored, bounds)
             for i, s in table.items()}
    # a layer reading another's cache (ShareKV) reads it again: sharing saves memory, not
    # reads (each layer's attention loads the K/V it attends to)
    return sum(reads.values()) + sum(reads[owner] for owner in _kv_sources(gm))


def _cache_reads(i: int, s: CacheSpec, dtype: torch.dtype, tokens: int, selected: dict,
                 scored: set, bounds: dict) -> int:
    """``read_bytes``'s count for cache ``i`` (its owner's read)."""
    total = 0
    per_head = s.bytes_per_token(dtype) // s.num_kv_heads  # K and V of one token
    for key, heads, _ in s.parts(tokens):  # a DuoAttention layer: full heads and a ring
        ring = s.bounded or key == ring_part(i)
        if ring:
            read = min(tokens, s.sinks + s.window)
        else:  # a sliding window (Mistral's layers; a split layer's is its ring's) or a selection
            window = s.window if s.window is not None and not s.ring else tokens
            read = min(tokens, window, selected.get(i, tokens))
        if i in scored:  # every key, and the values of the selection
            total += per_head // 2 * heads * (tokens + read)
        else:
            total += per_head * heads * read
    if s.merge is not None:  # a layer's magnitudes (K and V) beside the directions
        total += 2 * s.num_kv_heads * dtype.itemsize * min(tokens, s.window or tokens)
    return total + per_head // 2 * s.num_kv_heads * bounds.get(i, 0)  # [pages, D] bounds, twice


def _kv_sources(gm: fx.GraphModule) -> list[int]:
    """The owner each reading attention op of ``gm`` reads (``kv_source``), once per
    reader, and a merged pair's first layer once for its second (MiniCache)."""
    params = list(map(attention_params, gm.graph.find_nodes(op="call_function",
                                                            target=OPS["attention"])))
    return [p["kv_source"] for p in params if p["kv_source"] is not None] + \
        [p["merge_with"] for p in params if _second(p)]


def _second(p: dict) -> bool:
    """Whether attention arguments ``p`` are a merged pair's second layer's (MiniCache)."""
    return p["merge_with"] is not None and p["merge_with"] < p["layer"]


def describe(table: dict[int, CacheSpec], dtype: torch.dtype, readers: Optional[dict] = None) -> dict:
    """The table as JSON-able data (dumps): ``bytes_per_token`` counts the caches that grow
    with the sequence, ``bounded_bytes`` what the rings hold at most (a sliding-window
    ring its window, under plain decoding), ``readers`` the layers that read each shared
    cache (``{owner: [readers]}``, ``ir.sharing.readers_of``)."""
    growing = [s for s in table.values() if s.ring_window is None]
    return {"dtype": str(dtype).removeprefix("torch."),
            "readers": {str(o): r for o, r in (readers or {}).items()},
            "bytes_per_token": sum(s.bytes_per_token(dtype) * (s.num_kv_heads - s.ring_heads)
                                   // s.num_kv_heads + (s.bytes_per_token(dtype) // s.page
                                                        if s.page else 0)
                                   + _merged_per_token(s, dtype) for s in growing),
            "bounded_bytes": sum(s.bytes_per_token(dtype) * s.ring_heads // s.num_kv_heads
                                 * (s.sinks + s.window + 1) for s in table.values() if s.ring)
            + sum(s.bytes_per_token(dtype) * s.ring_window for s in table.values()
                  if s.ring_window is not None),
            "caches": [asdict(s) for s in table.values()]}


def _merged_per_token(s: CacheSpec, dtype: torch.dtype) -> int:
    """A merged pair's bytes per token beside its directions: two layers' magnitudes and
    the side buffer's share (``retain`` of a slot, both layers' K and V and a position),
    rounded down; the pair's counters (a few bytes a row) are left out."""
    if s.merge is None:
        return 0
    h, item = s.num_kv_heads, dtype.itemsize
    return int(4 * h * item + s.merge[2] * h * (4 * s.head_dim * item + 8))


def bounded(table: dict[int, CacheSpec]) -> bool:
    """Every cache is a ring: the sequence may outgrow the model's context length."""
    return bool(table) and all(s.bounded for s in table.values())


def unbounded_length(gm: fx.GraphModule) -> bool:
    """Sequences may outgrow the context length: every cache is a sink + window ring
    with StreamingLLM's positions (``rotary=``), so no query-key distance exceeds the
    ring's length, whatever the sequence's."""
    attention = list(gm.graph.find_nodes(op="call_function", target=OPS["attention"]))
    return (bounded(cache_table(gm)) and bool(attention)
            and all(n.kwargs.get("rotary") is not None for n in attention))


class KVCache:
    """K and V for every cache of ``table``, ``{key: [B, Hkv, slots, D]}`` each: ``max_len``
    slots, or a sink + window cache's ring, or both for a split layer, or a sliding-window
    ring (``CacheSpec.parts``). ``slack``: the tokens a step may write that a later one
    rolls back (speculative decoding, ``runtime.window_ring``); ``spans`` ``{id: slots}``
    names the sliding-window rings."""

    def __init__(self, table: dict[int, CacheSpec], batch: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, slack: int = 0):
        self.table, self.batch, self.max_len, self.slack = table, batch, max_len, slack
        self.spans = {i: slots for i, s in table.items()
                      if (slots := s.ring_slots(max_len, slack)) is not None}
        # zeros, not empty: a padded row's masked slots must hold finite values, because
        # masked attention weights are exactly 0 and 0 * NaN would still be NaN.
        parts = [(key, (batch, heads, slots, s.head_dim))  # [B, Hkv, slots, D]
                 for s in table.values() for key, heads, slots in s.parts(max_len, slack)]
        # caches of one shape (and kind: positions or a sliding-window ring's slots) are
        # views of one block [n, B, Hkv, slots, D], so that moving slots in all of them
        # (``move``) is one copy, not one per layer
        kinds: dict = {}
        for key, shape in parts:
            kinds.setdefault((shape, key in self.spans), []).append(key)
        self.blocks = [(keys, torch.zeros((len(keys), *shape), dtype=dtype, device=device),
                        torch.zeros((len(keys), *shape), dtype=dtype, device=device))
                       for (shape, _), keys in kinds.items()]  # (keys, K block, V block)
        at = {key: (kb[i], vb[i]) for keys, kb, vb in self.blocks for i, key in enumerate(keys)}
        self.k = {key: at[key][0] for key, _ in parts}
        self.v = {key: at[key][1] for key, _ in parts}
        self.busy = False  # a generation in progress (e.g. a paused stream) holds it
        self._lease: object | None = None  # whose hold() ``busy`` is
        # Quest's per-page key bounds (max, min) ``[B, Hkv, pages, D]`` by cache id, made by
        # the first write of a layer with a page selection (runtime.page_selection)
        self.bounds: dict = {}
        # MiniCache: each merged pair's magnitudes, side buffer and counters by cache id
        # (``CacheSpec.merge_parts``, ``runtime.merged_cache``)
        self.merged = {s.id: {name: torch.zeros((batch, *shape), dtype=kind or dtype, device=device)
                              for name, shape, kind in s.merge_parts(max_len)}
                       for s in table.values() if s.merge is not None}

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy position ``src[i]`` of row ``rows[i]`` to its position ``dst[i]`` in every
        cache, K and V (``[n]`` each; every source read before any target is written): a
        sliding-window ring's slot of a position is the position modulo its slots."""
        if self.merged:
            raise RewriterError("a merged cache (MiniCache) cannot move tokens between slots")
        for keys, kb, vb in self.blocks:
            span = self.spans.get(keys[0])
            at, to = (src, dst) if span is None else (src % span, dst % span)
            for block in (kb, vb):
                block[:, rows, :, to] = block[:, rows, :, at]  # [n moves, caches, Hkv, D]

    def hold(self) -> Callable[[], None]:
        """Lease the cache to one generation or scoring (``fits`` is False meanwhile); the
        function returned hands it back (once: a stale release frees no later lease). The
        only place ``busy`` changes. Two generations writing one cache would corrupt both,
        so a second lease is refused."""
        if self.busy:
            raise RewriterError("this KV cache is held by a generation in progress "
                                "(a paused stream?): finish or close it first")
        lease = self._lease = object()
        self.busy = True

        def release() -> None:
            if self._lease is lease:
                self.busy, self._lease = False, None
        return release

    def fits(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device,
             slack: int = 0) -> bool:
        k = next(iter(self.k.values()), None)
        return (not self.busy and self.batch == batch and self.max_len >= max_len
                and self.slack >= slack
                and (k is None or (k.dtype == dtype and k.device == device)))

    @property
    def device(self) -> torch.device:
        k = next(iter(self.k.values()), None)
        return k.device if k is not None else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        bounds = [t for pair in self.bounds.values() for t in pair]
        merged = [t for parts in self.merged.values() for t in parts.values()]
        return sum(t.numel() * t.element_size()
                   for t in [*self.k.values(), *self.v.values(), *bounds, *merged])

    def bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence occupies, over all caches."""
        return self.nbytes // max(1, self.batch * self.max_len)
