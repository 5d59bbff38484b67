"""Running the frozen model for the heads' data: one optimized engine for a whole run
(``one_engine``), prompts continued greedily through this project's runtime, resumable after
an interruption (``continue_prompts``), and the model's last hidden state at every position
(``hidden_states``: the LM head's input, what the heads read).
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from safetensors import safe_open

from rewriter.files import tensor_files


def eos_ids(model, tokenizer) -> set:
    """The model's end-of-sequence token ids: its generation config's and its config's
    (either may hold one id, a list or none)."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        v = getattr(source, "eos_token_id", None) if source is not None else None
        ids |= set(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
    return ids


_SHARED: dict = {}  # id(model) -> its engine (None: not made yet), inside one_engine


@contextlib.contextmanager
def one_engine(model):
    """One optimized engine of ``model`` for every prompt set a ``train_heads`` call asks or
    continues: tracing the model (``torch.export``) takes seconds, and a call may make
    three sets. The model is frozen throughout, so the engine stays its own."""
    _SHARED[id(model)] = None
    try:
        yield
    finally:
        _SHARED.pop(id(model), None)


def engine_of(model):
    """``rewriter.optimize(model)``, made once inside ``one_engine``."""
    import rewriter
    if id(model) not in _SHARED:
        return rewriter.optimize(model)
    if _SHARED[id(model)] is None:
        _SHARED[id(model)] = rewriter.optimize(model)
    return _SHARED[id(model)]


def continue_prompts(model, tokenizer, prompts, new_tokens: int, generate_batch: int,
                     progress: bool, split: str, partial: Optional[Path] = None, key: str = "",
                     deadline: Optional[float] = None) -> tuple[Tensor, Tensor, float]:
    """Prompts continued greedily by the model (through the runtime): ``[N, L]`` right-padded
    rows, where each row's continuation starts, and the seconds earlier runs spent on them.
    The rows made so far are saved to ``partial`` after every batch with the time they
    took, and a run interrupted while generating resumes there. ``deadline``
    (``time.perf_counter()``): stop after the batch that passes it, with the first prompts'
    rows only."""
    began = time.perf_counter()
    engine = engine_of(model)
    width = max(map(len, prompts))
    rows, before = partial_rows(partial, key) if partial is not None else ([], 0.0)
    # saved rows count only where they continue these prompts (sampled prompts made again
    # by other code would differ): the rest is generated again
    same = 0
    while (same < min(len(rows), len(prompts)) and len(rows[same]) == len(prompts[same]) + new_tokens
           and rows[same][:len(prompts[same])] == list(prompts[same])):
        same += 1
    rows = rows[:same]
    bar = progress_bar(progress, len(prompts), f"generate ({split})", "prompt")
    bar.update(len(rows))
    for i in range(len(rows), len(prompts), generate_batch):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        chunk = prompts[i:i + generate_batch]
        out = engine.generate(chunk, max_new_tokens=new_tokens, eos_token_id=[])  # [b, w + n]
        w = max(map(len, chunk))
        for p, row in zip(chunk, out):
            rows.append(list(p) + row[w:].tolist())
        bar.update(len(chunk))
        if partial is not None:
            save_rows(partial, rows, key, before + time.perf_counter() - began)
    bar.close()
    # right-pad to one width: position t of a row is its t-th token (no left padding)
    length = width + new_tokens
    tokens = torch.zeros(len(rows), length, dtype=torch.int64)
    for r, row in enumerate(rows):
        tokens[r, :len(row)] = torch.tensor(row)
    start = torch.tensor([len(p) for p in prompts[:len(rows)]])  # first generated position
    return tokens, start, before


def save_rows(path: Path, rows: list, key: str, seconds: float) -> None:
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    tensor_files.save(path, {"flat": flat, "lengths": lengths},
                      {"settings": key, "seconds": f"{seconds:.3f}"})


def partial_rows(path: Path, key: str) -> tuple[list, float]:
    """The rows a generation interrupted earlier made (same settings and model) and the
    seconds it spent, or ([], 0.0)."""
    if not path.is_file():
        return [], 0.0
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("settings") != key:
                return [], 0.0
            flat, lengths = f.get_tensor("flat"), f.get_tensor("lengths")
        seconds = float(meta.get("seconds", "0"))
    except Exception:  # a torn or foreign file: generate again
        return [], 0.0
    if int(lengths.sum()) != flat.numel() or bool((lengths < 0).any()):
        return [], 0.0
    if not (math.isfinite(seconds) and seconds >= 0):  # a time it cannot have taken
        seconds = 0.0
    return [r.tolist() for r in torch.split(flat, lengths.tolist())], seconds


def hidden_states(model, tokens: Tensor, progress: bool, split: str, chunk: int = 8,
                  argmax: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """The model's last hidden state (the LM head's input) at every position, ``[N, L, H]``
    in bfloat16 (what the heads read; right padding only follows the real tokens), and with
    ``argmax`` the model's greedy next token at every position ``[N, L]`` (from the hidden
    states before rounding), else None."""
    out, nxt = [], []
    # one [L, V] buffer for every row's logits: a fresh 16 MB block a row (SmolLM2) left the
    # allocator's heap fragmented, some 4 MB a row kept (24 GB at 3200 corpus rows)
    lm = model.get_output_embeddings()
    logits = torch.empty(tokens.shape[1], lm.weight.shape[0], dtype=lm.weight.dtype,
                         device=model.device) if argmax else None
    bar = progress_bar(progress, len(tokens), f"hidden states ({split})", "row")
    # the decoder alone: its last hidden state is the LM head's input (hidden_states[-1]),
    # without the vocabulary projection the full model would add (a fifth of SmolLM2's work)
    base = getattr(model, "base_model", model)
    with torch.inference_mode():
        for i in range(0, len(tokens), chunk):
            ids = tokens[i:i + chunk].to(model.device)
            h = (base(ids).last_hidden_state if base is not model
                 else model(ids, output_hidden_states=True).hidden_states[-1])
            out.append(h.to(torch.bfloat16).cpu())
            if argmax:  # a row at a time: [L, V] logits, not [chunk, L, V]
                nxt += [_greedy(model.get_output_embeddings(), row, logits)[None] for row in h]
            bar.update(len(ids))
    bar.close()
    return torch.cat(out), torch.cat(nxt) if argmax else None


def _greedy(lm, row: Tensor, logits: Tensor) -> Tensor:
    """The LM head's greedy token ``[L]`` after every hidden state of ``row`` ``[L, H]``,
    its logits written into ``logits`` ``[L, V]``."""
    row = row.to(lm.weight.dtype)
    if getattr(lm, "bias", None) is not None:
        torch.addmm(lm.bias, row, lm.weight.t(), out=logits)
    else:
        torch.mm(row, lm.weight.t(), out=logits)
    return logits.argmax(-1).cpu()


def progress_bar(enabled: bool, total: int, desc: str, unit: str):
    """A progress bar of ``total`` ``unit``s (hidden unless ``enabled``), cleared when done."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)
