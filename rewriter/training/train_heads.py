"""Train draft heads (Medusa, Hydra) on a frozen model, by self-distillation
(``rewriter train-heads``).

    from rewriter.training.train_heads import train_heads
    report = train_heads(model, tokenizer, "heads.safetensors", num_heads=4)

1. **Data** (``heads_data``): prompts (``prompts``: code chunks, chat questions about them,
   questions the model asks itself) continued greedily by the model itself, through this
   project's runtime (``generation``), or rows of the corpus, or both; cached in
   ``work_dir`` with the model's hidden states.
2. **Training** (``heads_fit``): only the heads' residual blocks learn, on the model's own
   tokens or its whole distribution; seeded, and resumed from a checkpoint in ``work_dir``
   after an interruption. A run may start from earlier heads (``init``) and make them
   deeper (``blocks``).
3. **Held-out rank accuracies** of each head, which the pass uses to choose the
   verification tree, are written with the heads (``rewriter.drafts.heads``' format).

This module checks the arguments, the paths and the start before any data is made, keys the
data by its settings and the model, and saves the heads.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor

from safetensors import SafetensorError, safe_open

from rewriter.drafts import heads as heads_file
from rewriter.files import safe_files
from rewriter.training.heads_data import make_data
from rewriter.training.heads_fit import fit_heads, rank_accuracy
from rewriter.training.malloc import reuse_freed_memory
from rewriter.training.prompts import question_prefix
from rewriter.values import path_problem

LOSSES = ("tokens", "teacher")
DATA = ("generated", "corpus", "mixed")
SEEDS = 2 ** 32  # seeds are below this: torch's generators take seed * 1000 + epoch


def train_heads(model, tokenizer, out: Union[str, os.PathLike], num_heads: int = 4,
                prompts: int = 512, heldout_prompts: int = 48, prompt_tokens: int = 64,
                new_tokens: int = 96, epochs: int = 2, lr: float = 1e-3, batch: int = 256,
                seed: int = 0, work_dir: Optional[Union[str, os.PathLike]] = None,
                generate_batch: int = 32, progress: bool = True, chat: bool = True,
                arch: str = "medusa", loss: str = "tokens", data: str = "generated",
                rows: Optional[int] = None, questions: int = 0,
                init: Optional[Union[str, os.PathLike]] = None, blocks: int = 1) -> dict:
    """Train heads for ``model`` (a Hugging Face causal LM, frozen) and write them to ``out``
    (``rewriter.drafts.heads`` format); returns what was done and measured. ``arch``: "medusa"
    or "hydra"; ``loss``: "tokens" or "teacher"; ``data``: "generated", "corpus" or "mixed"
    (see ``heads_data``' docstring; ``rows``: a mixed run's corpus rows, default ``prompts``;
    ``questions``: a mixed run's self-asked chat questions; ``init``: a heads file of this
    architecture and model to start from, so heads trained on earlier data learn from more:
    its weights are the start and its token counts are added to this data's; ``blocks``:
    residual blocks per head, at least the start's: the blocks it lacks start at zero)."""
    _check_arguments(model, tokenizer, num_heads=num_heads, prompts=prompts,
                     heldout_prompts=heldout_prompts, prompt_tokens=prompt_tokens,
                     new_tokens=new_tokens, epochs=epochs, lr=lr, batch=batch, seed=seed,
                     generate_batch=generate_batch, arch=arch, loss=loss, data=data, rows=rows,
                     questions=questions, init=init, blocks=blocks)
    rows = prompts if rows is None else rows
    out, work = check_paths(out, work_dir)
    start = _initial(init, arch, num_heads, model, blocks) if init is not None else None
    settings = _data_settings(model, data, rows, questions, prompts=prompts,
                              heldout_prompts=heldout_prompts, seed=seed,
                              prompt_tokens=prompt_tokens, new_tokens=new_tokens, chat=chat)
    train_settings = _train_settings(init, start, settings)
    lm_head = model.get_output_embeddings().weight.detach()
    embed = heads_file.model_embedding(model) if arch == "hydra" else None
    # out's missing directories, made before hours of work (not found missing after them);
    # removed again, while still empty, if the run fails
    with safe_files.new_dirs(out.parent):
        sets, data_seconds, counts = make_data(model, tokenizer, work, settings, data, rows,
                                               questions, generate_batch, progress)
        if start is not None and start[0].counts is not None:  # the data the start was trained on
            counts += start[0].counts
        with reuse_freed_memory():  # each step's large blocks reused, not faulted in again
            w, b, deep, trained = fit_heads(sets["train"], lm_head, embed, num_heads, epochs,
                                            lr, batch, seed, work, train_settings, progress,
                                            loss, start[0] if start is not None else None,
                                            blocks)
        accuracy = rank_accuracy(sets["heldout"], lm_head, w, b, embed, deep=deep)
        report = {**trained, "seconds_data": data_seconds and round(data_seconds, 1),
                  "settings": _shown(settings), "train_tokens": _tokens(sets["train"]),
                  **_accuracy_report(accuracy), "device": str(lm_head.device), "arch": arch,
                  "loss": loss, "data": data, "blocks": blocks, **_init_report(init, arch, start)}
        _save(out, w, b, deep, lm_head, accuracy, report, counts, arch)
    return report


def _train_settings(init, start, settings: dict) -> dict:
    """The training's own key (not the data's: a run from other heads reuses the data): the
    data's ``settings`` and the sha256 of the start (``init``, read as ``start``), which is
    refused if trained on this very data (its token counts would be added twice)."""
    if start is None:
        return dict(settings)
    if start[0].trained.get("settings") == _shown(settings):
        raise ValueError(f"train_heads: init {init} was trained on this very data (the same "
                         f"settings and seed; its token counts would be added twice, also "
                         f"when deepening it): give another seed or more data")
    return {**settings, "init": start[1]}


def _tokens(rows: dict) -> int:
    """The tokens a data set's rows train on (each row's, from its start to its end)."""
    return int((rows["end"] - rows["start"]).sum())


def _accuracy_report(accuracy: list) -> dict:
    """Each head's held-out top-1 and top-5 accuracy, as the report shows them."""
    return {"heldout_top1": [round(a[0], 4) for a in accuracy],
            "heldout_top5": [round(sum(a[:5]), 4) for a in accuracy]}


def _check_arguments(model, tokenizer, *, num_heads, prompts, heldout_prompts, prompt_tokens,
                     new_tokens, epochs, lr, batch, seed, generate_batch, arch, loss, data,
                     rows, questions, init, blocks) -> None:
    """``train_heads``' arguments (``rows`` as given: None is ``prompts``), checked against
    each other and the model before any path is checked or any data made."""
    if arch not in heads_file.ARCHS:
        raise ValueError(f"train_heads: arch must be one of {heads_file.ARCHS}, got {arch!r}")
    if data not in DATA:
        raise ValueError(f"train_heads: data must be one of {DATA}, got {data!r}")
    if rows is not None and data != "mixed":
        raise ValueError(f"train_heads: rows counts the corpus rows of data='mixed' (data="
                         f"'corpus' takes its rows from prompts), got rows={rows!r} with "
                         f"data={data!r}")
    if questions and data != "mixed":
        raise ValueError(f"train_heads: questions (self-asked chat questions) are part of "
                         f"data='mixed', got questions={questions!r} with data={data!r}")
    rows = prompts if rows is None else rows
    if loss not in LOSSES:
        raise ValueError(f"train_heads: loss must be one of {LOSSES}, got {loss!r}")
    if type(num_heads) is not int or not 1 <= num_heads <= heads_file.MAX_HEADS:
        raise ValueError(f"train_heads: num_heads must be an int in [1, {heads_file.MAX_HEADS}], "
                         f"got {num_heads!r}")
    for name, v, low in (("prompts", prompts, 1), ("rows", rows, 1), ("questions", questions, 0),
                         ("heldout_prompts", heldout_prompts, 1), ("prompt_tokens", prompt_tokens, 2),
                         ("new_tokens", new_tokens, num_heads + 2), ("epochs", epochs, 1),
                         ("batch", batch, 1), ("generate_batch", generate_batch, 1),
                         ("blocks", blocks, 1)):
        if type(v) is not int or v < low:
            raise ValueError(f"train_heads: {name} must be an int >= {low}, got {v!r}")
    if blocks > heads_file.MAX_BLOCKS:
        raise ValueError(f"train_heads: blocks must be at most {heads_file.MAX_BLOCKS}, got {blocks}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < 1:
        raise ValueError(f"train_heads: lr must be a number in (0, 1), got {lr!r}")
    if type(seed) is not int or not 0 <= seed < SEEDS:
        raise ValueError(f"train_heads: seed must be an int in [0, 2**32), got {seed!r}")
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + new_tokens > context:
        raise ValueError(f"train_heads: prompt_tokens + new_tokens = {prompt_tokens + new_tokens} "
                         f"exceeds the model's context of {context} tokens")
    if tokenizer is None:
        raise ValueError("train_heads: the model has no tokenizer; the training prompts are text")
    if questions:  # checked (an int by now) before hours of other data are made
        question_prefix(model, tokenizer)
    if init is not None and path_problem(init) is not None:
        raise ValueError(f"train_heads: init must be a heads file's path or a shipped name "
                         f"({', '.join(heads_file.SHIPPED)}), got {init!r}")


def _data_settings(model, data: str, rows: int, questions: int, **counts) -> dict:
    """The key the data is cached under: ``counts`` (prompts, held-out prompts, seed, token
    counts, chat), the model, and what a mode other than "generated" adds."""
    settings = dict(counts)
    # caches and checkpoints belong to one model: a work dir reused for another is not read
    settings["model"] = fingerprint(model)
    if data != "generated":  # caches made before the corpus mode keep their key
        settings["data"] = data
    if data == "mixed":
        settings["rows"] = rows
        if questions:  # mixed runs from before questions keep their key
            settings["questions"] = questions
    return settings


def _shown(settings: dict) -> dict:
    """The data's settings as a report shows them (and a start's report is compared with):
    without the model's fingerprint."""
    return {k: v for k, v in settings.items() if k != "model"}


def _init_report(init, arch: str, start) -> dict:
    """What the report says of the heads a run started from (nothing without ``init``)."""
    if start is None:
        return {}
    # not its whole report: a chain of starts would nest every one
    return {"init": {"file": heads_file.resolve(init, arch).name, "sha256": start[1],
                     **{k: start[0].trained.get(k) for k in ("positions", "settings")}}}


def _save(out: Path, w, b: Tensor, deep, lm_head: Tensor, accuracy: list, report: dict,
          counts: Tensor, arch: str) -> None:
    """The trained heads, in bfloat16, with their accuracies, report and token counts."""
    w = [t.to(torch.bfloat16) for t in w] if arch == "hydra" else w.to(torch.bfloat16)
    deep = tuple(t.to(torch.bfloat16) for t in deep) if deep is not None else None
    heads_file.Heads(w, b.to(torch.bfloat16), lm_head.shape[0], heads_file.probe_of(lm_head),
                     accuracy, report, counts, arch, deep).save(out)


def check_paths(out, work_dir) -> tuple[Path, Path]:
    """``(out, work directory)`` once both are places this run may write: ``out`` no
    directory, link or special file, no file but a heads file (it is replaced), its
    missing parents creatable; the work directory (``OUT.work`` by default) a directory
    or nothing yet. Checked before the model makes any data."""
    out = safe_files.check_new_file(out, "train_heads: out", "heads file", is_heads_file,
                                    make_parents=True)
    if work_dir is not None and path_problem(work_dir) is not None:
        raise ValueError(f"train_heads: work_dir must name a directory, got {work_dir!r}")
    work = Path(work_dir) if work_dir is not None else out.with_name(out.name + ".work")
    if (work.exists() or work.is_symlink()) and not work.is_dir():
        raise ValueError(f"train_heads: work directory {work} exists and is not a directory")
    if work.absolute() == out.absolute():
        raise ValueError(f"train_heads: work_dir and out both name {out}")
    return out, work


def is_heads_file(path: Path) -> bool:
    """Whether ``path`` is a heads file (by its format tag), which a run may replace."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == heads_file.FORMAT
    except (SafetensorError, OSError):
        return False


def _initial(init, arch: str, num_heads: int, model, blocks: int = 1) -> tuple:
    """``(heads, sha256 of the file)``: the heads a run starts from, checked against the
    run's architecture, head count, blocks and model before any data is made."""
    import hashlib
    path = heads_file.resolve(init, arch)
    digest = hashlib.sha256()
    if path.is_file():
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    heads = heads_file.load(path, want=arch)
    if heads.num_heads != num_heads:
        raise ValueError(f"train_heads: init {init} holds {heads.num_heads} heads; this run "
                         f"trains {num_heads} (num_heads)")
    if heads.blocks > blocks:
        raise ValueError(f"train_heads: init {init} holds heads of {heads.blocks} blocks; this "
                         f"run trains {blocks} (blocks: at least the start's)")
    heads.fits(model.get_output_embeddings().weight.detach(), f"train_heads: init {init}")
    return heads, digest.hexdigest()


def fingerprint(model) -> dict:
    """What identifies the model a cache was made with: its LM head's shape, dtype and
    first weights."""
    lm = model.get_output_embeddings().weight.detach()
    return {"shape": list(lm.shape), "dtype": str(lm.dtype), "probe": heads_file.probe_of(lm)}
