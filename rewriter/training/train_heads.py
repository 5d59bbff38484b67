"""Train draft heads (Medusa, Hydra) on a frozen model, by self-distillation.

    from rewriter.training.train_heads import train_heads
    report = train_heads(model, tokenizer, "heads.safetensors", num_heads=4)

1. **Data.** Prompts (held-in standard-library code chunks; with a chat template also chat
   questions made from the code's own docstrings) are continued greedily by the model
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
   ``questions`` also chat questions the model asks itself (Magpie: it is given the chat
   template's text up to a user message and writes the message, sampled), answered
   greedily like the other prompts: chat text in the model's own distribution, where the
   corpus's questions are all about its code.
2. **Hidden states**, computed once with the model (its last hidden state, the LM head's
   input) and cached in ``work_dir`` with the tokens: a resumed run reuses both. Every
   file there is written under a temporary name and renamed (``rewriter.files.tensor_files``);
   a torn one (from a version that wrote in place) is made again, with a warning.
3. **Training**: only the heads' residual blocks learn; the LM head is shared and frozen.
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
4. **Held-out rank accuracies** of each head (on continuations of held-out prompts), which
   the pass uses to choose the verification tree, are written with the heads.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor

from safetensors import SafetensorError, safe_open

from rewriter.drafts import heads as heads_file
from rewriter.files import safe_files, tensor_files
from rewriter.models.corpus import load_corpus
from rewriter.training.malloc import reuse_freed_memory
from rewriter.values import path_problem

RANKS = 10  # rank accuracies stored per head
CHECKPOINT_EVERY = 200  # steps
DECAY = 0.8
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
    (see the module's docstring; ``rows``: a mixed run's corpus rows, default ``prompts``;
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
    if start is not None and start[0].trained.get("settings") == _shown(settings):
        raise ValueError(f"train_heads: init {init} was trained on this very data (the same "
                         f"settings and seed; its token counts would be added twice, also "
                         f"when deepening it): give another seed or more data")
    # the training's own key (not the data's: a run from other heads reuses the data)
    train_settings = {**settings, **({"init": start[1]} if start is not None else {})}
    lm_head = model.get_output_embeddings().weight.detach()
    embed = model.get_input_embeddings().weight.detach() if arch == "hydra" else None
    # out's missing directories, made before hours of work (not found missing after them);
    # removed again, while still empty, if the run fails
    with safe_files.new_dirs(out.parent):
        sets, data_seconds, counts = _make_data(model, tokenizer, work, settings, data, rows,
                                                questions, generate_batch, progress)
        if start is not None and start[0].counts is not None:  # the data the start was trained on
            counts += start[0].counts
        with reuse_freed_memory():  # each step's large blocks reused, not faulted in again
            w, b, deep, trained = _train(sets["train"], lm_head, embed, num_heads, epochs, lr,
                                         batch, seed, work, train_settings, progress, loss,
                                         start[0] if start is not None else None, blocks)
        accuracy = rank_accuracy(sets["heldout"], lm_head, w, b, embed, deep=deep)
        report = {**trained, "seconds_data": data_seconds and round(data_seconds, 1),
                  "settings": _shown(settings),
                  "train_tokens": int((sets["train"]["end"] - sets["train"]["start"]).sum()),
                  "heldout_top1": [round(a[0], 4) for a in accuracy],
                  "heldout_top5": [round(sum(a[:5]), 4) for a in accuracy],
                  "device": str(lm_head.device), "arch": arch, "loss": loss, "data": data,
                  "blocks": blocks, **_init_report(init, arch, start)}
        _save(out, w, b, deep, lm_head, accuracy, report, counts, arch)
    return report


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


def _make_data(model, tokenizer, work: Path, settings: dict, data: str, rows: int,
               questions: int, generate_batch: int, progress: bool) -> tuple:
    """``(sets, seconds, counts)``: the "train" and "heldout" sets, each made (or read from
    ``work``'s caches) part by part as ``_parts`` lists them, with every row's end; the
    seconds making them took (None when a cache does not say); ``[V]`` how often the model
    produced each token in the train set. ``settings``: ``_data_settings``' key."""
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


# ---------------------------------------------------------------------------- data
def fingerprint(model) -> dict:
    """What identifies the model a cache was made with: its LM head's shape, dtype and
    first weights."""
    lm = model.get_output_embeddings().weight.detach()
    return {"shape": list(lm.shape), "dtype": str(lm.dtype), "probe": heads_file.probe_of(lm)}


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


def eos_ids(model, tokenizer) -> set:
    """The model's end-of-sequence token ids: its generation config's and its config's
    (either may hold one id, a list or none)."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        v = getattr(source, "eos_token_id", None) if source is not None else None
        ids |= set(v if isinstance(v, (list, tuple)) else [] if v is None else [v])
    return ids


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


def _engine(model):
    """``rewriter.optimize(model)``, made once inside ``one_engine``."""
    import rewriter
    if id(model) not in _SHARED:
        return rewriter.optimize(model)
    if _SHARED[id(model)] is None:
        _SHARED[id(model)] = rewriter.optimize(model)
    return _SHARED[id(model)]


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


def make_prompts(tokenizer, split: str, n: int, length: int, seed: int, chat: bool) -> list[list[int]]:
    """``n`` prompts from the corpus split: code chunks of ``length`` tokens and (when the
    tokenizer has a chat template and ``chat``) as many chat questions about the code."""
    from rewriter.runtime.chat import chat_prompt, split_tokenizer
    tok, text = split_tokenizer(tokenizer)
    rng = random.Random(f"{seed}-{split}")
    docs = load_corpus(split)
    rng.shuffle(docs)
    code, questions = [], []
    for rel, source in docs:
        ids = tok.encode(source).ids
        for i in range(0, max(0, len(ids) - length), length * 8):
            code.append(ids[i:i + length])
        questions += _questions(rel, source)
        if len(code) >= n and len(questions) >= n:
            break
    rng.shuffle(code)
    rng.shuffle(questions)
    use_chat = chat and text is not None and text.chat_template is not None
    n_chat = n // 2 if use_chat else 0
    if len(code) < n - n_chat or len(questions) < n_chat:  # never fewer prompts than asked
        raise ValueError(f"train_heads: the {split} corpus gives {len(code)} code chunks of "
                         f"{length} tokens and {len(questions)} chat questions; {n} prompts "
                         f"need {n - n_chat} and {n_chat}: ask for fewer prompts")
    out = code[:n - n_chat] + [chat_prompt(tok, text, q) for q in questions[:n_chat]]
    rng.shuffle(out)
    return out


QUESTION_TOKENS = 64  # a self-asked question longer than this is dropped
QUESTION_BATCH = 32  # questions sampled at once: fixed, so the questions depend on the seed only


def question_prefix(model, tokenizer, who: str = "train_heads") -> list[int]:
    """The chat template's tokens before a user message (what the model continues with a
    question of its own); ``ValueError`` naming the command ``who`` when there is no way to ask."""
    from rewriter.runtime.chat import render, split_tokenizer
    tok, text = split_tokenizer(tokenizer)
    if text.chat_template is None:
        raise ValueError(f"{who}: self-asked questions need a chat template; this "
                         "tokenizer has none")
    mark = "\u2063QUESTION\u2063"  # where the user's message goes
    rendered = render(text, [{"role": "user", "content": mark}], add_generation_prompt=False)
    if rendered.count(mark) != 1:
        raise ValueError(f"{who}: the chat template does not show the user's message "
                         "once: cannot ask the model for one")
    prefix = tok.encode(rendered[:rendered.index(mark)], add_special_tokens=False).ids
    if not prefix:
        raise ValueError(f"{who}: the chat template has no text before the user's "
                         "message: nothing to ask the model with")
    if not eos_ids(model, tokenizer):
        raise ValueError(f"{who}: self-asked questions need an end-of-sequence token "
                         "(where a question ends); the model's config names none")
    return prefix


def _saved_questions(model, tokenizer, n: int, seed: int, progress: bool, path: Path,
                     key: str) -> tuple[list, float]:
    """``self_asked``'s prompts, sampled once and kept in ``path`` (under ``key``): an
    interrupted run answers the same questions; and the seconds an earlier run spent
    asking them (0 when this run asks)."""
    saved, seconds = _partial_rows(path, key)
    if len(saved) == n:
        return saved, seconds
    began = time.perf_counter()
    prompts = self_asked(model, tokenizer, n, seed, progress)
    _save_rows(path, prompts, key, time.perf_counter() - began)
    return prompts, 0.0


def self_asked(model, tokenizer, n: int, seed: int, progress: bool = False,
               batch: int = QUESTION_BATCH, deadline: Optional[float] = None,
               who: str = "train_heads") -> list[list[int]]:
    """``n`` chat prompts whose user message the model wrote itself (Magpie): sampled
    (temperature 1, top-k 50, top-p 0.95, seeded, ``batch`` at a time) after the chat
    template's text up to a user message (``question_prefix``), kept when it ends its turn
    within ``QUESTION_TOKENS`` tokens and is new. The questions depend on the seed and
    ``batch`` (a GPU samples more at once). ``deadline`` (``time.perf_counter()``): stop
    after the batch that passes it, with fewer than ``n``."""
    if type(batch) is not int or batch < 1:
        raise ValueError(f"{who}: the question batch must be an int >= 1, got {batch!r}")
    from rewriter.runtime.chat import chat_prompt, split_tokenizer
    tok, text = split_tokenizer(tokenizer)
    prefix = question_prefix(model, tokenizer, who)
    eos = eos_ids(model, tokenizer)
    engine = _engine(model)
    seen, out, tries = set(), [], 0
    bar = _bar(progress, n, "self-asked questions", "question")
    while len(out) < n and (deadline is None or time.perf_counter() < deadline):
        if tries >= 4 * n:  # a model that never ends its turn, or repeats itself
            raise ValueError(f"train_heads: the model asked {len(out)} distinct questions of "
                             f"at most {QUESTION_TOKENS} tokens in {tries} tries; {n} asked")
        made = engine.generate([prefix] * batch, max_new_tokens=QUESTION_TOKENS,
                               do_sample=True, temperature=1.0, top_k=50, top_p=0.95,
                               seed=seed * 1_000_003 + tries, eos_token_id=sorted(eos))
        tries += batch
        for row in made[:, len(prefix):].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            q = tok.decode(row[:ends[0]], skip_special_tokens=True).strip() if ends else ""
            if q and q not in seen and len(out) < n:
                seen.add(q)
                out.append(chat_prompt(tok, text, q))
                bar.update(1)
    bar.close()
    return out


def corpus_rows(tokenizer, split: str, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` chunks of ``length`` consecutive tokens of the corpus split's source files (the
    ``data="corpus"`` rows: teacher-forced, no generation)."""
    from rewriter.runtime.chat import split_tokenizer
    tok, _ = split_tokenizer(tokenizer)
    rng = random.Random(f"{seed}-{split}-rows")
    docs = load_corpus(split)
    rng.shuffle(docs)
    chunks: dict[int, list] = {}  # a file's rows, tokenized once
    cap = -(-n // 64)  # rows per file: at least 64 files, while the corpus has them
    while True:
        rows = []
        for i, (_, source) in enumerate(docs):
            if i not in chunks:
                ids = tok.encode(source).ids
                chunks[i] = [ids[j:j + length] for j in range(0, len(ids) - length + 1, length)]
            every = chunks[i]
            step = max(1, len(every) // cap)
            rows += every[::step][:cap]  # spread over the file
            if len(rows) >= n:
                break
        every_row = len(chunks) == len(docs) and all(len(c) <= cap for c in chunks.values())
        if len(rows) >= n or every_row:  # enough, or the whole corpus is in
            break
        cap *= 2
    if len(rows) < n:  # never fewer rows than asked
        raise ValueError(f"train_heads: the {split} corpus gives {len(rows)} rows of {length} "
                         f"tokens; {n} asked: ask for fewer prompts or shorter rows")
    rng.shuffle(rows)
    return rows[:n]


def _questions(rel: str, source: str) -> list[str]:
    """Chat questions from the functions a file defines with a docstring."""
    import ast
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    module = rel.removesuffix(".py").replace("/", ".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
            if 10 < len(doc) < 160:
                out.append(f"Write a Python function `{node.name}`: {doc}" if len(out) % 2 else
                           f"What does `{module}.{node.name}` do? Its docstring says: {doc}")
    return out


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
    engine = _engine(model)
    width = max(map(len, prompts))
    rows, before = _partial_rows(partial, key) if partial is not None else ([], 0.0)
    # saved rows count only where they continue these prompts (sampled prompts made again
    # by other code would differ): the rest is generated again
    same = 0
    while (same < min(len(rows), len(prompts)) and len(rows[same]) == len(prompts[same]) + new_tokens
           and rows[same][:len(prompts[same])] == list(prompts[same])):
        same += 1
    rows = rows[:same]
    bar = _bar(progress, len(prompts), f"generate ({split})", "prompt")
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
            _save_rows(partial, rows, key, before + time.perf_counter() - began)
    bar.close()
    # right-pad to one width: position t of a row is its t-th token (no left padding)
    length = width + new_tokens
    tokens = torch.zeros(len(rows), length, dtype=torch.int64)
    for r, row in enumerate(rows):
        tokens[r, :len(row)] = torch.tensor(row)
    start = torch.tensor([len(p) for p in prompts[:len(rows)]])  # first generated position
    return tokens, start, before


def _save_rows(path: Path, rows: list, key: str, seconds: float) -> None:
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    tensor_files.save(path, {"flat": flat, "lengths": lengths},
                      {"settings": key, "seconds": f"{seconds:.3f}"})


def _partial_rows(path: Path, key: str) -> tuple[list, float]:
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
    bar = _bar(progress, len(tokens), f"hidden states ({split})", "row")
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


# ---------------------------------------------------------------------------- training
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


def _train(data: dict, lm_head: Tensor, embed: Optional[Tensor], num_heads: int, epochs: int,
           lr: float, batch: int, seed: int, work: Path, settings: dict, progress: bool,
           loss_kind: str = "tokens", init: Optional[heads_file.Heads] = None, blocks: int = 1):
    device = lm_head.device
    hidden_size = lm_head.shape[1]
    pairs = _samples(data, num_heads)
    targets = head_targets(data, pairs, num_heads)
    path = path_tokens(data, pairs, num_heads) if embed is not None else None
    teacher_at = _teacher_positions(pairs, num_heads) if loss_kind == "teacher" else None
    if embed is None:
        w = torch.zeros(num_heads, hidden_size, hidden_size, device=device, requires_grad=True)
        params = [w]
    else:
        w = [torch.zeros(hidden_size, hidden_size * (k + 2), device=device, requires_grad=True)
             for k in range(num_heads)]
        params = list(w)
    b = torch.zeros(num_heads, hidden_size, device=device, requires_grad=True)
    params.append(b)
    deep = None
    if blocks > 1:  # [B - 1, K, H, H], [B - 1, K, H]: zero, each block the identity at first
        deep = (torch.zeros(blocks - 1, num_heads, hidden_size, hidden_size, device=device,
                            requires_grad=True),
                torch.zeros(blocks - 1, num_heads, hidden_size, device=device, requires_grad=True))
        params += list(deep)
    if init is not None:  # float32 master weights from the (bfloat16) file
        with torch.no_grad():
            for p, t in zip(params, (init.w if embed is not None else [init.w]) + [init.b]):
                p.copy_(t.to(device, torch.float32))
            if init.deep is not None:  # the start's blocks; those it lacks stay zero
                for p, t in zip(deep, init.deep):
                    p[:t.shape[0]] = t.to(device, torch.float32)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(pairs) / batch)
    total = steps_per_epoch * epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    ckpt = work / "checkpoint.safetensors"
    key = json.dumps({**settings, "num_heads": num_heads, "epochs": epochs, "lr": lr,
                      "batch": batch, "arch": "medusa" if embed is None else "hydra",
                      "samples": 2, **({"loss": loss_kind} if loss_kind != "tokens" else {}),
                      **({"blocks": blocks} if blocks > 1 else {})},
                     sort_keys=True)  # samples 2: rows end at their text's end
    step, seconds, resumed_loss = 0, 0.0, float("nan")
    saved = tensor_files.load(ckpt, "the training checkpoint", lambda m: m.get("settings") == key)
    why = _checkpoint_problem(*saved, params, total) if saved is not None else None
    if why is not None:  # from this run's settings, but not whole: train from the start
        tensor_files.discard(ckpt, "the training checkpoint", why)
    elif saved is not None:
        state, meta = saved
        with torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(state[f"p{i}"])
        opt_state = opt.state_dict()
        opt_state["state"] = {i: {"step": state[f"step{i}"], "exp_avg": state[f"m{i}"].to(device),
                                  "exp_avg_sq": state[f"v{i}"].to(device)}
                              for i in range(len(params))}
        opt.load_state_dict(opt_state)
        step, seconds = int(meta["step"]), float(meta["seconds"])
        resumed_loss = float(meta.get("loss", "nan"))
        with warnings.catch_warnings():  # replaying the schedule, not skipping a step
            warnings.simplefilter("ignore")
            for _ in range(step):
                sched.step()
    weight = torch.tensor([DECAY ** k for k in range(num_heads)], device=device)
    head = lm_head.to(torch.bfloat16) if device.type == "cpu" else lm_head
    bar = _bar(progress, total, "train heads", "step")
    bar.update(step)
    began = time.perf_counter()
    last_loss = resumed_loss  # a run resumed at its end trains no step
    order_epoch, order = None, None
    while step < total:
        epoch, at = divmod(step, steps_per_epoch)
        if epoch != order_epoch:  # one permutation an epoch, seeded: a resumed run draws the same
            order_epoch = epoch
            order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        idx = order[at * batch:(at + 1) * batch]
        p = pairs[idx]
        h = data["hidden"][p[:, 0], p[:, 1]].to(device).float()  # [b, H]
        y = targets[idx].to(device)  # [b, K]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            r = heads_forward(h, w, b, embed, path[idx].to(device) if path is not None else None,
                              deep)  # [b, K, H]
            logits = r @ head.t().to(r.dtype) if device.type != "cpu" else r.to(torch.bfloat16) @ head.t()
        valid = (y != -100).float()
        if teacher_at is None:
            ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(),
                                                   ignore_index=-100, reduction="none").view_as(y)
        else:
            # the model's LM head in its own dtype: a float32 model's teacher is not rounded
            probs = _teacher(data["hidden"], p[:, :1], teacher_at[idx], lm_head, device)  # [b, K, V]
            ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), probs.flatten(0, 1),
                                                   reduction="none").view_as(y)
        loss = heads_loss(ce, valid, weight)
        optimizer_step(opt, sched, loss)
        step += 1
        last_loss = float(loss.detach())
        bar.update(1)
        bar.set_postfix(loss=f"{last_loss:.3f}")
        if step % CHECKPOINT_EVERY == 0 or step == total:
            _checkpoint(ckpt, params, opt, step, seconds + time.perf_counter() - began, key, last_loss)
    bar.close()
    seconds += time.perf_counter() - began
    w = w.detach() if embed is None else [t.detach() for t in w]
    deep = tuple(t.detach() for t in deep) if deep is not None else None
    return w, b.detach(), deep, {"steps": total, "epochs": epochs, "positions": len(pairs),
                                    "seconds_training": round(seconds, 1), "final_loss": round(last_loss, 4),
                                    "seed": seed, "lr": lr, "batch": batch}


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


def produced(data: dict, vocab: int) -> Tensor:
    """``[V]`` how often the model produced each token (its continuations only): the
    draft vocabulary keeps the most frequent (VocabTrim). Corpus rows: its greedy token
    after every position."""
    if "next" in data:
        return torch.bincount(data["next"].flatten(), minlength=vocab)[:vocab]
    tokens, start, end = data["tokens"], data["start"], data["end"]
    made = torch.cat([row[int(s):int(e)] for row, s, e in zip(tokens, start, end)])
    return torch.bincount(made, minlength=vocab)[:vocab]


# ---------------------------------------------------------------------------- evaluation
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


def _bar(enabled: bool, total: int, desc: str, unit: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)
