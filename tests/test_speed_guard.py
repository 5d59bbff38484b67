"""``SpeedGuard``: a speculative strategy's generations fall back to plain decode steps
where those were timed faster. Its schedule on given timings (the rounds first, plain tried
after ``WAIT``, the faster after that, tries spaced out while they confirm, warm-up and
short generations), what ``timed`` counts, and the engine: the output is plain decoding's
either way, and with a clock that prices the work each arm does, the cheaper arm runs."""
import pytest
import torch

import rewriter
from rewriter.passes import PromptLookup
from rewriter.runtime.speed_guard import PLAIN, ROUNDS, SpeedGuard

from conftest import traced_model, varied_init
from test_tree_lookup import repeating

LONG = 32  # max_new_tokens of a generation long enough to time


def run(guard: SpeedGuard, per_token: dict, n: int) -> list[str]:
    """``n`` generations of ``LONG`` tokens whose arms take ``per_token[arm]`` seconds a
    token: the arms they ran."""
    arms = []
    for _ in range(n):
        arm = guard.choose(LONG)
        guard.record(arm, per_token[arm] * (LONG - 1), LONG - 1)
        arms.append(arm)
    return arms


def test_the_rounds_run_until_plain_is_tried_then_the_faster_one():
    w = SpeedGuard.WAIT
    slow_rounds = run(SpeedGuard(), {ROUNDS: 2.0, PLAIN: 1.0}, w + 3)
    assert slow_rounds == [ROUNDS] * w + [PLAIN, PLAIN, PLAIN]
    fast_rounds = run(SpeedGuard(), {ROUNDS: 1.0, PLAIN: 2.0}, w + 3)
    assert fast_rounds == [ROUNDS] * w + [PLAIN, ROUNDS, ROUNDS]


def test_tries_are_spaced_out_while_they_confirm_and_reset_when_they_do_not():
    guard = SpeedGuard()
    arms = run(guard, {ROUNDS: 1.0, PLAIN: 2.0}, 400)
    tries = [i for i, a in enumerate(arms) if a == PLAIN]
    gaps = [b - a - 1 for a, b in zip(tries, tries[1:])]
    assert gaps[:5] == [8, 16, 32, 64, 64] and set(gaps[4:]) == {SpeedGuard.MAX_WAIT}
    # the machine changes: the rounds slow down past plain's last timings; once their median
    # has, plain steps run, and the rounds are tried again soon (the wait starts over)
    arms = run(guard, {ROUNDS: 3.0, PLAIN: 2.0}, 40)
    switch = arms.index(PLAIN)
    assert switch <= SpeedGuard.KEEP // 2 + 1 and arms[-1] == PLAIN
    assert ROUNDS in arms[switch:switch + SpeedGuard.WAIT + 2]


def test_a_try_faster_than_the_chosen_arm_brings_the_next_try_soon():
    guard = SpeedGuard()
    run(guard, {ROUNDS: 1.0, PLAIN: 2.0}, 400)  # the wait is at its longest
    assert guard.wait == SpeedGuard.MAX_WAIT
    arms = run(guard, {ROUNDS: 1.0, PLAIN: 0.5}, 200)  # now plain steps are twice as fast
    # one try at the longest wait, then tries every WAIT + 1 until plain's median flips
    assert PLAIN in arms[:SpeedGuard.MAX_WAIT + 3 * (SpeedGuard.WAIT + 1) + 1]
    assert set(arms[SpeedGuard.MAX_WAIT + 3 * (SpeedGuard.WAIT + 1) + 1:][:SpeedGuard.WAIT]) == {PLAIN}


