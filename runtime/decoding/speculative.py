"""Self-speculative decoding: draft with layers skipped, verify with all, lossless.

A round, for every row at once (each row at its own cache length ``length[b]``):

1. **draft** up to ``k`` tokens with the ``draft`` program (the model with its skip set
   bypassed), one token a step, from the row's last token (chosen, not yet in the cache).
   Drafting stops early once every row's draft confidence (the drafted token's probability)
   is below ``threshold``.
2. **verify**: the ``decode`` program over ``[last, d1 .. dk]`` (k + 1 tokens, each row at
   its own positions) gives the full model's next-token logits after every prefix.
3. **accept** per row: greedy keeps the drafts up to the first one that differs from the
   full model's argmax, then adds the full model's own token there, so the output is plain
   greedy decoding's token for token. Sampling uses the speculative-sampling rule (accept
   ``d`` with probability ``min(1, p(d) / q(d))``; at the first rejection sample from
   ``max(0, p - q)`` normalised; after k acceptances sample from ``p``), so the output
   follows the model's own (warped) distribution.
4. **roll back** by length: the row's length grows by the accepted tokens + 1; what the
   draft and the verification wrote past it is masked until overwritten. Nothing is copied.

Tokens come out as plain decoding's do (``base.Columns``: one ``[B]`` column per position,
EOS and padding handled identically; a row whose accepted tokens hold an end of sequence is
done, so the rows still writing set the batch's pace). ``stats`` counts rounds,
drafted and accepted tokens, and the forward passes and layer evaluations of both models.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterator, Optional

import torch
from torch import Tensor

from rewriter.decoding import SelfSpeculativeDecoding

from ..attention import Step
from ..generate import Batch, _run, run_prompt
from ..kv_cache import KVCache
from ..replay import Replay, Replays
from ..sampling import draw, greedy, next_token, warp
from ..settings import GenerationSettings
from .base import Columns


def speculative_loop(programs: dict, cache: KVCache, batch: Batch, settings: GenerationSettings,
                     generator: Optional[torch.Generator], stats: Counter, strategy: SelfSpeculativeDecoding,
                     static: bool = False, cuda_graph: bool = False,
                     replays: Optional[Replays] = None) -> Iterator[Tensor]:
    """Yield the next token of every row, ``[B]``, like ``generate.decode_loop``; ``static``,
    ``cuda_graph`` and ``replays`` as there, for every step of a round (``Rounds.step``)."""
    yield from Rounds(programs, cache, batch, settings, generator, stats, strategy, static,
                       cuda_graph, replays).run()  # (made at the first token, as a stream's)


class Rounds:
    def __init__(self, programs, cache, batch, settings, generator, stats, strategy,
                 static: bool = False, cuda_graph: bool = False,
                 replays: Optional[Replays] = None):
        self.programs, self.cache, self.batch = programs, cache, batch
        self.static, self.cuda_graph = static, cuda_graph
        # fixed-shape calls (runtime.replay) by program and shape: the engine's, kept across
        # generations while it serves this cache (``store``), or this generation's own
        self.shared, self.own = replays, Replays()
        self.clock = None  # clock(replay, *inputs) calls and times each (round_cost)
        self.s, self.generator, self.stats, self.strategy = settings, generator, stats, strategy
        self.full = len(cache.table)
        # the draft's layers (a skipped sub-layer counts half); drafted tokens a round verifies
        self.draft_layers, self.max_draft = self._draft_size(strategy)
        b = batch.ids.shape[0]
        self.device = batch.ids.device
        self.pad0 = batch.pad if batch.pad is not None else torch.zeros(b, dtype=torch.int64,
                                                                        device=self.device)
        self._on_device = {}  # the round's lengths and done rows as device tensors (``on_device``)

    def _draft_size(self, strategy) -> tuple[float, int]:
        skipped = len(strategy.skip_layers) + (len(strategy.skip_attention) + len(strategy.skip_mlp)) / 2
        return self.full - skipped, strategy.max_draft

    def run(self) -> Iterator[Tensor]:
        s, batch = self.s, self.batch
        b, width = batch.ids.shape
        out = Columns(s, b, self.device, self.stats)
        last = self.first()  # [B], not yet in the cache
        length = [width] * b  # cache positions each row holds
        for r, t in enumerate(last.tolist()):
            out.add(r, [t])
        while True:
            yield from out.ready()
            if out.over:
                return
            # rows with every token they need are frozen (computed on, results dropped);
            # an ended row still needs a token per column, which masking turns into padding
            done = out.done()
            active = [r for r in range(b) if not done[r]]
            need = s.max_new_tokens - min(out.produced[r] for r in active)
            room = self.cache.max_len - 1 - max(length[r] for r in active)
            k = max(0, min(self.max_draft, room, need - 1))
            # a done row is computed on at a start that keeps its k + 1 writes in the cache
            at = [min(n, self.cache.max_len - k - 1) if done[r] else n for r, n in enumerate(length)]
            last, accepted = self.round(last, at, k, done)
            for r in active:
                out.add(r, accepted[r])
                length[r] += len(accepted[r])
            self.stats.update(rounds=1, row_rounds=len(active),
                              accepted=sum(len(accepted[r]) - 1 for r in active))

    def first(self) -> Tensor:
        """Prefill the prompts; the first new token of every row ``[B]``."""
        batch = self.batch
        logits, calls = run_prompt(self.programs["prefill"], self.cache, batch.ids,
                                   batch.positions, batch.pad, self.s.prefill_chunk)
        self.stats.update(forward_passes=calls, layer_evals=calls * self.full)
        return next_token(logits[:, -1], self.s, self.generator)

    def start(self, length: list[int], offset: int):
        """A step's start: an int when every row is at the same length, else ``[B]``."""
        if len(set(length)) == 1:
            return length[0] + offset
        return self.on_device(length) + offset

    def on_device(self, values: list) -> Tensor:
        """``values`` (each row's length, or whether it is done) as a ``[B]`` tensor, copied
        once a round rather than once a step: on a GPU each copy from the host waits for
        the work queued before it."""
        key = (type(values[0]), tuple(values))
        if key not in self._on_device:
            if len(self._on_device) >= 8:
                self._on_device.clear()
            self._on_device[key] = torch.tensor(values, device=self.device)
        return self._on_device[key]

    def step(self, name: str, length: list[int], offset: int, tokens: Tensor,
             positions: Tensor, tree: Optional[Tensor] = None, depth: Optional[Tensor] = None):
        """Program ``name`` over ``tokens`` ``[B, m]`` written at each row's cache position
        ``length[b] + offset``. Static rounds build the step on fixed buffers (the start a
        ``[B]`` device tensor, keys read up to the cache's length under the mask) and call it
        through a ``Replay`` per program and shape (a tree's mask ``[m, m]`` and depths
        ``[m]`` are buffers too: every tree of ``m`` nodes shares one), replayed from a CUDA
        graph with ``cuda_graph``; otherwise the step reads only the keys written so far."""
        m = tokens.shape[1]
        if not self.static:
            step = Step(self.cache, self.start(length, offset), m, self.batch.pad,
                        end=max(length) + offset + m, tree=tree, depth=depth)
            return _run(self.programs[name], step, tokens, positions)
        start = self.on_device(length) + offset  # [B]
        program, cache = self.programs[name], self.cache
        given = {k: v for k, v in (("pad", self.batch.pad), ("tree", tree), ("depth", depth))
                 if v is not None}  # buffers too
        names = tuple(given)

        def run(tokens: Tensor, positions: Tensor, start: Tensor, *values: Tensor):
            kw = {"pad": None, **dict(zip(names, values))}
            return _run(program, Step(cache, start, m, end=cache.max_len, **kw), tokens, positions)
        return self.replay((program, m, names), run, f"{name} step of {m} tokens",
                           tokens, positions, start, *given.values())

    def store(self) -> Replays:
        """The engine's replays while it serves this loop's cache; this loop's own once a
        later call got a cache of its own (this loop a paused stream), asked at every call."""
        return self.shared if self.shared is not None and self.shared.serves(self.cache) \
            else self.own

    def replay(self, key, run, name: str, *inputs: Tensor):
        """``run(*inputs)`` through the ``Replay`` kept for ``key`` (made on first use; the
        store keeps the most recently used, ``replay.Replays``)."""
        replay = self.store().get(key, lambda: Replay(run, inputs, self.cuda_graph, name))
        return self.clock(replay, *inputs) if self.clock is not None else replay(*inputs)

    def round(self, last: Tensor, length: list[int], k: int, done: list[bool]):
        """Draft, verify, accept: (each row's new last token ``[B]``, the tokens each row
        accepted, the last one being the full model's)."""
        drafts, q = self.draft(last, length, k, done)
        n_draft = len(drafts)
        tokens = torch.stack([last, *drafts], dim=1)  # [B, n + 1]
        positions = (self.on_device(length) - self.pad0)[:, None] \
            + torch.arange(n_draft + 1, device=self.device)  # [B, n + 1]
        logits = self.step("decode", length, 0, tokens, positions)  # [B, n + 1, V]
        self.stats.update(forward_passes=1, layer_evals=self.full,
                          drafted=n_draft * sum(not d for d in done))
        n, bonus = self.accept(logits, tokens[:, 1:], q)
        # one read back a round: [B, 2 + n] = accepted count, the token after, the drafts
        read = torch.cat([n[:, None], bonus[:, None], tokens[:, 1:]], 1).tolist()
        rows = [row[2:2 + row[0]] + [row[1]] for row in read]
        return torch.where(self.on_device(done), last, bonus), rows

    def draft(self, last: Tensor, length: list[int], k: int,
              done: Optional[list[bool]] = None) -> tuple[list[Tensor], list[Tensor]]:
        """Up to ``k`` draft tokens ``[B]`` each, and (sampling) their distributions ``[B, V]``;
        drafting stops once no running row (``done``: the rows that are not) is confident."""
        drafts, dists, token = [], [], last
        for j in range(k):
            positions = (self.on_device(length) + j - self.pad0)[:, None]
            logits = self.step("draft", length, j, token[:, None], positions)[:, -1]  # [B, V]
            self.stats.update(draft_passes=1, draft_layer_evals=self.draft_layers)
            stop = j + 1 < k and self.strategy.threshold > 0  # no confidence is below 0
            if self.s.do_sample:
                q = warp(logits, self.s).softmax(-1)
                token = draw(q, self.generator)
                dists.append(q)
            else:
                q = logits.float().softmax(-1) if stop else None
                token = greedy(logits)
            drafts.append(token)
            if stop:  # read back: the one wait for the GPU a draft step has
                confidence = q.gather(-1, token[:, None]).squeeze(-1)  # [B]
                unsure = confidence < self.strategy.threshold  # [B]
                if done is not None and any(done):  # a finished row's text has no say
                    unsure |= self.on_device(done)
                if bool(unsure.all()):
                    break
        return drafts, dists

    def accept(self, logits: Tensor, drafts: Tensor, q: list[Tensor]) -> tuple[Tensor, Tensor]:
        """(accepted drafts per row ``[B]``, the token after them ``[B]``)."""
        b, n1, _ = logits.shape
        n_draft = n1 - 1
        if not self.s.do_sample:
            target = greedy(logits)  # [B, n + 1]
            match = (drafts == target[:, :n_draft]).long().cumprod(dim=1)  # [B, n]
            n = match.sum(dim=1)
            return n, target.gather(1, n[:, None]).squeeze(1)
        p = warp(logits.reshape(b * n1, -1), self.s).softmax(-1).view(b, n1, -1)  # [B, n + 1, V]
        if n_draft:
            qd = torch.stack(q, dim=1)  # [B, n, V]
            pick = drafts[..., None]
            ratio = p[:, :n_draft].gather(-1, pick).squeeze(-1) / qd.gather(-1, pick).squeeze(-1)
            u = torch.rand(b, n_draft, generator=self.generator, device=self.device)
            n = (u < ratio).long().cumprod(dim=1).sum(dim=1)  # [B]
            q_after = torch.cat([qd, torch.zeros_like(qd[:, :1])], dim=1)  # [B, n + 1, V]
        else:
            n = torch.zeros(b, dtype=torch.long, device=self.device)
            q_after = torch.zeros_like(p)
        at = n[:, None, None].expand(b, 1, p.shape[-1])
        residual = (p.gather(1, at) - q_after.gather(1, at)).squeeze(1).clamp_min(0)  # [B, V]
        total = residual.sum(-1, keepdim=True)
        # p == q at a rejection has probability 0; guard the division anyway
        residual = torch.where(total > 0, residual / total.clamp_min(1e-30), p.gather(1, at).squeeze(1))
        return n, draw(residual, self.generator)
