"""What a tree round and a plain step cost beyond their programs: the cost model.

A measurer's ``verify_cost`` and ``heads_cost`` (``rewriter.ir.pass_manager.Measurer``,
implemented by ``rewriter.runtime.measurer``) time the programs alone, in units of the
decode program's time ``D``. A round also builds its inputs, accepts a path, moves K/V
rows, counts the heads' guesses (the adaptive tree) and hands tokens out; a plain step
picks its token and hands it out. On SmolLM2 that work is a few percent of a step; on a
6M-parameter model, whose step takes 2 ms, it is a fifth of a round, and a cost model
without it chose trees that ran at 0.8x plain decoding.

So the pass has the measurer run both loops for a few tokens on a made-up prompt
(``round_times``, in ``runtime.decoding.tuning``; ``timed_prompt`` here says how long), and
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

from rewriter.decoding import TreeDecoding
from rewriter.ir.core import IR
from rewriter.measure.calibrate import ShortContext
from rewriter.values import context_length

PROMPT = 64  # tokens of the made-up prompt (fewer where the context is short): as verify_cost's
NEW = 24  # rounds a measurement times that verify the whole tree (and about as many plain steps)
GENERATIONS = 4  # at most: heads that guess right on the prompt make few rounds a generation
LIMIT = 1e3  # the record's bound on a cost (``decoding.check_record``)


def timed_prompt(ir: IR, strategy: TreeDecoding, new: int) -> tuple[int, int]:
    """``(prompt, tokens)``: the made-up prompt's length and the tokens a generation makes
    when timing ``strategy``'s rounds of ``new`` whole trees (the last rounds, cut short,
    are not counted); ``ShortContext`` where the model's context has no room for them."""
    # prompt lookup (no tree): rounds of a whole copied chain, from a prompt that repeats
    size = len(strategy.tree) + 1 + (0 if strategy.drafts else strategy.lookup)
    tokens = new + size  # the last ``size`` tokens' rounds are cut short
    context = context_length(ir.info.get("config", {}))
    prompt = min(PROMPT, context - tokens - strategy.cache_slack())
    if prompt < 1:  # the pass that asked names its parameters to lower
        raise ShortContext(f"timing a round of {size} tokens needs a context of more than "
                           f"{tokens + strategy.cache_slack()} tokens; the model has {context}")
    return prompt, tokens


def adjust(heads: float, verify, times: dict) -> tuple[float, list[float]]:
    """``(heads', [verify'(1), ..])``: ``heads_cost`` and ``verify_cost[1:]`` (in decode
    programs) moved into plain steps with the round's own work added (module docstring),
    kept within the record's bounds whatever a timing said."""
    d, p, f = times["decode"], times["plain"], times["fixed"]
    clamp = lambda c: min(max(c, 1e-3), LIMIT)  # noqa: E731
    return min(heads * d / p, LIMIT), [clamp((c * d + f) / p) for c in verify]
