"""What a tree round and a plain step cost beyond their programs, timed through the runtime.

``calibrate.verify_cost`` and ``heads_cost`` time the programs alone, in units of the
decode program's time ``D``. A round also builds its inputs, accepts a path, moves K/V
rows, counts the heads' guesses (the adaptive tree) and hands tokens out; a plain step
picks its token and hands it out. On SmolLM2 that work is a few percent of a step; on a
6M-parameter model, whose step takes 2 ms, it is a fifth of a round, and a cost model
without it chose trees that ran at 0.8x plain decoding.

So the pass runs both loops for a few tokens on a made-up prompt (``measure``), and
times, per plain step and per tree round, the whole iteration (``P``, ``R``) and the
programs inside it. The round's own work is ``F = R - programs``. Costs then go into the
record in units of the real plain step::

    verify'(s) = (verify(s) * D + F) / P        heads' = heads * D / P

(``adjust``), so the tree chosen, the sub-trees at larger batches and the adaptive tree
all weigh what the runtime really spends. Medians throughout: the first plain steps on a
GPU compile and capture a CUDA graph, and a busy machine's outliers are not the cost. On
a GPU both loops replay CUDA graphs, as the engine's do (``runtime.replay``): ``P`` is a
plain step around a replay, ``D`` the decode graph replayed alone, and a round's programs
are timed as whole replays (nothing may synchronise inside a capture). ``F`` is measured
once, on the tree the programs' costs choose, and taken to hold for every sub-tree: most
of it (building inputs, a step object, handing tokens out) does not grow with the tree.

What this leaves out: the prompt is arbitrary tokens, so the heads rarely guess right and
a round hands out about one token, where real rounds hand out two or three (a list pop
and an end-of-sequence check each: small beside a round). The rounds are greedy; sampling
and typical acceptance walk the tree in Python and cost more than the record says.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import replace
from typing import Optional

import torch

from rewriter.measure.calibrate import ShortContext, sync
from rewriter.decoding import TreeDecoding
from rewriter.ir.core import IR
from rewriter.runtime.decoding.tree.adapt import AdaptiveTree
from rewriter.drafts.tree import Tree, make_tree
from rewriter.values import context_length

PROMPT = 64  # tokens of the made-up prompt (fewer where the context is short): as verify_cost's
NEW = 24  # rounds a measurement times that verify the whole tree (and about as many plain steps)
GENERATIONS = 4  # at most: heads that guess right on the prompt make few rounds a generation
LIMIT = 1e3  # the record's bound on a cost (``decoding.check_record``)


def measure(ir: IR, strategy: TreeDecoding, batches, vocab: Optional[torch.Tensor] = None,
            new: int = NEW, static: Optional[bool] = None) -> dict[int, dict]:
    """``{batch: {"decode": D, "plain": P, "round": R, "fixed": F, "rounds": n}}`` in
    seconds: the decode program, a plain step, a tree round verifying the whole of
    ``strategy.tree`` (``batch_trees`` are ignored; rounds cut short near the end are not
    counted), the round's work outside its programs, and the rounds timed (``new``, or
    fewer after ``GENERATIONS`` generations). Greedy: sampling's acceptance walks the tree in
    Python and costs more. The programs are ``strategy``'s, whatever ``ir.info``
    records (it is left as it is). ``static``: time the loops on fixed buffers, their
    programs as whole replays (``runtime.replay``; the default on CUDA, where they are the
    engine's loops and replay CUDA graphs)."""
    from rewriter.runtime.decoding.tuning import programs_for
    if type(new) is not int or new < 2:
        raise ValueError(f"round_cost.measure: new must be an int >= 2, got {new!r}")
    strategy = replace(strategy, batch_trees=())  # the whole tree at every batch size
    # prompt lookup (no tree): rounds of a whole copied chain, from a prompt that repeats
    size = len(strategy.tree) + 1 + (0 if strategy.drafts else strategy.lookup)
    tokens = new + size  # the last ``size`` tokens' rounds are cut short
    context = context_length(ir.info.get("config", {}))
    prompt = min(PROMPT, context - tokens - strategy.cache_slack())
    if prompt < 1:  # the pass that asked names its parameters to lower
        raise ShortContext(f"timing a round of {size} tokens needs a context of more than "
                           f"{tokens + strategy.cache_slack()} tokens; the model has {context}")
    programs = programs_for(ir, strategy, "torch")
    return {b: _measure_batch(ir, programs, strategy, vocab, b, prompt, tokens, new, static)
            for b in batches}


def adjust(heads: float, verify, times: dict) -> tuple[float, list[float]]:
    """``(heads', [verify'(1), ..])``: ``heads_cost`` and ``verify_cost[1:]`` (in decode
    programs) moved into plain steps with the round's own work added (module docstring),
    kept within the record's bounds whatever a timing said."""
    d, p, f = times["decode"], times["plain"], times["fixed"]
    clamp = lambda c: min(max(c, 1e-3), LIMIT)  # noqa: E731
    return min(heads * d / p, LIMIT), [clamp((c * d + f) / p) for c in verify]


def _measure_batch(ir: IR, programs: dict, strategy: TreeDecoding, vocab, batch: int, prompt: int,
                   new: int, want: int, static: Optional[bool]) -> dict:
    """One batch size's times (``measure``): ``new`` tokens a generation, until ``want``
    whole-tree rounds are timed."""
    from rewriter.runtime.generate import decode_loop, prepare
    from rewriter.runtime.kv_cache import KVCache, cache_table
    from rewriter.runtime.settings import GenerationSettings
    from rewriter.runtime.decoding.tuning import tree_rounds
    weight = max((t for t in ir.weights().values() if t.is_floating_point()), key=torch.Tensor.numel)
    device = weight.device
    vocab_size = int(ir.info.get("config", {}).get("vocab_size") or 2)
    # arbitrary tokens, different per row, the same every run (no random state touched);
    # for prompt lookup a period of 8 of them, so that every round has a chain to copy
    at = torch.arange(batch * prompt, device=device).view(batch, prompt)  # [B, prompt]
    if not strategy.drafts:
        at = at // prompt * prompt + at % prompt % 8
    ids = (at * 7919 + 13) % vocab_size
    settings = GenerationSettings(max_new_tokens=new, eos_token_id=(), pad_token_id=0)
    cache = KVCache(cache_table(ir.gm), batch, prompt + new + strategy.cache_slack(),
                    weight.dtype, device)

    if static is None:  # as the engine runs: on a GPU every loop replays CUDA graphs
        static = device.type == "cuda"
    graph = static and device.type == "cuda"
    # nothing may synchronise inside a capture: static loops' programs are timed as replays
    timed = {"replays": _Clock(device)} if static else \
        {name: _Timed(p, device) for name, p in programs.items()}
    plain = programs if static else timed
    steps = _iterations(decode_loop(plain["prefill"], plain["decode"], cache,
                                    prepare(ids, None, 0, device), settings, None, Counter(),
                                    static=static, cuda_graph=graph), timed, device)
    decode = _replayed_decode(programs["decode"], cache, prompt, len(steps), graph) if static \
        else [p for _, p in steps]

    stats: Counter = Counter()
    trees = {}
    if strategy.costs_at(batch) is not None:  # the adaptive tree counts every round: keep
        trees[(batch, strategy)] = _Pinned(strategy, batch)  # its work, never its choices
    # tokens a round drafts with the whole tree (prompt lookup: the whole chain)
    whole = batch * (len(strategy.tree) + (0 if strategy.drafts else strategy.lookup))
    rounds = []
    for _ in range(GENERATIONS):  # a generation's rounds verify the whole tree until its end
        loop = tree_rounds(plain, cache, prepare(ids, None, 0, device), settings, stats, strategy,
                           vocab, trees, static=static, cuda_graph=graph,
                           clock=timed.get("replays"))  # on a GPU: each captured program's replays
        rounds += _iterations(loop, timed, device, lambda: (stats["rounds"], stats["drafted"]),
                              lambda before, after: after[0] > before[0]
                              and after[1] - before[1] == whole)
        if len(rounds) >= want:
            break
    if not rounds:
        raise RuntimeError(f"round_cost: no round of batch {batch} verified the whole tree")
    return {"decode": statistics.median(decode), "plain": statistics.median(w for w, _ in steps),
            "round": statistics.median(w for w, _ in rounds),
            "fixed": max(0.0, statistics.median(w - p for w, p in rounds)), "rounds": len(rounds)}


def _iterations(loop, timed: dict, device, state=None, counts=None) -> list[tuple[float, float]]:
    """(wall seconds, seconds in programs) of each iteration of a token loop after its
    first (which runs the prompt); with ``state`` and ``counts``, only of those for which
    ``counts(state before, state after)`` (a tree loop's whole-tree rounds: its other
    iterations hand out tokens already made)."""
    next(loop)
    out = []
    while True:
        for t in timed.values():
            t.seconds = 0.0
        before = state() if state else None
        sync(device)
        start = time.perf_counter()
        try:
            next(loop)
        except StopIteration:
            return out
        sync(device)
        wall = time.perf_counter() - start
        if state is None or counts(before, state()):
            out.append((wall, sum(t.seconds for t in timed.values())))


class _Pinned(AdaptiveTree):
    """Counts and chooses as the adaptive tree does (its work is a round's), and always
    verifies the whole tree."""

    def __init__(self, strategy: TreeDecoding, batch: int):
        super().__init__(make_tree(strategy.tree, strategy.depth) if strategy.tree else Tree(()),
                         strategy, batch)

    def next(self, current, accuracy=None):
        super().next(current, accuracy)
        return current

    def chain_length(self, tree):
        super().chain_length(tree)
        return self.chain.whole


def _replayed_decode(program, cache, prompt: int, n: int, graph: bool) -> list[float]:
    """Seconds of ``n`` static decode steps alone, replayed from a CUDA graph with ``graph``
    as the engine's plain loop replays them (the two calls that warm up and capture it not
    counted)."""
    from rewriter.runtime.generate import static_decoder
    decoder = static_decoder(program, cache, None, cuda_graph=graph)
    device = cache.device
    tokens = torch.zeros(cache.batch, 1, dtype=torch.int64, device=device)  # [B, 1]
    pos = torch.full((1,), prompt, dtype=torch.int64, device=device)  # a scratch position
    out = []
    for i in range(n + 2):
        sync(device)
        t = time.perf_counter()
        decoder(tokens, tokens + prompt, pos)
        sync(device)
        if i >= 2:
            out.append(time.perf_counter() - t)
    return out


class _Clock:
    """Calls replays (``Replay``) and adds up their seconds, synchronising outside them."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, 0.0

    def __call__(self, replay, *inputs):
        sync(self.device)
        t = time.perf_counter()
        out = replay(*inputs)
        sync(self.device)
        self.seconds += time.perf_counter() - t
        return out


class _Timed:
    """A program whose calls add up their seconds (device work included)."""

    def __init__(self, program, device: torch.device):
        self.program, self.device, self.seconds = program, device, 0.0

    def __call__(self, *args):
        sync(self.device)
        t = time.perf_counter()
        out = self.program(*args)
        sync(self.device)
        self.seconds += time.perf_counter() - t
        return out