def test_a_try_that_was_not_timed_is_made_again():
    guard = SpeedGuard()
    w, r = SpeedGuard.WAIT, SpeedGuard.RETRIES
    arms = []
    for _ in range(w + r + 3):  # plain generations end (at an end of sequence) too soon to time
        arm = guard.choose(LONG)
        arms.append(arm)
        guard.record(arm, 1.0 * (LONG - 1) if arm == ROUNDS else 0.1, LONG - 1 if arm == ROUNDS else 3)
    assert arms == [ROUNDS] * w + [PLAIN] * (1 + r) + [ROUNDS] * 2  # then the wait goes on
    assert guard.wait == w  # unconfirmed: not doubled
    # a try whose generation failed is not made again
    guard = SpeedGuard()
    arms = [guard.choose(LONG) for _ in range(w + 1)]
    guard.failed(arms[-1])
    assert arms[-1] == PLAIN and guard.choose(LONG) == ROUNDS


def test_an_arms_first_generation_is_dropped_once_it_has_a_second():
    guard = SpeedGuard()
    guard.record(ROUNDS, 100.0, 10)  # kernels compiled, graphs captured: 10 s a token
    assert guard.speed(ROUNDS) == 10.0
    guard.record(ROUNDS, 10.0, 10)
    assert guard.speed(ROUNDS) == 1.0
    guard.record(ROUNDS, 30.0, 10)
    assert guard.speed(ROUNDS) == 2.0  # the median of 1 and 3: the warm-up is gone for good
    guard.record(ROUNDS, 100.0, 10)
    assert guard.speed(ROUNDS) == 3.0  # the median of 1, 3 and 10, not their mean
    for _ in range(2 * SpeedGuard.KEEP):
        guard.record(ROUNDS, 50.0, 10)
    assert guard.times[ROUNDS] == [5.0] * SpeedGuard.KEEP


def test_short_generations_are_neither_timed_nor_counted_toward_a_try():
    guard = SpeedGuard()
    short = SpeedGuard.MIN_TOKENS  # its first token is the prompt's: one short of timed
    assert [guard.choose(short) for _ in range(50)] == [ROUNDS] * 50
    guard.record(ROUNDS, 1.0, SpeedGuard.MIN_TOKENS - 1)
    assert guard.speed(ROUNDS) is None and guard.since == 0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_timed_counts_the_time_inside_the_iterator_from_its_second_token():
    clock, guard = Clock(), SpeedGuard()
    guard.clock = clock
    closed = []

    def steps():
        try:
            for i in range(12):
                clock.now += 100.0 if i == 0 else 1.0  # the prompt's step, then 1 s a token
                yield torch.tensor([i])
        finally:
            closed.append(True)

    out = []
    for token in guard.timed(steps(), ROUNDS, torch.device("cpu")):
        clock.now += 5.0  # the caller's own time is not the loop's
        out.append(int(token))
    assert out == list(range(12)) and guard.times[ROUNDS] == [1.0] and closed
    # a stream dropped part way: what it made is timed, and the loop is closed (its cache
    # freed) then, though the caller still holds it
    inner = steps()
    stream = guard.timed(inner, PLAIN, torch.device("cpu"))
    for _ in range(SpeedGuard.MIN_TOKENS + 1):
        next(stream)
    stream.close()
    assert guard.times[PLAIN] == [1.0] and len(closed) == 2 and inner.gi_frame is None

    def failing():
        for i in range(12):
            clock.now += 3.0
            yield torch.tensor([i])
        raise RuntimeError("the loop failed")

    guard.trying = (PLAIN, 1, SpeedGuard.RETRIES)
    with pytest.raises(RuntimeError, match="failed"):
        list(guard.timed(failing(), PLAIN, torch.device("cpu")))
    assert guard.times[PLAIN] == [1.0]  # a failed generation is not timed, nor tried again
    assert guard.trying == (PLAIN, 1, 0)


def work_clock(engine):
    """A clock that reads the work an engine has done: a model call costs 1 plus 0.25 a
    token it verifies past the first (``drafted``: copies included), so rounds that accept
    little cost more a token than plain steps, and rounds on looping text less,
    deterministically."""
    return lambda: engine.stats["forward_passes"] + 0.25 * engine.stats["drafted"]


