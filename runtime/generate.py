"""Prefill, decode and the generation loop over a static KV cache.

``prepare`` turns prompts (a tensor with an optional attention mask, or lists of token
ids of different lengths) into one left-padded batch. ``decode_loop`` runs prefill once
and then one decode step per token, yielding each step's tokens ``[B]``; rows that have
produced an end-of-sequence token get ``pad_token_id`` from then on.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, fx

from .attention import StaticStep, Step
from .kv_cache import KVCache
from .sampling import Sampling, next_token


@dataclass
class Batch:
    ids: Tensor  # [B, S] left-padded prompt
    positions: Tensor  # [B, S] token positions (0 at each row's first real token)
    pad: Optional[Tensor]  # [B] padding per row, None when no row is padded
    source: Tensor  # what generate() returns the new tokens after: the caller's ids


def prepare(prompts, attention_mask: Optional[Tensor], pad_token_id: int,
            device: torch.device) -> Batch:
    """One left-padded batch from a ``[B, S]`` tensor (+ mask) or a list of id lists."""
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2 or prompts.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got "
                             f"{prompts.dtype} {list(prompts.shape)}")
        source = prompts.to(device=device, dtype=torch.int64)
        if attention_mask is None:
            rows = list(source)
        else:
            if attention_mask.shape != prompts.shape:
                raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}, "
                                 f"input_ids {list(prompts.shape)}")
            keep = attention_mask.to(device).bool()
            rows = [row[m] for row, m in zip(source, keep)]
    else:
        rows = [torch.as_tensor(list(r), dtype=torch.int64, device=device) for r in prompts]
        source = None
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    width = max(len(r) for r in rows)
    pad = torch.tensor([width - len(r) for r in rows], device=device)  # [B]
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64, device=device)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = r
    positions = (torch.arange(width, device=device)[None] - pad[:, None]).clamp_min(0)  # [B, S]
    return Batch(ids, positions, pad if int(pad.max()) > 0 else None,
                 source if source is not None else ids)


def decode_loop(prefill: fx.GraphModule, decode: fx.GraphModule, cache: KVCache, batch: Batch,
                max_new_tokens: int, sampling: Sampling, eos: Sequence[int], pad_token_id: int,
                generator: Optional[torch.Generator], stats: Counter,
                static: bool = False, cuda_graph: bool = False) -> Iterator[Tensor]:
    """Yield the next token of every row, ``[B]``, ``max_new_tokens`` times at most.

    ``static`` runs decode steps through ``StaticStep`` (device-side write position), and
    ``cuda_graph`` then replays them from one captured CUDA graph (see ``StaticDecoder``).

    ``stats`` counts the cost: ``forward_passes`` (calls of the model, each over the whole
    batch), ``layer_evals`` (decoder layers those calls ran) and ``tokens`` (steps yielded).
    """
    layers = len(cache.specs)
    cache.busy = True  # until this generator ends or is dropped: no other call may reuse it
    try:  # (the engine marks it busy already when it hands the cache out)
        b, s = batch.ids.shape
        eos_t = torch.tensor(list(eos), dtype=torch.int64, device=batch.ids.device)
        finished = torch.zeros(b, dtype=torch.bool, device=batch.ids.device)
        positions = batch.positions[:, -1:]  # [B, 1]
        decoder = StaticDecoder(decode, cache, batch.pad, cuda_graph) if static else None
        logits = _run(prefill, Step(cache, 0, s, batch.pad), batch.ids, batch.positions)
        stats.update(forward_passes=1, layer_evals=layers)
        for i in range(max_new_tokens):
            chosen = next_token(logits[:, -1], sampling, generator)  # [B]
            token = chosen
            if len(eos):
                token = chosen.masked_fill(finished, pad_token_id)
                finished |= torch.isin(token, eos_t)
            stats["tokens"] += 1
            yield token
            if i + 1 == max_new_tokens or (len(eos) and bool(finished.all())):
                return
            positions = positions + 1
            # Ended rows go on computing (their output is discarded) on the chosen token, not
            # the pad id, which need not be a valid token.
            if decoder is not None:
                logits = decoder(chosen[:, None], positions, s + i)
            else:
                logits = _run(decode, Step(cache, s + i, 1, batch.pad), chosen[:, None], positions)
            stats.update(forward_passes=1, layer_evals=layers)
    finally:
        cache.busy = False


def _run(program: fx.GraphModule, step: Step, ids: Tensor, positions: Tensor) -> Tensor:
    # Entered per call, not around the loop: a generator suspended inside the context
    # would leave inference mode on in the caller's code between tokens.
    with torch.inference_mode():
        return program(step, ids, positions)


class StaticDecoder:
    """Decode steps with fixed input buffers and a device-side write position.

    Every step runs the same kernels on the same addresses, so on CUDA the first step runs
    eagerly (compiling and warming everything), the second is captured in a CUDA graph, and
    from then on a step is a buffer copy and ``graph.replay()``: no per-kernel launch cost.
    The eager step runs on the stream the capture will use: libraries that create handles
    per stream on first use (cuBLAS, cuBLASLt) must not do so inside the capture.
    """

    def __init__(self, program: fx.GraphModule, cache: KVCache, pad: Optional[Tensor],
                 cuda_graph: bool):
        device = cache.k[0].device
        self.program, self.cache, self.pad, self.cuda_graph = program, cache, pad, cuda_graph
        self.tokens = torch.zeros(cache.batch, 1, dtype=torch.int64, device=device)  # [B, 1]
        self.positions = torch.zeros(cache.batch, 1, dtype=torch.int64, device=device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)  # cache write position
        self.graph, self.logits, self.calls = None, None, 0
        self.stream = torch.cuda.Stream(device) if cuda_graph else None

    def __call__(self, tokens: Tensor, positions: Tensor, write_at: int) -> Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.pos.fill_(write_at)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        step = StaticStep(self.cache, self.pos, self.pad)
        if not self.cuda_graph:
            return _run(self.program, step, self.tokens, self.positions)
        self.stream.wait_stream(torch.cuda.current_stream())  # the copies above
        if self.calls == 1:
            with torch.cuda.stream(self.stream):
                logits = _run(self.program, step, self.tokens, self.positions)
            torch.cuda.current_stream().wait_stream(self.stream)
            logits.record_stream(torch.cuda.current_stream())  # used there, made here
            return logits
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):  # recorded, not run
            self.logits = _run(self.program, step, self.tokens, self.positions)
        self.graph.replay()
        return self.logits
