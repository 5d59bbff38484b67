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
GPU compile and capture a CUDA graph, and a busy machine's outliers are not the cost.

The prompt is arbitrary tokens, so the heads rarely guess right: a round hands out about
one token, where real rounds hand out two or three. Handing out a token costs little
beside a round (a list pop and an EOS check), which this under-counts.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Optional

import torch

from rewriter.decoding import Strategy
from rewriter.ir.core import IR
from rewriter.runtime.tree_adapt import AdaptiveTree
from rewriter.tree import make_tree

PROMPT = 64  # tokens of the made-up prompt: as verify_cost's
NEW = 24  # new tokens a measurement generates (about 20 rounds or steps timed)


def measure(ir: IR, strategy: Strategy, batches, vocab: Optional[torch.Tensor] = None,
            new: int = NEW) -> dict[int, dict]:
    """``{batch: {"decode": D, "plain": P, "round": R, "fixed": F}}`` in seconds: the
    decode program, a plain step, a tree round verifying ``strategy.tree`` (the whole of
    it: ``batch_trees`` are ignored) and the round's work outside its programs.
    ``ir.info["decoding"]`` is set to ``strategy`` while the programs are lowered."""
    from rewriter.runtime.programs import build_programs
    saved = ir.info.get("decoding")
    ir.info["decoding"] = strategy.record()
    try:
        programs = build_programs(ir, "torch", {})
    finally:
        ir.info["decoding"] = saved
    return {b: _measure_batch(ir, programs, strategy, vocab, b, new) for b in batches}


def adjust(heads: float, verify, times: dict) -> tuple[float, list[float]]:
    """``(heads', [verify'(1), ..])``: ``heads_cost`` and ``verify_cost[1:]`` (in decode
    programs) moved into plain steps with the round's own work added (module docstring)."""
    d, p, f = times["decode"], times["plain"], times["fixed"]
    return heads * d / p, [(c * d + f) / p for c in verify]


def _measure_batch(ir: IR, programs: dict, strategy: Strategy, vocab, batch: int,
                   new: int) -> dict:
    from rewriter.runtime.attention import Step
    from rewriter.runtime.generate import decode_loop, prepare
    from rewriter.runtime.kv_cache import KVCache, cache_table
    from rewriter.runtime.settings import GenerationSettings
    from rewriter.runtime.tree_decoding import tree_loop
    weight = max((t for t in ir.weights().values() if t.is_floating_point()), key=torch.Tensor.numel)
    device = weight.device
    vocab_size = int(ir.info.get("config", {}).get("vocab_size") or 2)
    # arbitrary tokens, different per row, the same every run (no random state touched)
    ids = (torch.arange(batch * PROMPT).view(batch, PROMPT) * 7919 + 13) % vocab_size  # [B, S]
    settings = GenerationSettings(max_new_tokens=new, eos_token_id=(), pad_token_id=0)
    length = PROMPT + new + strategy.cache_slack()
    cache = KVCache(cache_table(ir.gm), batch, length, weight.dtype, device)

    timed = {name: _Timed(p, device) for name, p in programs.items()}
    cuda = device.type == "cuda"  # the engine's choice of plain loop, CUDA graph included
    steps = _iterations(decode_loop(timed["prefill"], timed["decode"], cache,
                                    prepare(ids, None, 0, device), settings, None, Counter(),
                                    static=cuda, cuda_graph=cuda), timed, device)
    if cuda:  # steps replay a graph, not the program: time the program (eager) alone
        decode = []
        with torch.inference_mode():
            for r in range(len(steps)):
                _sync(device)
                t = time.perf_counter()
                programs["decode"](Step(cache, PROMPT, 1, None), ids[:, :1],
                                   torch.full((batch, 1), PROMPT, device=device))
                _sync(device)
                decode.append(time.perf_counter() - t)
    else:
        decode = [p for _, p in steps]

    stats: Counter = Counter()
    trees = {}
    if strategy.costs_at(batch) is not None:  # the adaptive tree counts every round: keep
        trees[(batch, strategy)] = _Pinned(strategy, batch)  # its work, never its choices
    loop = tree_loop(timed, cache, prepare(ids, None, 0, device), settings, None, stats,
                     strategy, vocab, trees)
    rounds = _iterations(loop, timed, device, lambda: stats["rounds"])
    return {"decode": statistics.median(decode), "plain": statistics.median(w for w, _ in steps),
            "round": statistics.median(w for w, _ in rounds),
            "fixed": max(0.0, statistics.median(w - p for w, p in rounds))}


def _iterations(loop, timed: dict, device, counter=None) -> list[tuple[float, float]]:
    """(wall seconds, seconds in programs) of each iteration of a token loop after its
    first (which runs the prompt); with ``counter``, only of those that advanced it (a tree
    loop's rounds: its other iterations hand out tokens already made)."""
    next(loop)
    out = []
    while True:
        for t in timed.values():
            t.seconds = 0.0
        before = counter() if counter else 0
        _sync(device)
        start = time.perf_counter()
        try:
            next(loop)
        except StopIteration:
            return out
        _sync(device)
        wall = time.perf_counter() - start
        if counter is None or counter() > before:
            out.append((wall, sum(t.seconds for t in timed.values())))


class _Pinned(AdaptiveTree):
    """Counts and chooses as the adaptive tree does (its work is a round's), and always
    verifies the whole tree."""

    def __init__(self, strategy: Strategy, batch: int):
        super().__init__(make_tree(strategy.tree, strategy.num_heads), strategy, batch)

    def next(self, current, accuracy=None):
        super().next(current, accuracy)
        return current


class _Timed:
    """A program whose calls add up their seconds (device work included)."""

    def __init__(self, program, device: torch.device):
        self.program, self.device, self.seconds = program, device, 0.0

    def __call__(self, *args):
        _sync(self.device)
        t = time.perf_counter()
        out = self.program(*args)
        _sync(self.device)
        self.seconds += time.perf_counter() - t
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