def test_the_engine_falls_back_to_plain_steps_where_rounds_cost_more_and_the_output_is_the_same():
    _, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup(tokens=4, adapt=False)])
    assert pl.fallback  # the default
    strategy = rewriter.decoding.strategy_of(pl.ir.info)
    pl.guards[(1, strategy)] = SpeedGuard(clock=work_clock(pl))
    prompts = [[(7 * i * i + 3 * i + j) % 120 + 1 for i in range(12)] for j in range(12)]
    kw = dict(max_new_tokens=LONG, eos_token_id=[])
    ran = []
    for p in prompts:  # seeded random text: few copies are right, rounds cost more a token
        before = pl.stats["plain_generations"]
        assert torch.equal(pl.generate([p], **kw), plain.generate([p], **kw))
        ran.append(PLAIN if pl.stats["plain_generations"] > before else ROUNDS)
    guard = pl.guards[(1, strategy)]
    assert guard.speed(PLAIN) < guard.speed(ROUNDS)
    assert ran[:SpeedGuard.WAIT + 2] == [ROUNDS] * SpeedGuard.WAIT + [PLAIN, PLAIN]


def test_the_engine_keeps_the_rounds_where_they_cost_less_and_not_at_all_without_fallback():
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)  # text loops
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup(tokens=4, adapt=False)])
    strategy = rewriter.decoding.strategy_of(pl.ir.info)
    pl.guards[(1, strategy)] = guard = SpeedGuard(clock=work_clock(pl))
    ids = repeating(plain, [[5, 9, 2] * 4], 12)  # copies are right: 3-4 tokens a round
    kw = dict(max_new_tokens=LONG, eos_token_id=[])
    for _ in range(SpeedGuard.WAIT + 3):
        assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    assert guard.speed(ROUNDS) < guard.speed(PLAIN) and pl.stats["plain_generations"] == 1
    pl.fallback = False
    pl.stats.clear()
    for _ in range(3 * SpeedGuard.WAIT):
        pl.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert pl.stats["plain_generations"] == 0


@pytest.mark.parametrize("fallback", [True, False])
def test_plain_decoding_has_no_guard(fallback):
    plain = rewriter.optimize(traced_model("llama-gqa-3l")[1])
    plain.fallback = fallback
    plain.generate([[1, 2, 3]], max_new_tokens=LONG)
    assert plain.guards == {} and "plain_generations" not in plain.stats


def test_a_strategy_resting_is_timed_as_plain_steps_and_each_batch_size_has_its_guard(monkeypatch):
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    pl = rewriter.optimize(traced, passes=[PromptLookup(tokens=4, adapt=False)])
    strategy = rewriter.decoding.strategy_of(pl.ir.info)
    kw = dict(max_new_tokens=LONG, eos_token_id=[])
    pl.generate([[5, 9, 2] * 4], **kw)
    pl.generate([[5, 9, 2] * 4, [7, 3] * 6], **kw)
    assert set(pl.guards) == {(1, strategy), (2, strategy)}
    assert pl.guards[(2, strategy)].recorded == {ROUNDS: 1, PLAIN: 0}
    from rewriter.runtime.decoding import TreeStrategy  # e.g. a chain that rests:
    monkeypatch.setattr(TreeStrategy, "tokens", lambda *a, **k: None)  # no rounds
    pl.generate([[5, 9, 2] * 4], **kw)
    assert pl.guards[(1, strategy)].recorded == {ROUNDS: 1, PLAIN: 1}
    assert pl.stats["plain_generations"] == 1


@pytest.mark.parametrize("value", ["false", 0, None, 1.0])
def test_fallback_is_true_or_false(value):
    engine = rewriter.optimize(traced_model("llama-gqa-3l")[1])
    with pytest.raises(ValueError, match="fallback must be True or False"):
        engine.fallback = value
    assert engine.fallback is True
