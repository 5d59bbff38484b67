"""The heads' training loop, its losses and checkpoints, and their held-out accuracies.

Only the heads' residual blocks learn; the LM head is shared and frozen.
Head ``k`` at position ``t`` (from the prompt's last token on) learns the token at
``t + k + 2``, cross-entropy weighted ``0.8**k`` (Medusa's decay). The target is the
token itself (``loss="tokens"``) or, as Hydra++ trains, the model's whole distribution
there (``loss="teacher"``: the LM head on the cached hidden state at ``t + k + 1``,
so it costs no model call); a Hydra head also
reads the embeddings of the tokens at ``t + 1 .. t + k + 1`` (teacher forcing: the
path verification accepts is the model's own text). With ``blocks=B`` each head runs
``B - 1`` more residual blocks (``rewriter.drafts.heads``; Hydra++ trains 4), zero-initialised,
so a run can start from shallower trained heads (``init``). AdamW, cosine decay,
seeded; a checkpoint in ``work_dir`` after every few hundred steps, from which an
interrupted run resumes.

**Held-out rank accuracies** of each head (on continuations of held-out prompts), which
the pass uses to choose the verification tree, are written with the heads.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from rewriter.drafts import heads as heads_file
from rewriter.files import tensor_files
from rewriter.training.generation import progress_bar

RANKS = 10  # rank accuracies stored per head
CHECKPOINT_EVERY = 200  # steps
DECAY = 0.8


def _samples(data: dict, num_heads: int) -> Tensor:
    """``[P, 2]`` (row, position) pairs whose head-0 target is a generated token: from the
    prompt's last token on, up to the row's end (``data["end"]``: not the padding)."""
    start, end = data["start"], data["end"]
    pairs = [(r, t) for r in range(len(start)) for t in range(int(start[r]) - 1, int(end[r]) - 2)]
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


def head_targets(data: dict, pairs: Tensor, num_heads: int) -> Tensor:
    """``[P, K]`` the token at ``t + k + 2`` for every head, -100 past a row's end (corpus
    rows: the model's greedy token after position ``t + k + 1``, where the text has its own)."""
    tokens = data["tokens"]
    length = tokens.shape[1]
    t = pairs[:, 1:2] + torch.arange(num_heads)[None] + 2  # [P, K]
    ok = t < data["end"][pairs[:, 0]][:, None]
    rows = pairs[:, :1].expand_as(t)
    if "next" in data:
        got = data["next"][rows, t.clamp(max=length - 1) - 1]
    else:
        got = tokens[rows, t.clamp(max=length - 1)]
    return torch.where(ok, got, torch.full_like(got, -100))


def path_tokens(data: dict, pairs: Tensor, num_heads: int) -> Tensor:
    """``[P, K]`` the tokens at ``t + 1 .. t + K`` (Hydra's path; clamped at a row's end,
    where the targets are -100 anyway)."""
    tokens = data["tokens"]
    t = (pairs[:, 1:2] + torch.arange(num_heads)[None] + 1).clamp(max=tokens.shape[1] - 1)
    return tokens[pairs[:, :1].expand_as(t), t]


def _teacher_positions(pairs: Tensor, num_heads: int) -> Tensor:
    """``[P, K]`` where the model predicted head ``k``'s target: position ``t + k + 1``
    (past a row's end the target is masked and the position clamped when read)."""
    return pairs[:, 1:2] + torch.arange(num_heads)[None] + 1


def _teacher(hidden: Tensor, rows: Tensor, at: Tensor, head: Tensor, device) -> Tensor:
    """The model's next-token distributions ``[b, K, V]`` at positions ``at`` ``[b, K]`` of
    ``rows`` ``[b, 1]``, from the cached hidden states and the (frozen) LM head. (Its
    cross-entropy includes the teacher's own entropy: a "teacher" run's loss is not
    comparable with a "tokens" run's.)"""
    h = hidden[rows.expand_as(at), at.clamp(max=hidden.shape[1] - 1)].to(device)  # [b, K, H]
    with torch.no_grad():
        return torch.softmax((h.to(head.dtype) @ head.t()).float(), -1)


def heads_forward(h: Tensor, w, b: Tensor, embed: Optional[Tensor], path: Optional[Tensor],
                  deep: Optional[tuple] = None) -> Tensor:
    """Every head's output before the LM head, ``[b, K, H]``: Medusa's (``embed`` None) or
    Hydra's on the path's embeddings; ``deep``: the blocks after the first."""
    if embed is None:
        return heads_file.apply(h, w, b, deep)
    return heads_file.apply_hydra(h, embed[path].to(h.dtype), w, b, deep)


