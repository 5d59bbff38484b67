"""Adapt a model to KV sharing across layers (``rewriter train-share``), by distillation
from the model as it is.

    from rewriter.training.train_share import train_share
    report = train_share(rewriter.trace(model, tokenizer), tokenizer, "cla2.safetensors", every=2)

1. **Sharing** (``ShareKV``: ``every``, ``last`` or ``sources``) on the IR, so any model
   rewriter loads trains the same way (GGUF included).
2. **What trains**: only what sharing changes: each owner's K and V projections (and a
   per-layer k/v norm or bias on their way to attention), which now serve a whole group;
   with ``queries``, the readers' query projections too, which may learn to ask the
   owner's keys. Everything else is frozen. ``init="mean"`` starts each owner from the
   mean of its group's K/V weights (MLKV's recipe), ``"owner"`` from its own.
3. **Loss**: KL(original || shared) of the next-token distributions at every position of
   rows of the corpus's training split (the model's own text, as ``train-heads --data
   corpus`` takes it, each row led by BOS like the evaluation's chunks), through the IR's
   whole-sequence graph on plain functions (``share_program``). Adam at a constant
   ``lr``; the batches are drawn by step from ``seed``, and ``WORK/state.safetensors``
   (``train_share_state``) lets an interrupted run resume to the same result.
4. **Quality**: held-out perplexity on code and prose through the KV-cache runtime, of the
   model as it is, shared before training (at the start weights) and after, written with
   the tensors (``rewriter.passes.share_kv_weights``), which ``ShareKV(..., weights=OUT)``
   loads.
"""
from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Optional, Union

import torch

from rewriter.files import safe_files
from rewriter.passes import ShareKV
from rewriter.passes import share_kv_weights as weights_file
from rewriter.training.share_program import distill_loss, inputs, program
from rewriter.training.train_share_state import checkpoint, resume
from rewriter.values import context_length

INITS = ("mean", "owner")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def train_share(traced, tokenizer, out: Union[str, os.PathLike], every: Optional[int] = None,
                last: Optional[int] = None, sources: Optional[dict] = None, init: str = "owner",
                queries: bool = False, steps: int = 300, lr: float = 1e-3, batch: int = 4,
                length: int = 256, rows: int = 1024, passkey: float = 0.0, seed: int = 0,
                work_dir: Optional[Union[str, os.PathLike]] = None, eval_chunks: int = 4,
                eval_length: int = 256, dtype: str = "float32", save_every: int = 25,
                progress: bool = True) -> dict:
    """Adapt ``traced`` (``rewriter.trace``'s result) to the sharing given and write the
    trained tensors to ``out``; returns the report (also in the file's metadata)."""
    check_settings(init=init, queries=queries, steps=steps, lr=lr, batch=batch, length=length,
                   rows=rows, passkey=passkey, seed=seed, eval_chunks=eval_chunks, eval_length=eval_length,
                   dtype=dtype, save_every=save_every)
    share = ShareKV(sources=sources, every=every, last=last)  # ValueError for a bad map
    context = context_length(traced.ir.info.get("config", {}))
    for name, n in (("length", length), ("eval_length", eval_length)):
        if n > context:  # positions the model never saw; the evaluation would refuse them last
            raise ValueError(f"train_share: {name} {n} is past the model's context length "
                             f"({context})")
    if tokenizer is None:
        raise ValueError("train_share: the model has no tokenizer; the training rows are text")
    out, work = check_paths(out, work_dir)
    with safe_files.new_dirs(work):  # removed again if the run fails before a checkpoint
        student, pairs, params, start = _start(traced, share, init, queries)
        settings = {"sources": {str(r): o for r, o in sorted(pairs.items())}, "init": init,
                    "queries": queries, "lr": lr, "batch": batch, "length": length,
                    "rows": rows, "seed": seed, "model": weights_file.identity(student)}
        if passkey:  # runs without pass-key rows keep their checkpoint's key
            settings["passkey"] = passkey
        data = _rows(tokenizer, rows, length, seed, passkey)
        fitted = _fit(traced.ir, student, params, data, settings, work, steps, save_every,
                      progress)
        tensors = {n: p.detach().to(DTYPES[dtype]) for n, p in params.items()}
        weights_file.save(work / "start.safetensors", start, pairs, settings["model"], {})
        report = {"settings": {k: v for k, v in settings.items() if k != "model"},
                  "steps": steps, "dtype": dtype, **fitted,
                  "trained": sorted(params), "trained_params": sum(p.numel() for p in params.values())}
        weights_file.save(out, tensors, pairs, settings["model"], report)
        report["quality"] = quality(traced, tokenizer, share, out, work / "start.safetensors",
                                    eval_chunks, eval_length)
        weights_file.save(out, tensors, pairs, settings["model"], report)  # with the quality
    return report


