"""Prefill, decode and the generation loop over a static KV cache.

``prepare`` turns prompts (a tensor with an optional attention mask, or lists of token
ids of different lengths) into one left-padded batch. ``decode_loop`` runs the prompt
(``run_prompt``: in steps of at most ``prefill_chunk`` tokens), then one decode step per
token, yielding each step's tokens ``[B]``; rows that have produced an end-of-sequence
token get ``pad_token_id`` from then on.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, fx

from .attention import Step
from .kv_cache import KVCache
from .replay import Replay, Replays
from .sampling import next_token
from .settings import PREFILL_CHUNK, GenerationSettings, whole

INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class Batch:
    ids: Tensor  # [B, S] left-padded prompt
    positions: Tensor  # [B, S] token positions (0 at each row's first real token)
    pad: Optional[Tensor]  # [B] padding per row, None when no row is padded
    source: Tensor  # what generate() returns the new tokens after: the caller's ids


def prepare(prompts, attention_mask: Optional[Tensor], pad_token_id: int,
            device: torch.device) -> Batch:
    """One left-padded batch from a ``[B, S]`` tensor (+ mask) or a list of id lists.

    Token ids must be integers (a float id is refused, not truncated; a bool is not an id);
    a mask must be 0/1 (bool or integer dtype) and leave every row a token. The vocabulary
    range is the engine's check (``runtime.inputs.check_token_ids``), made on the batch
    this returns."""
    if isinstance(prompts, Tensor):
        source = _tensor_prompts(prompts).to(device=device, dtype=torch.int64)
        if attention_mask is None:
            rows = list(source)
        else:
            keep = _mask(attention_mask, source.shape).to(device)
            rows = [row[m] for row, m in zip(source, keep)]
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a [batch, seq] tensor of input_ids; lists "
                             "of token-id lists of different lengths need none")
        rows = [torch.tensor(_id_list(r, b), dtype=torch.int64, device=device)
                for b, r in enumerate(_prompt_list(prompts))]
        source = None
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("input_ids: every prompt needs at least one token")
    width = max(len(r) for r in rows)
    pad = torch.tensor([width - len(r) for r in rows], device=device)  # [B]
    shown = torch.full((len(rows), width), pad_token_id, dtype=torch.int64, device=device)
    for b, r in enumerate(rows):
        shown[b, width - len(r):] = r
    column = torch.arange(width, device=device)[None]  # [1, S]
    # The model reads token 0 where the caller sees pad_token_id (masked either way): the
    # pad id need not be a token.
    ids = shown.masked_fill(column < pad[:, None], 0)  # [B, S]
    positions = (column - pad[:, None]).clamp_min(0)  # [B, S]
    return Batch(ids, positions, pad if int(pad.max()) > 0 else None,
                 source if source is not None else shown)


def _tensor_prompts(prompts: Tensor) -> Tensor:
    """``[B, S]`` (a ``[S]`` tensor is one prompt) of an integer dtype."""
    if prompts.dim() == 1:
        prompts = prompts[None]
    if prompts.dim() != 2 or prompts.dtype not in INT_DTYPES:
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got "
                         f"{prompts.dtype} {list(prompts.shape)}")
    return prompts


def _mask(mask, shape) -> Tensor:
    """The attention mask as bool, after checking it is a 0/1 tensor of ``shape``."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"attention_mask must be a tensor, got {type(mask).__name__}")
    if mask.dim() == 1:
        mask = mask[None]  # the mask of a [S] prompt
    if mask.dtype != torch.bool and mask.dtype not in INT_DTYPES:
        raise ValueError(f"attention_mask must be a bool or integer tensor of 0s and 1s, "
                         f"got {mask.dtype}")
    if mask.shape != shape:
        raise ValueError(f"attention_mask has shape {list(mask.shape)}, input_ids {list(shape)}")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        bad = mask[(mask != 0) & (mask != 1)][0].item()
        raise ValueError(f"attention_mask must hold only 0 and 1, found {bad}")
    keep = mask.bool()
    empty = (~keep.any(-1)).nonzero()
    if len(empty):
        raise ValueError(f"attention_mask row {int(empty[0])} is all zeros: that prompt has "
                         f"no token")
    return keep


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"input_ids must be a [batch, seq] integer tensor or a list of "
                         f"token-id lists, got {type(prompts).__name__}")
    return list(prompts)


def _id_list(row, b: int) -> list[int]:
    """Row ``b`` of list prompts as ints: a list/tuple of ints or a 1-D integer tensor."""
    if isinstance(row, Tensor):
        if row.dim() != 1 or row.dtype not in INT_DTYPES:
            raise ValueError(f"input_ids[{b}] must be a 1-D integer tensor, got "
                             f"{row.dtype} {list(row.shape)}")
        return row.tolist()
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise ValueError(f"input_ids[{b}] must be a list of token ids, got {row!r}")
    # >= 0 and within int64 here; the vocabulary bound is the engine's check
    return [whole(f"input_ids[{b}][{i}]", t, minimum=0, below=2 ** 63) for i, t in enumerate(row)]