class _Samples(NamedTuple):
    """A run's training positions and what each step reads of them: ``pairs`` ``[P, 2]``
    (row, position), their ``targets`` ``[P, K]``, Hydra's ``path`` ``[P, K]`` and, for
    ``loss="teacher"``, where the model's distributions are (``teacher_at`` ``[P, K]``)."""
    pairs: Tensor
    targets: Tensor
    path: Optional[Tensor]
    teacher_at: Optional[Tensor]


def fit_heads(data: dict, lm_head: Tensor, embed: Optional[Tensor], num_heads: int, epochs: int,
              lr: float, batch: int, seed: int, work: Path, settings: dict, progress: bool,
              loss_kind: str = "tokens", init: Optional[heads_file.Heads] = None,
              blocks: int = 1) -> tuple:
    """``(w, b, deep, report)``: heads trained on ``data`` (a training set with its rows'
    ends; Hydra's when ``embed`` is given), from ``init``'s weights or zero, resumed from the
    checkpoint in ``work`` that ``settings`` (the data's key) and these arguments made."""
    device = lm_head.device
    hydra = embed is not None
    samples = _training_samples(data, num_heads, hydra, loss_kind)
    w, b, deep, params = _zero_heads(num_heads, lm_head.shape[1], device, hydra, blocks)
    if init is not None:
        _start_from(init, params, deep, hydra)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = math.ceil(len(samples.pairs) / batch) * epochs
    sched = _schedule(opt, total)
    ckpt = work / "checkpoint.safetensors"
    key = _run_key(settings, num_heads=num_heads, epochs=epochs, lr=lr, batch=batch,
                   hydra=hydra, loss_kind=loss_kind, blocks=blocks)
    # a run resumed at its end trains no step: its loss is the checkpoint's
    step, seconds, last_loss = _resume(ckpt, key, params, opt, sched, total)
    weight = torch.tensor([DECAY ** k for k in range(num_heads)], device=device)
    head = lm_head.to(torch.bfloat16) if device.type == "cpu" else lm_head
    bar = progress_bar(progress, total, "train heads", "step")
    bar.update(step)
    began = time.perf_counter()
    for idx in _batches(len(samples.pairs), batch, seed, step, total):
        loss = _batch_loss(data, samples, idx, (w, b, deep), embed, lm_head, head, weight)
        optimizer_step(opt, sched, loss)
        step += 1
        last_loss = float(loss.detach())
        bar.update(1)
        bar.set_postfix(loss=f"{last_loss:.3f}")
        if step % CHECKPOINT_EVERY == 0 or step == total:
            _checkpoint(ckpt, params, opt, step, seconds + time.perf_counter() - began, key, last_loss)
    bar.close()
    seconds += time.perf_counter() - began
    w = [t.detach() for t in w] if hydra else w.detach()
    deep = tuple(t.detach() for t in deep) if deep is not None else None
    return w, b.detach(), deep, {"steps": total, "epochs": epochs, "positions": len(samples.pairs),
                                    "seconds_training": round(seconds, 1), "final_loss": round(last_loss, 4),
                                    "seed": seed, "lr": lr, "batch": batch}


def _training_samples(data: dict, num_heads: int, hydra: bool, loss_kind: str) -> _Samples:
    """The samples of ``data`` for ``num_heads`` heads: a path for Hydra's, the teacher's
    positions for ``loss="teacher"``."""
    pairs = _samples(data, num_heads)
    return _Samples(pairs, head_targets(data, pairs, num_heads),
                    path_tokens(data, pairs, num_heads) if hydra else None,
                    _teacher_positions(pairs, num_heads) if loss_kind == "teacher" else None)


def _zero_heads(num_heads: int, hidden_size: int, device, hydra: bool, blocks: int) -> tuple:
    """``(w, b, deep, params)``: zero heads that learn (``params``: every tensor, in the
    checkpoint's order), each block the identity at first."""
    if hydra:
        w = [torch.zeros(hidden_size, hidden_size * (k + 2), device=device, requires_grad=True)
             for k in range(num_heads)]
        params = list(w)
    else:
        w = torch.zeros(num_heads, hidden_size, hidden_size, device=device, requires_grad=True)
        params = [w]
    b = torch.zeros(num_heads, hidden_size, device=device, requires_grad=True)
    params.append(b)
    deep = None
    if blocks > 1:  # [B - 1, K, H, H], [B - 1, K, H]
        deep = (torch.zeros(blocks - 1, num_heads, hidden_size, hidden_size, device=device,
                            requires_grad=True),
                torch.zeros(blocks - 1, num_heads, hidden_size, device=device, requires_grad=True))
        params += list(deep)
    return w, b, deep, params


