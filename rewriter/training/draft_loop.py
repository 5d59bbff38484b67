"""The loop that trains a draft (an EAGLE layer, heads over a prefix layer) on rows the
model answered, their hidden states cached: batches of whole rows, the positions trained
on drawn from them, and held-out top-1 of each draft step.

``data`` is a training set as ``heads_data.merge_parts`` makes it: ``tokens`` ``[N, L]``,
``start`` (each row's first generated position), ``end`` (where its text ends),
``hidden`` ``[N, L, H]``. A position ``t`` of a row is trained on where its first target,
the token at ``t + 2``, is generated text (as ``train_heads`` trains heads).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from rewriter.training.heads_fit import DECAY, head_targets, heads_loss, optimizer_step


def train_rows(opt, data: dict, args, logits_of, depth: int, warmup: int,
               clip: float | None = None, every: int = 0, device="cpu",
               seconds: float | None = None, checkpoint=None, targets=None) -> float:
    """``args.steps`` steps on ``args.positions`` positions of ``args.rows`` random whole
    rows each (``row_batch``, seeded by ``args.seed``); ``logits_of(data, rows, pairs)``
    ``[P, depth, V]`` on ``device`` under bfloat16 autocast, trained by ``train_step`` on
    the model's own tokens weighted ``DECAY ** k``. Prints the loss every ``every`` steps
    (0: never). ``seconds``: a time budget as well; the schedule's cosine follows whichever
    of steps and seconds runs out first, and training ends there. ``checkpoint(step)`` is
    called after every ``every``-th step. ``targets``: maps the model's tokens ``[P, K]``
    to the logits' columns (a trimmed draft vocabulary), -100 where none is. Returns the
    last step's loss (NaN when no step ran); ``args.steps_done`` is set to the steps taken."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"train_rows: seconds must be > 0 (or None), got {seconds!r}")
    if checkpoint is not None and not every:
        raise ValueError("train_rows: a checkpoint is called every `every` steps: give every >= 1")
    began = time.perf_counter()

    def done(s: int) -> float:  # the fraction of the budget spent after s steps
        return min(1.0, max(s / args.steps, (time.perf_counter() - began) / seconds))
    step = 0
    # without a budget, exactly warmup_cosine's rates (to the last bit, as before)
    sched = warmup_cosine(opt, args.steps, warmup) if seconds is None else \
        torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * done(s))))
    weight = torch.tensor([DECAY ** k for k in range(depth)], device=device)
    g = torch.Generator().manual_seed(args.seed)
    loss = torch.tensor(float("nan"))
    while (step < args.steps if seconds is None else done(step) < 1.0):
        rows, pairs = row_batch(data, args.rows, args.positions, g)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = logits_of(data, rows, pairs)  # [P, depth, V]
        y = head_targets(data, pairs, depth)
        y = (y if targets is None else targets(y)).to(device)
        loss = train_step(opt, sched, logits, y, weight, clip=clip)
        step += 1
        if every and (step - 1) % every == 0:
            print(f"step {step - 1} loss {loss.detach().item():.3f} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
        if checkpoint is not None and step % every == 0:
            checkpoint(step)
    args.steps_done = step
    return float(loss.detach())


def warmup_cosine(opt, steps: int, warmup: int):
    """The learning rate's schedule: linear warm-up over ``warmup`` steps, then a cosine to
    zero at ``steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def row_batch(data: dict, rows: int, positions: int, g: torch.Generator) -> tuple:
    """``(rows, pairs)``: ``rows`` rows drawn with replacement (sorted, without repeats),
    and up to ``positions`` of their (row, position) pairs, drawn without replacement."""
    chosen = torch.randint(0, len(data["tokens"]), (rows,), generator=g).unique()  # sorted
    pairs = generated_pairs(data, chosen)
    return chosen, pairs[torch.randperm(len(pairs), generator=g)[:positions]]


def train_step(opt, sched, logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
               clip: float = None) -> torch.Tensor:
    """One step on the heads' logits ``[P, K, V]`` against the model's tokens ``y`` ``[P, K]``
    (-100: past a row's end), heads weighted as ``train_heads``; ``clip``: the gradients'
    largest norm, if any."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                         reduction="none").view_as(y)
    loss = heads_loss(ce, (y != -100).float(), weight)
    if clip is None:
        optimizer_step(opt, sched, loss)
        return loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([t for group in opt.param_groups for t in group["params"]], clip)
    opt.step()
    sched.step()
    return loss


def top1(data: dict, k: int, logits_of, rows: int = 8, targets=None) -> list[float]:
    """Top-1 of each of ``k`` heads on every generated position (given the right path);
    ``logits_of(rows, pairs)``: the heads' logits ``[P, K, V]`` at ``pairs`` of ``rows``;
    ``targets``: the model's tokens to the logits' columns (a token with none: -1, a miss)."""
    hits, count = torch.zeros(k), torch.zeros(k)
    with torch.inference_mode():
        for i in range(0, len(data["tokens"]), rows):
            chunk = torch.arange(i, min(i + rows, len(data["tokens"])))
            pairs = generated_pairs(data, chunk)
            y = head_targets(data, pairs, k)
            ok = y != -100
            y = y if targets is None else targets(y)
            hits += ((logits_of(chunk, pairs).argmax(-1).cpu() == y) & ok).sum(0).float()
            count += ok.sum(0).float()
    return [round(a, 4) for a in (hits / count.clamp_min(1)).tolist()]


def generated_pairs(data: dict, rows: torch.Tensor) -> torch.Tensor:
    """``[P, 2]`` (row, position) of ``rows`` whose head-0 target is generated text (as
    ``train_heads``)."""
    out = [(r, t) for r in rows.tolist()
           for t in range(int(data["start"][r]) - 1, int(data["end"][r]) - 2)]
    return torch.tensor(out, dtype=torch.int64).view(-1, 2)