def check_settings(*, init, queries, steps, lr, batch, length, rows, seed, eval_chunks,
                   eval_length, dtype, save_every, passkey=0.0) -> None:
    """A ``ValueError`` naming the first setting no model could train with (checked before
    the model loads; the lengths against its context when it has)."""
    if init not in INITS:
        raise ValueError(f"train_share: init must be one of {', '.join(INITS)}, got {init!r}")
    if dtype not in DTYPES:
        raise ValueError(f"train_share: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(queries, bool):
        raise ValueError(f"train_share: queries must be True or False, got {queries!r}")
    for name, v, low in (("steps", steps, 1), ("batch", batch, 1), ("length", length, 16),
                         ("rows", rows, 1), ("eval_chunks", eval_chunks, 1),
                         ("eval_length", eval_length, 16), ("save_every", save_every, 1)):
        if type(v) is not int or not low <= v <= 1 << 20:
            raise ValueError(f"train_share: {name} must be an integer in [{low}, {1 << 20}], "
                             f"got {v!r}")
    if batch > rows:
        raise ValueError(f"train_share: batch ({batch}) must be at most rows ({rows})")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < 1:
        raise ValueError(f"train_share: lr must be a number in (0, 1), got {lr!r}")
    if isinstance(passkey, bool) or not isinstance(passkey, (int, float)) or not 0 <= passkey <= 1:
        raise ValueError(f"train_share: passkey must be a fraction of the rows in [0, 1], "
                         f"got {passkey!r}")
    if passkey and length < 64:
        raise ValueError(f"train_share: pass-key rows need length >= 64, got {length}")
    if type(seed) is not int or not 0 <= seed < 2 ** 32:
        raise ValueError(f"train_share: seed must be an integer in [0, 2**32), got {seed!r}")


def check_paths(out, work_dir) -> tuple[Path, Path]:
    """``(out, work directory)``: ``out`` a new file or a weights file of this kind (it is
    replaced), its parents creatable; the work directory (``OUT.work`` by default) a
    directory or nothing yet."""
    out = safe_files.check_new_file(out, "train_share: out", "share-kv weights file",
                                    _is_weights_file, make_parents=True)
    from rewriter.values import path_problem
    if work_dir is not None and path_problem(work_dir) is not None:
        raise ValueError(f"train_share: work_dir must name a directory, got {work_dir!r}")
    work = Path(work_dir) if work_dir is not None else out.with_name(out.name + ".work")
    if work.is_symlink() or (work.exists() and not work.is_dir()):
        raise ValueError(f"train_share: work directory {work} is not a directory")
    if work.absolute() == out.absolute():
        raise ValueError(f"train_share: work_dir and out both name {out}")
    return out, work


def _is_weights_file(path: Path) -> bool:
    try:
        weights_file.read_meta(path)
    except ValueError:
        return False
    return True


def _start(traced, share: ShareKV, init: str, queries: bool) -> tuple:
    """``(shared IR, {reader: owner}, {name: trained tensor}, {name: start tensor})``: the
    trained weights are fresh tensors that require grad (the traced model's own
    stay as they are), at ``init``'s start."""
    import rewriter
    from rewriter.ir.sharing import sources
    student = rewriter.optimize(traced, passes=[share]).ir
    pairs = sources(student.graph)
    if not pairs:
        raise ValueError(f"train_share: {share!r} shares no layer of this model")
    names = weights_file.trained_names(student, pairs, queries)
    start = {n: student.weight(n).detach().clone() for n in names["kv"] + names["q"]}
    if init == "mean":
        start.update(_group_means(traced.ir, pairs))
    params = {}
    for name, t in start.items():  # in the model's dtype: the graph's other inputs are
        params[name] = t.to(student.weight(name).dtype).clone().requires_grad_(True)
        student.add_weight(name, params[name])
    return student, pairs, params, start


def _group_means(plain, pairs: dict[int, int]) -> dict:
    """``{owner's K/V weight name: the mean of its group's}`` (MLKV's start), the group's
    weights matched by their place on the way to attention."""
    from rewriter.ir.nodes import attention_args
    from rewriter.ir.sharing import attention_by_layer
    by_layer = attention_by_layer(plain.graph)
    path = {layer: [weights_file.projection_weights(attention_args(n)[x]) for x in ("k", "v")]
            for layer, n in by_layer.items()}
    means = {}
    for owner in sorted(set(pairs.values())):
        group = [owner] + [r for r, o in pairs.items() if o == owner]
        for i, names in enumerate(path[owner]):
            for j, name in enumerate(names):
                means[name] = torch.stack([plain.weight(path[g][i][j]).float()
                                           for g in group]).mean(0)
    return means


def _rows(tokenizer, n: int, length: int, seed: int, passkey: float = 0.0) -> torch.Tensor:
    """``[n, length]`` token ids: BOS (when the tokenizer adds one) and ``length - 1``
    consecutive tokens of the corpus's training split; a ``passkey`` fraction of them
    pass-key prompts with their answer instead (``_passkey_rows``)."""
    from rewriter.training.prompts import corpus_rows
    from rewriter.runtime.chat import split_tokenizer
    tok, _ = split_tokenizer(tokenizer)
    bos = tok.encode("").ids[:1]
    body = [bos + row for row in corpus_rows(tokenizer, "train", n, length - len(bos), seed)]
    keys = round(n * passkey)
    if keys:
        body[:keys] = _passkey_rows(tok, body[:keys], length, seed)
        random.Random(f"train-share-mix-{seed}").shuffle(body)
    return torch.tensor(body)


def _passkey_rows(tok, tails: list, length: int, seed: int) -> list:
    """Pass-key prompts with their answer (the project's generator on training-split code
    or fixed sentences, drawn apart from the evaluation's seeds), as many as ``tails``,
    each filled up to ``length`` tokens with its tail row's tokens: a retrieval the model
    does, which rows of code alone never ask of it."""
    from rewriter.models.corpus import code_lines, load_corpus, passkey_sample
    lines = code_lines(load_corpus("train"))
    rng = random.Random(f"train-share-passkey-{seed}")
    rows = []
    for tail in tails:
        s = passkey_sample(tok, length, rng.uniform(0.05, 0.95), rng, lines=lines,
                           filler=rng.choice(["sentences", "code"]))
        ids = tok.encode(s.prompt + s.target).ids[:length]
        rows.append(ids + tail[:length - len(ids)])
    return rows


def _fit(plain, student, params: dict, data: torch.Tensor, settings: dict, work: Path,
         steps: int, save_every: int, progress: bool) -> dict:
    """Adam on the distillation loss for ``steps`` steps (from the checkpoint's, when there
    is one); returns the loss history's summary."""
    optim = torch.optim.Adam(list(params.values()), lr=settings["lr"])
    first, history, seconds = resume(work, settings, params, optim, steps)
    teacher, taught = program(plain), program(student)
    from tqdm import tqdm
    bar = tqdm(total=steps, initial=first, desc="train share", unit="step",
               disable=not progress, leave=False)
    began = time.perf_counter()
    for step in range(first, steps):
        ids = data[_batch(settings["seed"], step, len(data), settings["batch"])]  # [B, L]
        with torch.no_grad():
            target = teacher(*inputs(plain, ids))
        loss = distill_loss(taught(*inputs(student, ids)), target)
        if not math.isfinite(loss.item()):
            raise ValueError(f"train_share: the loss is {loss.item()} at step {step}: "
                             f"give a lower lr")
        optim.zero_grad()
        loss.backward()
        optim.step()
        history.append(round(loss.item(), 6))
        bar.update(1)
        bar.set_postfix(kl=f"{loss.item():.4f}")
        if (step + 1) % save_every == 0 or step + 1 == steps:
            checkpoint(work, settings, params, optim, history,
                       seconds + time.perf_counter() - began)
    bar.close()
    window = max(1, min(25, len(history) // 4))
    return {"resumed_at": first, "seconds": round(seconds + time.perf_counter() - began, 1),
            "threads": torch.get_num_threads(), "kl_first": _mean(history[:window]),
            "kl_last": _mean(history[-window:]), "kl_history": history}


def _batch(seed: int, step: int, n: int, batch: int) -> list[int]:
    """The rows of one step: drawn from ``seed`` and the step alone, so a resumed run
    draws what the uninterrupted one would."""
    return random.Random(f"train-share-{seed}-{step}").sample(range(n), batch)


def _mean(values: list) -> float:
    return round(sum(values) / max(1, len(values)), 6)


def quality(traced, tokenizer, share: ShareKV, out: Path, start: Path, chunks: int,
            length: int) -> dict:
    """Held-out perplexity (code, prose) through the KV-cache runtime of the model as it
    is, shared at the start weights, and shared with the trained ones; KV bytes per token."""
    import rewriter
    from rewriter.api.eval import heldout_chunks, perplexity
    text = {c: heldout_chunks(tokenizer, chunks, length, c) for c in ("code", "prose")}
    shared = {k: v for k, v in share.params().items() if k in ("sources", "every", "last")
              and v is not None}
    rows = {}
    for name, passes in (("plain", []), ("before", [ShareKV(**shared, weights=str(start))]),
                         ("after", [ShareKV(**shared, weights=str(out))])):
        engine = rewriter.optimize(traced, passes=passes)
        rows[name] = {"kv_bytes_per_token": engine.kv_bytes_per_token(),
                      **{c: round(perplexity(engine, x), 4) for c, x in text.items()}}
    for name in ("before", "after"):
        rows[name]["ratio"] = {c: round(rows[name][c] / rows["plain"][c], 4) for c in text}
    return rows