def _start_from(init: heads_file.Heads, params: list, deep: Optional[tuple], hydra: bool) -> None:
    """``params`` set to ``init``'s weights: float32 master weights from the (bfloat16) file;
    the blocks the start lacks stay zero."""
    with torch.no_grad():
        for p, t in zip(params, (init.w if hydra else [init.w]) + [init.b]):
            p.copy_(t.to(p.device, torch.float32))
        if init.deep is not None:
            for p, t in zip(deep, init.deep):
                p[:t.shape[0]] = t.to(p.device, torch.float32)


def _schedule(opt, total: int):
    """The learning rate's schedule: a linear warm-up over 50 steps, then cosine decay to
    zero at step ``total``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))


def _run_key(settings: dict, *, num_heads: int, epochs: int, lr: float, batch: int,
             hydra: bool, loss_kind: str, blocks: int) -> str:
    """The key a checkpoint is saved under: only a run of the same data and arguments
    resumes from it. (Keys of the defaults, "tokens" and one block, name neither: the
    checkpoints of runs from before them still resume.)"""
    return json.dumps({**settings, "num_heads": num_heads, "epochs": epochs, "lr": lr,
                       "batch": batch, "arch": "hydra" if hydra else "medusa",
                       "samples": 2, **({"loss": loss_kind} if loss_kind != "tokens" else {}),
                       **({"blocks": blocks} if blocks > 1 else {})},
                      sort_keys=True)  # samples 2: rows end at their text's end


def _resume(ckpt: Path, key: str, params: list, opt, sched, total: int) -> tuple:
    """``(step, seconds, loss)`` of the checkpoint of this run in ``ckpt``, whose weights,
    moments and place in the schedule ``params``, ``opt`` and ``sched`` then hold; a run
    with none (or one not whole: discarded) starts at ``(0, 0.0, nan)``."""
    saved = tensor_files.load(ckpt, "the training checkpoint", lambda m: m.get("settings") == key)
    why = _checkpoint_problem(*saved, params, total) if saved is not None else None
    if why is not None:  # from this run's settings, but not whole: train from the start
        tensor_files.discard(ckpt, "the training checkpoint", why)
    if saved is None or why is not None:
        return 0, 0.0, float("nan")
    state, meta = saved
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(state[f"p{i}"])
    opt_state = opt.state_dict()
    opt_state["state"] = {i: {"step": state[f"step{i}"], "exp_avg": state[f"m{i}"].to(p.device),
                              "exp_avg_sq": state[f"v{i}"].to(p.device)}
                          for i, p in enumerate(params)}
    opt.load_state_dict(opt_state)
    step = int(meta["step"])
    with warnings.catch_warnings():  # replaying the schedule, not skipping a step
        warnings.simplefilter("ignore")
        for _ in range(step):
            sched.step()
    return step, float(meta["seconds"]), float(meta.get("loss", "nan"))


def _batches(positions: int, batch: int, seed: int, step: int, total: int):
    """The sample indices of steps ``step`` .. ``total - 1``: one permutation an epoch,
    seeded, so a resumed run draws the batches it would have drawn."""
    steps_per_epoch = math.ceil(positions / batch)
    order_epoch, order = None, None
    for s in range(step, total):
        epoch, at = divmod(s, steps_per_epoch)
        if epoch != order_epoch:
            order_epoch = epoch
            order = torch.randperm(positions, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        yield order[at * batch:(at + 1) * batch]


def _batch_loss(data: dict, samples: _Samples, idx: Tensor, heads: tuple, embed: Optional[Tensor],
                lm_head: Tensor, head: Tensor, weight: Tensor) -> Tensor:
    """The heads' loss on the samples ``idx``: ``heads`` ``(w, b, deep)`` under autocast,
    through ``head`` (the LM head, bfloat16 on a CPU), against the target tokens or the
    teacher (``lm_head`` as the model has it)."""
    device = lm_head.device
    w, b, deep = heads
    p = samples.pairs[idx]
    h = data["hidden"][p[:, 0], p[:, 1]].to(device).float()  # [b, H]
    y = samples.targets[idx].to(device)  # [b, K]
    path = samples.path[idx].to(device) if samples.path is not None else None
    with torch.autocast(device.type, dtype=torch.bfloat16):
        r = heads_forward(h, w, b, embed, path, deep)  # [b, K, H]
        logits = r @ head.t().to(r.dtype) if device.type != "cpu" else r.to(torch.bfloat16) @ head.t()
    valid = (y != -100).float()
    if samples.teacher_at is None:
        ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(),
                                               ignore_index=-100, reduction="none").view_as(y)
    else:
        # the model's LM head in its own dtype: a float32 model's teacher is not rounded
        probs = _teacher(data["hidden"], p[:, :1], samples.teacher_at[idx], lm_head, device)  # [b, K, V]
        ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), probs.flatten(0, 1),
                                               reduction="none").view_as(y)
    return heads_loss(ce, valid, weight)


def heads_loss(ce: Tensor, valid: Tensor, weight: Tensor) -> Tensor:
    """The heads' loss: each head's mean cross-entropy ``ce`` ``[b, K]`` over its ``valid``
    positions, weighted by ``weight`` ``[K]`` (``DECAY ** k``: later heads count less)."""
    return ((ce * valid).sum(0) / valid.sum(0).clamp_min(1) * weight).sum()


def optimizer_step(opt, sched, loss: Tensor) -> None:
    """One optimizer step on ``loss``: gradients cleared, back-propagated, applied, and the
    learning rate's schedule advanced."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def _checkpoint_problem(state: dict, meta: dict, params: list, total: int) -> Optional[str]:
    """Why a checkpoint of this run's settings cannot be resumed from (``_checkpoint``'s
    tensors, finite and shaped as ``params``; a step in ``[0, total]``), or None."""
    for i, p in enumerate(params):
        got = [state.get(f"{name}{i}") for name in ("p", "m", "v")]
        if any(t is None or t.shape != p.shape or not t.is_floating_point()
               or not bool(torch.isfinite(t).all()) for t in got):
            return f"holding no finite {list(p.shape)} weights and moments p{i}, m{i}, v{i}"
        if state.get(f"step{i}") is None or state[f"step{i}"].numel() != 1:
            return f"holding no step count step{i}"
    try:
        step, seconds, _ = int(meta["step"]), float(meta["seconds"]), float(meta.get("loss", "nan"))
    except (KeyError, ValueError):
        return "without its step, seconds or loss"
    if not 0 <= step <= total or not math.isfinite(seconds) or seconds < 0:
        return f"at step {step} of {total} after {seconds} s"
    return None


