"""Tuning a strategy on the machine that runs it: a record's programs, lowered without
writing the record into the IR, tree rounds whose replays a clock times, and
``round_times``: what a tree round and a plain step cost beyond their programs
(``rewriter.measure.round_cost`` holds the cost model and says why)."""
from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

from rewriter.decoding import Decoding, TreeDecoding
from rewriter.drafts.tree import Tree, make_tree
from rewriter.ir.core import IR
from rewriter.measure.round_cost import GENERATIONS, NEW, timed_prompt

from ..generate import Batch, decode_loop, prepare, static_decoder
from ..kv_cache import KVCache, cache_table
from ..programs import build_programs
from ..settings import GenerationSettings
from .tree.adapt import AdaptiveTree
from .tree.rounds import TreeRounds
from . import strategy_for


def programs_for(ir: IR, record: Decoding, backend: str = "torch") -> dict:
    """The programs ``record``'s strategy runs on ``ir`` (``ir.info`` is not read or written)."""
    return build_programs(ir, backend, {}, strategy_for(ir, record))


def tree_rounds(programs: dict, cache: KVCache, batch: Batch, settings: GenerationSettings,
                stats: Counter, record: TreeDecoding, vocab: Optional[Tensor], learnt: dict,
                static: bool = False, cuda_graph: bool = False,
                clock: Optional[Callable] = None) -> Iterator[Tensor]:
    """Greedy tree rounds (``rounds.tree_loop``), each static step's replay called
    through ``clock(replay, *inputs)`` where given."""
    rounds = TreeRounds(programs, cache, batch, settings, None, stats, record, vocab, learnt,
                        static=static, cuda_graph=cuda_graph)
    rounds.clock = clock
    return rounds.run()


def round_times(ir: IR, strategy: TreeDecoding, batches: Sequence[int],
                vocab: Optional[Tensor] = None, new: int = NEW, static: Optional[bool] = None,
                backend: str = "torch") -> dict[int, dict]:
    """``{batch: {"decode": D, "plain": P, "round": R, "fixed": F, "rounds": n}}`` in
    seconds: the decode program, a plain step, a tree round verifying the whole of
    ``strategy.tree`` (``batch_trees`` are ignored; rounds cut short near the end are not
    counted), the round's work outside its programs, and the rounds timed (``new``, or
    fewer after ``GENERATIONS`` generations), with programs lowered for ``backend``.
    Greedy: sampling's acceptance walks the tree in Python and costs more. The programs are
    ``strategy``'s, whatever ``ir.info`` records (it is left as it is). ``static``: time
    the loops on fixed buffers, their programs as whole replays (``runtime.replay``; the
    default on CUDA, where they are the engine's loops and replay CUDA graphs)."""
    if type(new) is not int or new < 2:
        raise ValueError(f"round_times: new must be an int >= 2, got {new!r}")
    strategy = replace(strategy, batch_trees=())  # the whole tree at every batch size
    prompt, tokens = timed_prompt(ir, strategy, new)
    programs = programs_for(ir, strategy, backend)
    return {b: _measure_batch(ir, programs, strategy, vocab, b, prompt, tokens, new, static)
            for b in batches}


def _measure_batch(ir: IR, programs: dict, strategy: TreeDecoding, vocab, batch: int, prompt: int,
                   new: int, want: int, static: Optional[bool]) -> dict:
    """One batch size's times (``round_times``): ``new`` tokens a generation, until ``want``
    whole-tree rounds are timed."""
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
                    weight.dtype, device, slack=strategy.cache_slack())

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
        raise RuntimeError(f"round_times: no round of batch {batch} verified the whole tree")
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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: GPU launches return before they finish, so a host
    clock read without this times the launch, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