def decode_loop(prefill: fx.GraphModule, decode: fx.GraphModule, cache: KVCache, batch: Batch,
                settings: GenerationSettings, generator: Optional[torch.Generator],
                stats: Counter, static: bool = False, cuda_graph: bool = False,
                replays: Optional[Replays] = None) -> Iterator[Tensor]:
    """Yield the next token of every row, ``[B]``, ``settings.max_new_tokens`` times at most.

    ``settings`` are resolved for the model (``GenerationSettings.for_model``): its eos ids
    are a tuple and its pad id an int. ``static`` runs decode steps on a write position
    held on the device, and ``cuda_graph`` then replays them from one captured CUDA graph
    (``static_decoder``), kept in ``replays`` across generations when given.

    ``stats`` counts the cost: ``forward_passes`` (calls of the model, each over the whole
    batch), ``layer_evals`` (decoder layers those calls ran) and ``tokens`` (steps yielded).
    """
    max_new_tokens, eos, pad_token_id = (settings.max_new_tokens, settings.eos_token_id,
                                         settings.pad_token_id)
    layers = len(cache.table)
    b, s = batch.ids.shape
    eos_t = torch.tensor(list(eos), dtype=torch.int64, device=batch.ids.device)
    finished = torch.zeros(b, dtype=torch.bool, device=batch.ids.device)
    positions = batch.positions[:, -1:]  # [B, 1]
    decoder = static_decoder(decode, cache, batch.pad, cuda_graph, replays) if static else None
    logits, calls = run_prompt(prefill, cache, batch.ids, batch.positions, batch.pad,
                               settings.prefill_chunk)
    stats.update(forward_passes=calls, layer_evals=calls * layers)
    for i in range(max_new_tokens):
        chosen = next_token(logits[:, -1], settings, generator)  # [B]
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
            logits = decoder(chosen[:, None], positions,
                             torch.full((1,), s + i, dtype=torch.int64, device=eos_t.device))
        else:
            logits = _run(decode, Step(cache, s + i, 1, batch.pad), chosen[:, None], positions)
        stats.update(forward_passes=1, layer_evals=layers)


def run_prompt(program: Callable, cache: KVCache, ids: Tensor, positions: Tensor,
               pad: Optional[Tensor], chunk: int, start: int = 0, every: Optional[list] = None):
    """Run ``program`` (a prefill program) over the prompt ``ids`` ``[B, S]`` written at
    cache positions ``[start, start + S)``, in steps of at most ``chunk`` tokens: (the last
    step's output, the number of steps). The steps are near-equal (a 2049-token prompt
    with chunk 2048 runs as 1025 + 1024, never as 2048 + 1), so no prompt step is a
    one-token step, which token selections treat as decoding. ``every``: a list that gets
    every step's output, in order."""
    s = ids.shape[1]
    if s < 1 or chunk < 1:
        raise ValueError(f"run_prompt: a prompt of {s} tokens in chunks of {chunk}; both must be >= 1")
    steps = -(-s // chunk)
    cuts = [start + s * i // steps for i in range(steps + 1)]  # cache positions
    for a, b in zip(cuts, cuts[1:]):
        out = _run(program, Step(cache, a, b - a, pad), ids[:, a - start:b - start],
                   positions[:, a - start:b - start])
        if every is not None:
            every.append(out)
    return out, steps


def _run(program: Callable, step: Step, ids: Tensor, positions: Tensor):
    # Entered per call, not around the loop: a generator suspended inside the context
    # would leave inference mode on in the caller's code between tokens.
    with torch.inference_mode():
        return program(step, ids, positions)


def static_decoder(program: fx.GraphModule, cache: KVCache, pad: Optional[Tensor],
                   cuda_graph: bool, replays: Optional[Replays] = None) -> Callable:
    """``decoder(tokens, positions, pos)``: the decode step on fixed buffers (tokens
    ``[B, 1]``, positions ``[B, 1]``, the cache write position ``[1]``, the rows' padding
    ``[B]``), through a ``Step`` whose start is that position, on the device, and whose
    keys are the whole cache under the mask: nothing in it is a Python number that changes
    between tokens, so it is replayed from a CUDA graph with ``cuda_graph``
    (``runtime.replay``), kept in ``replays`` when given."""
    padded = pad is not None

    def run(tokens: Tensor, positions: Tensor, pos: Tensor, *pad: Tensor) -> Tensor:
        step = Step(cache, pos.reshape(()), 1, pad[0] if padded else None, end=cache.max_len)
        return _run(program, step, tokens, positions)
    column = torch.zeros(cache.batch, 1, dtype=torch.int64, device=cache.device)  # [B, 1]
    rest = (pad,) if padded else ()
    make = lambda: Replay(run, [column, column, column[0], *rest], cuda_graph,  # noqa: E731
                          "decode step")
    keep = replays is not None and replays.serves(cache)  # else a paused stream's own cache
    replay = replays.get((program, padded), make) if keep else make()
    return lambda tokens, positions, pos: replay(tokens, positions, pos, *rest)


def score_loop(prefill: fx.GraphModule, decode: fx.GraphModule, cache: KVCache,
               ids: Tensor, prefix: int) -> Tensor:
    """Log-probability of each token of ``ids[:, prefix:]`` given all before it, ``[B,
    S - prefix]``, through the KV-cache runtime: prefill over the first ``prefix`` tokens,
    then one decode step per token fed the true token (teacher forcing). So what a cache
    policy changes at decode (a window, a token selection) shows in the score."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).expand(b, s)  # [B, S]
    release = cache.hold()
    try:
        logits, _ = run_prompt(prefill, cache, ids[:, :prefix], positions[:, :prefix], None,
                               PREFILL_CHUNK)
        scores = [logits[:, -1].float().log_softmax(-1).gather(-1, ids[:, prefix, None])]
        for t in range(prefix, s - 1):
            logits = _run(decode, Step(cache, t, 1, None), ids[:, t:t + 1], positions[:, t:t + 1])
            scores.append(logits[:, -1].float().log_softmax(-1).gather(-1, ids[:, t + 1, None]))
    finally:
        release()
    return torch.cat(scores, dim=1)  # [B, S - prefix]
