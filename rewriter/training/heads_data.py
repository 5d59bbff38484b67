"""The heads' training and held-out data, made part by part and cached in the work directory.

``data="generated"``: prompts (``prompts.make_prompts``) are continued greedily by the model
itself, through this project's runtime. Greedy targets are what lossless greedy
verification accepts: the text the model would write, not the corpus's.
``data="corpus"`` makes no text: rows of consecutive source-file tokens, each position's
target the model's own greedy token there (from one forward over the row). For Hydra
this is the same target, the model's choice after the path it is given, at the cost of
a prefill instead of a generation; Medusa's heads skip the path and learn the corpus's
path instead of the model's. The held-out set stays generated text, so the accuracies
(and the trees chosen from them) mean the same for both. ``data="mixed"`` trains on
both: the generated continuations of ``prompts`` prompts and ``rows`` corpus rows, each
cached as its own mode caches it (a mixed run reuses a generated run's data), and with
``questions`` also chat questions the model asks itself (``prompts.self_asked``), answered
greedily like the other prompts.

**Hidden states**, computed once with the model (its last hidden state, the LM head's
input) and cached in ``work_dir`` with the tokens: a resumed run reuses both. Every
file there is written under a temporary name and renamed (``rewriter.files.tensor_files``);
a torn one (from a version that wrote in place) is made again, with a warning.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from rewriter.files import safe_files, tensor_files
from rewriter.training.generation import (continue_prompts, eos_ids, hidden_states, one_engine,
                                          partial_rows, save_rows)
from rewriter.training.prompts import corpus_rows, make_prompts, self_asked


def make_data(model, tokenizer, work: Path, settings: dict, data: str, rows: int,
              questions: int, generate_batch: int, progress: bool) -> tuple:
    """``(sets, seconds, counts)``: the "train" and "heldout" sets, each made (or read from
    ``work``'s caches) part by part as ``_parts`` lists them, with every row's end; the
    seconds making them took (None when a cache does not say); ``[V]`` how often the model
    produced each token in the train set. ``settings``: the key the data is cached under
    (``train_heads``' settings, with the model's fingerprint)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    sets, data_seconds, counts = {}, 0.0, torch.zeros(vocab, dtype=torch.int64)
    with one_engine(model), safe_files.new_dirs(work):  # no empty work dir left if it fails
        safe_files.remove_temp_files(work)  # what a run killed while writing left
        for split, n in (("train", settings["prompts"]), ("heldout", settings["heldout_prompts"])):
            parts = []
            for kind, count in _parts(data if split == "train" else "generated", n, rows, questions):
                part, seconds = _dataset(model, tokenizer, work, split, count,
                                         _part_settings(settings, kind, count), generate_batch,
                                         progress)
                part["end"] = row_ends(part, settings["new_tokens"], eos_ids(model, tokenizer))
                if split == "train":
                    counts += produced(part, vocab)
                parts.append(part)
                data_seconds = None if seconds is None or data_seconds is None else data_seconds + seconds
            sets[split] = parts[0] if len(parts) == 1 else merge_parts(parts)
    return sets, data_seconds, counts


def _parts(data: str, n: int, rows: int, questions: int = 0) -> list:
    """The kinds of data a split is made of, with their counts: ``[(kind, count)]``."""
    if data == "mixed":
        return [("generated", n), ("corpus", rows)] + ([("magpie", questions)] if questions else [])
    return [(data, n)]


def _part_settings(settings: dict, kind: str, count: int) -> dict:
    """The settings one kind of data is cached under: those of a run of that mode alone,
    so a mixed run reuses what a generated or corpus run made (and the reverse)."""
    s = {k: v for k, v in settings.items() if k not in ("data", "rows", "questions")}
    if kind != "generated":
        s.update(data=kind, prompts=count)
    return s


def merge_parts(parts: list) -> dict:
    """One training set of several, each with its ``end`` already: rows right-padded to one
    width (``[N, L]``, hidden ``[N, L, H]``), every row's targets read from ``next`` (a
    generated row's greedy token after position ``t`` is its own text at ``t + 1``). Every
    row has ``next``, so ``row_ends`` and ``produced`` must be applied to the parts, not to
    the merged set. The hidden states are copied part by part into one tensor."""
    width = max(p["tokens"].shape[1] for p in parts)
    n = sum(len(p["tokens"]) for p in parts)
    first = parts[0]["hidden"]
    out = {"tokens": torch.zeros(n, width, dtype=torch.int64),
           "next": torch.zeros(n, width, dtype=torch.int64),
           "hidden": torch.zeros(n, width, first.shape[2], dtype=first.dtype),
           "start": torch.cat([p["start"] for p in parts]),
           "end": torch.cat([p["end"] for p in parts])}
    r = 0
    for p in parts:
        tokens = p["tokens"]  # [m, l]
        m, length = tokens.shape
        out["tokens"][r:r + m, :length] = tokens
        if "next" in p:
            out["next"][r:r + m, :length] = p["next"]
        else:
            out["next"][r:r + m, :length - 1] = tokens[:, 1:]
        out["hidden"][r:r + m, :length] = p["hidden"]  # [m, l, H]
        r += m
    return out


def row_ends(data: dict, new_tokens: int, eos: set) -> Tensor:
    """``[N]`` where each row's text ends: after its ``new_tokens`` generated tokens (the
    rest is right padding), or after the first end-of-sequence token among them (decoding
    stops there: what follows is never drafted for)."""
    tokens, start = data["tokens"], data["start"]
    if "next" in data:  # corpus rows: every position is text
        return torch.full_like(start, tokens.shape[1])
    end = start + new_tokens
    if eos:
        for r in range(len(tokens)):
            made = tokens[r, int(start[r]):int(end[r])]
            hit = torch.isin(made, torch.tensor(sorted(eos))).nonzero()
            if len(hit):
                end[r] = int(start[r]) + int(hit[0]) + 1
    return end


def produced(data: dict, vocab: int) -> Tensor:
    """``[V]`` how often the model produced each token (its continuations only): the
    draft vocabulary keeps the most frequent (VocabTrim). Corpus rows: its greedy token
    after every position."""
    if "next" in data:
        return torch.bincount(data["next"].flatten(), minlength=vocab)[:vocab]
    tokens, start, end = data["tokens"], data["start"], data["end"]
    made = torch.cat([row[int(s):int(e)] for row, s, e in zip(tokens, start, end)])
    return torch.bincount(made, minlength=vocab)[:vocab]


def _dataset(model, tokenizer, work: Path, split: str, n: int, settings: dict,
             generate_batch: int, progress: bool) -> dict:
    """(``{"tokens" [N, L], "start" [N], "hidden" [N, L, H]}``, the seconds making it took),
    cached in ``work``."""
    kind = settings.get("data", "generated") if split == "train" else "generated"
    corpus = kind == "corpus"  # held out: always generated
    # a file of its own: a corpus run must not overwrite generated data that took hours
    own = "" if kind == "generated" else f"-{kind}"
    f = work / f"{split}{own}.safetensors"
    # the held-out set is the same whatever the training data: one cache for every run
    drop = {"data"} if kind == "generated" else set()
    drop |= {"prompts"} if split == "heldout" else set()
    key = json.dumps({**{k: v for k, v in settings.items() if k not in drop},
                      "split": split}, sort_keys=True)
    cached = tensor_files.load(f, f"the {split} data cache", lambda m: m.get("settings") == key)
    if cached is not None:
        why = _cache_problem(cached[0], n, settings["model"]["shape"], corpus)
        if why is None:
            return cached[0], _seconds(cached[1].get("seconds"))
        tensor_files.discard(f, f"the {split} data cache", why)
    started = time.perf_counter()
    if corpus:  # teacher-forced: the text is the corpus's, the targets the model's argmax
        rows = corpus_rows(tokenizer, split, n, settings["prompt_tokens"] + settings["new_tokens"],
                           settings["seed"])
        tokens, before = torch.tensor(rows, dtype=torch.int64), 0.0  # [N, L]
        start = torch.ones(n, dtype=torch.int64)  # heads draft after every position
    else:
        if kind == "magpie":  # sampled once: a resumed run answers the same questions
            prompts, asked = _saved_questions(model, tokenizer, n, settings["seed"], progress,
                                              work / f"{split}{own}.questions.safetensors", key)
            started -= asked  # an earlier run's time asking them counts too
        else:
            prompts = make_prompts(tokenizer, split, n, settings["prompt_tokens"],
                                   settings["seed"], settings["chat"])
        tokens, start, before = continue_prompts(model, tokenizer, prompts, settings["new_tokens"],
                                                 generate_batch, progress, split,
                                                 work / f"{split}{own}.partial.safetensors", key)
    hidden, nxt = hidden_states(model, tokens, progress, split, argmax=corpus)
    data = {"tokens": tokens, "start": start, "hidden": hidden}
    if corpus:
        data["next"] = nxt  # [N, L] the model's greedy token after each position
    seconds = before + time.perf_counter() - started  # an interrupted run's time counts too
    tensor_files.save(f, data, {"settings": key, "seconds": f"{seconds:.3f}"})
    if not corpus:  # an interrupted generation's rows: this kind's own
        (work / f"{split}{own}.partial.safetensors").unlink(missing_ok=True)
    return data, seconds


def _cache_problem(data: dict, n: int, lm_shape: list, corpus: bool) -> Optional[str]:
    """Why a data cache whose settings match cannot be what ``_dataset`` made (``n`` rows
    for a model whose LM head is ``lm_shape``), or None: ``tokens`` ``[n, L]`` ids,
    ``start`` ``[n]`` in ``[1, L]``, ``hidden`` ``[n, L, H]`` floats; corpus rows ``next``
    ``[n, L]`` ids too."""
    names = {"tokens", "start", "hidden"} | ({"next"} if corpus else set())
    if set(data) != names:
        return f"holding {sorted(data)}, not {sorted(names)}"
    tokens, start, hidden = data["tokens"], data["start"], data["hidden"]
    if tokens.dim() != 2 or len(tokens) != n or tokens.shape[1] < 1:
        return f"holding tokens of shape {list(tokens.shape)}, not [{n}, L]"
    length, vocab = tokens.shape[1], lm_shape[0]
    for name in ("tokens", "next") if corpus else ("tokens",):
        t = data[name]
        if t.dtype != torch.int64 or t.shape != tokens.shape:
            return f"holding {name} of {t.dtype} {list(t.shape)}, not int64 {list(tokens.shape)}"
        if t.numel() and not (0 <= int(t.min()) and int(t.max()) < vocab):
            return f"holding {name} outside the vocabulary of {vocab}"
    if start.shape != (n,) or start.dtype != torch.int64 or n and not (
            1 <= int(start.min()) and int(start.max()) <= length):
        return f"holding starts outside [1, {length}]"
    if not hidden.is_floating_point() or hidden.shape != (n, length, lm_shape[1]):
        return f"holding hidden states of shape {list(hidden.shape)}, not {[n, length, lm_shape[1]]}"
    return None


def _seconds(text) -> Optional[float]:
    """A cache's recorded seconds, or None (a cache from before timings were kept, or a
    value no run can have taken)."""
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _saved_questions(model, tokenizer, n: int, seed: int, progress: bool, path: Path,
                     key: str) -> tuple[list, float]:
    """``self_asked``'s prompts, sampled once and kept in ``path`` (under ``key``): an
    interrupted run answers the same questions; and the seconds an earlier run spent
    asking them (0 when this run asks)."""
    saved, seconds = partial_rows(path, key)
    if len(saved) == n:
        return saved, seconds
    began = time.perf_counter()
    prompts = self_asked(model, tokenizer, n, seed, progress)
    save_rows(path, prompts, key, time.perf_counter() - began)
    return prompts, 0.0