def _checkpoint(path: Path, params: list, opt, step: int, seconds: float, key: str,
                loss: float) -> None:
    s = opt.state_dict()["state"]
    tensors = {f"p{i}": p.detach().cpu() for i, p in enumerate(params)}
    for i in range(len(params)):
        tensors[f"m{i}"] = s[i]["exp_avg"].cpu()
        tensors[f"v{i}"] = s[i]["exp_avg_sq"].cpu()
        tensors[f"step{i}"] = torch.as_tensor(s[i]["step"]).float().reshape(())
    tensor_files.save(path, tensors, {"step": str(step), "seconds": f"{seconds:.3f}",
                                      "settings": key, "loss": repr(loss)})


def rank_accuracy(data: dict, lm_head: Tensor, w, b: Tensor, embed: Optional[Tensor] = None,
                  *, deep: Optional[tuple] = None, chunk: int = 512) -> list:
    """``[K][RANKS]``: how often head ``k``'s ``r``-th best token is the right one (Hydra:
    given the right path before it)."""
    k = b.shape[0]
    pairs = _samples(data, k)
    targets = head_targets(data, pairs, k)
    path = path_tokens(data, pairs, k) if embed is not None else None
    w = [t.float() for t in w] if embed is not None else w.float()
    deep = tuple(t.float() for t in deep) if deep is not None else None
    hits = torch.zeros(k, RANKS)
    counts = torch.zeros(k)
    head = lm_head.float()
    with torch.inference_mode():
        for i in range(0, len(pairs), chunk):
            p, y = pairs[i:i + chunk], targets[i:i + chunk].to(head.device)
            h = data["hidden"][p[:, 0], p[:, 1]].to(head.device).float()
            e = embed.float() if embed is not None else None
            q = path[i:i + chunk].to(head.device) if path is not None else None
            logits = heads_forward(h, w, b.float(), e, q, deep) @ head.t()  # [b, K, V]
            top = logits.topk(RANKS, dim=-1).indices  # [b, K, RANKS]
            match = (top == y[..., None]) & (y[..., None] != -100)
            hits += match.sum(0).cpu().float()
            counts += (y != -100).sum(0).cpu().float()
    return (hits / counts.clamp_min(1)[:, None]).tolist()
