"""A strategy's rounds or plain decode steps: whichever this machine runs faster, timed.

A speculative strategy chooses its drafts from a cost model: what verifying ``n`` tokens
costs in plain decode steps, measured when the pass ran. The loop's own work between the
model's calls (matching chains, accepting paths, counting) is not in it, nor is the load
the machine carries now, nor a batch whose rows lag one another. Where those decide, the
rounds run slower than plain decoding though the model predicted them faster: PromptLookup
on the default model at batch 4 predicted 1.25x and ran at 0.87x on a 2-core CPU.

So the engine times its generations at each batch size and strategy (``SpeedGuard``, kept
in ``Engine.guards``): seconds per new token, counted only inside the token iterator and
from its second token on (the first is the prompt's step, whatever decodes after it). Each
generation runs the arm whose recent generations were faster (the median of the last
``KEEP``; the rounds until plain steps are timed), and the other is tried after ``wait``
generations (first after ``WAIT``: the first generations run the rounds, as without a
guard), so that a change of text or of load is seen. A try that changes nothing doubles
the wait (up to ``MAX_WAIT``: trying the slower arm costs its difference for one
generation); a try faster than the chosen arm's median, or a change of the choice (by a
try, or by the faster arm's own generations slowing down), starts it over. A try whose
generation was not timed (it ended early or was dropped) is made again at the next
generation, ``RETRIES`` times at most (not one whose generation failed). An arm's first timed generation
carries one-off work (kernels compiled, CUDA graphs captured, tree layouts built): it is
dropped once the arm has a second. Generations too short to time (fewer than
``MIN_TOKENS`` tokens past the first) run the faster arm and are not counted.

Greedy output is plain decoding's either way (bit for bit in float32; in bfloat16 the
rounds' multi-token steps round differently, as they do without a guard); sampled output
follows the same distribution, but not the same draws under one seed: which arm ran
decides them. ``Engine.fallback = False`` always runs the rounds.

On a GPU the timing starts once the prompt's step has finished (a synchronisation after
the first token) and ends once the last token's work has (one at the end); a stream the
caller drops is not recorded there (its queued work was never waited for). Work queued
inside the iterator and run while the caller holds a token is counted only where a loop
waits for it (every loop does, for the end of sequence, unless generation runs with no
end-of-sequence ids).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

ROUNDS, PLAIN = "rounds", "plain"


class SpeedGuard:
    KEEP = 5  # recent generations an arm's speed is the median of
    MIN_TOKENS = 8  # shorter generations are not timed
    WAIT = 4  # generations before the slower arm is tried again, at first
    MAX_WAIT = 64
    RETRIES = 3  # a try whose generation was not timed is made again, this many times at most

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.times: dict[str, list[float]] = {ROUNDS: [], PLAIN: []}  # seconds a token
        self.warm = {ROUNDS: False, PLAIN: False}  # whether the arm's first one was dropped
        self.wait = self.WAIT
        self.since = 0  # generations on the faster arm since the other was tried
        self.best = ROUNDS  # the faster arm when the last timed-length generation was chosen
        # while the other arm is tried: (that arm, its generations timed before, retries left)
        self.trying: Optional[tuple] = None
        self.recorded = {ROUNDS: 0, PLAIN: 0}  # generations timed, by arm

    def speed(self, arm: str) -> Optional[float]:
        """Seconds a token of ``arm``'s recent generations (their median); None: untimed."""
        return statistics.median(self.times[arm]) if self.times[arm] else None

    def faster(self) -> str:
        """The arm whose recent generations were faster (the rounds until plain is timed)."""
        rounds, plain = self.speed(ROUNDS), self.speed(PLAIN)
        return PLAIN if plain is not None and (rounds is None or plain < rounds) else ROUNDS

    def choose(self, max_new_tokens: int) -> str:
        """The arm the next generation runs, of at most ``max_new_tokens`` tokens."""
        best = self.faster()
        if max_new_tokens - 1 < self.MIN_TOKENS:  # too short to time: no try is spent on it
            return best
        if self.trying is not None:  # the last timed-length generation tried the other arm
            arm, seen, left = self.trying
            if self.recorded[arm] == seen and left > 0:  # not timed (it ended short or was
                self.trying = (arm, seen, left - 1)  # dropped; ``failed``): made again
                return arm
            self.trying = None
            now = self.speed(self.best)
            promising = self.recorded[arm] > seen and (now is None or self.times[arm][-1] < now)
            if best != self.best or promising:  # changed, or may soon: look again soon
                self.wait, self.since = self.WAIT, 0
            elif self.recorded[arm] > seen:  # a try that confirmed the choice
                self.wait = min(2 * self.wait, self.MAX_WAIT)
        elif best != self.best:  # the faster arm's own generations slowed down past the other
            self.wait, self.since = self.WAIT, 0
        self.best = best
        self.since += 1
        if self.since > self.wait:
            other = PLAIN if best == ROUNDS else ROUNDS
            self.since, self.trying = 0, (other, self.recorded[other], self.RETRIES)
            return other
        return best

    def record(self, arm: str, seconds: float, tokens: int) -> None:
        """A generation of ``arm`` made ``tokens`` tokens (past its first) in ``seconds``."""
        if tokens < self.MIN_TOKENS:
            return
        kept = self.times[arm]
        if len(kept) == 1 and not self.warm[arm]:  # the first carried one-off work
            kept.pop()
            self.warm[arm] = True
        kept.append(seconds / tokens)
        del kept[:-self.KEEP]
        self.recorded[arm] += 1

    def failed(self, arm: str) -> None:
        """A generation of ``arm`` failed: a try of it is not made again."""
        if self.trying is not None and self.trying[0] == arm:
            self.trying = (arm, self.trying[1], 0)

    def timed(self, steps: Iterator[Tensor], arm: str, device: torch.device) -> Iterator[Tensor]:
        """``steps``, yielded as they are, with the time spent making them from the second
        on recorded for ``arm`` when they end (or the caller drops them; not when they fail)."""
        spent, made, failed = 0.0, 0, False
        try:
            first = next(steps, None)
            if first is None:
                return
            yield first
            if device.type == "cuda":  # the prompt's step is not the first token's
                torch.cuda.synchronize(device)
            while True:
                start = self.clock()
                token = next(steps, None)
                if token is None:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    spent += self.clock() - start
                    return
                spent += self.clock() - start
                made += 1
                yield token
        except GeneratorExit:  # dropped by the caller: what it made was timed (on a GPU
            failed = device.type == "cuda"  # its queued work was never waited for: not kept)
            raise
        except BaseException:
            failed = True
            self.failed(arm)
            raise
        finally:
            if hasattr(steps, "close"):  # a dropped stream: its loop's cache is released now
                steps.close()
            if not failed:
                self.record(arm, spent, made)
