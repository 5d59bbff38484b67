"""``rewriter train-eagle``'s settings and the checks that need no model: every number,
seed and path is refused (a ``ValueError`` naming it) before the model loads, so a bad
flag costs no minute of a lent GPU.

The output folder ``out`` receives ``eagle.safetensors`` (the draft file) and
``train_eagle.json`` (what was made and measured); ``data`` keeps each run's rows
(``eagle_data``). Files already there must be ones the command wrote: anything else would
be overwritten.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rewriter.drafts import eagle_file

from rewriter.files import safe_files
from rewriter.values import is_int, path_problem

DTYPES = ("float32", "bfloat16")
SEEDS = 2 ** 32  # as train-heads' seeds
DRAFT = "eagle.safetensors"  # in ``out``
REPORT = "train_eagle.json"  # in ``out``
# counts that must be at least 1 (a run of none of them has nothing to train or measure)
COUNTS = ("questions", "question_batch", "code_prompts", "generate_batch", "hidden_chunk",
          "chat_heldout", "steps", "rows", "positions", "depth", "new_tokens")


@dataclass
class EagleSettings:
    """One run: the CLI's flags by name (``--new-tokens``: ``new_tokens``; ``HELP``)."""
    out: str
    dtype: str = "float32"
    seconds: float = 500.0
    ask: float = 0.2
    answer: float = 0.5
    reserve: float = 30.0
    questions: int = 65536
    question_batch: int = 512
    code_prompts: int = 4096
    new_tokens: int = 96
    generate_batch: int = 256
    hidden_chunk: int = 64
    chat_heldout: int = 256
    steps: int = 1_000_000
    rows: int = 32
    positions: int = 1024
    depth: int = 4
    train_vocab: int = 0
    lr: float = 5e-4
    seed: int = 11
    init: Optional[str] = None
    data: Optional[str] = None
    save_dtype: str = "float32"
    steps_done: int = 0  # set by the training


# what each setting means (the CLI's help)
HELP = {
    "out": "folder for eagle.safetensors (the draft file) and train_eagle.json (the report)",
    "dtype": "the model's while it writes the data",
    "seconds": "the whole run's budget",
    "ask": "deadline of the questions (a fraction of --seconds)",
    "answer": "deadline of the answers (a fraction of --seconds)",
    "reserve": "seconds kept after training for the held-out accuracy and the file",
    "questions": "chat questions the model asks itself, at most",
    "question_batch": "questions sampled at once",
    "code_prompts": "code prompts answered beside the questions",
    "new_tokens": "greedy tokens an answer",
    "generate_batch": "prompts answered at once",
    "hidden_chunk": "rows a hidden-state forward",
    "chat_heldout": "the last chat rows, held out to measure top-1",
    "steps": "at most (the time ends it first)",
    "rows": "whole rows the layer runs over a step",
    "positions": "chain starts trained on a step",
    "depth": "draft steps unrolled",
    "train_vocab": "train (and measure top-1) on the N most produced tokens alone, the "
                   "vocabulary EagleDraft(draft_vocab=N) drafts from: a fraction of the LM "
                   "head's cost a step (0: the whole vocabulary)",
    "lr": "the learning rate",
    "seed": "the questions' and the training's (with --init: none of the file's)",
    "init": "a draft file (or 'smollm2', the shipped one) the layer starts from",
    "data": "a folder that keeps each run's rows; earlier runs' rows there are trained on too",
    "save_dtype": "the draft file's parameters (the shipped one: bfloat16, half the bytes)",
}


def check_settings(s: EagleSettings) -> None:
    """A ``ValueError`` naming the first setting no run can use."""
    for name in COUNTS:
        v = getattr(s, name)
        if not is_int(v) or v < 1:
            raise ValueError(f"train_eagle: {name} must be an int >= 1, got {v!r}")
    if not is_int(s.seed) or not 0 <= s.seed < SEEDS:
        raise ValueError(f"train_eagle: seed must be an int in [0, 2**32), got {s.seed!r}")
    if not is_int(s.train_vocab) or s.train_vocab < 0 or 0 < s.train_vocab < 10:
        raise ValueError(f"train_eagle: train_vocab must be 0 (the whole vocabulary) or an int "
                         f">= 10, as draft_vocab; got {s.train_vocab!r}")
    if s.new_tokens < s.depth + 2:
        raise ValueError(f"train_eagle: new_tokens must be at least depth + 2 = {s.depth + 2}, "
                         f"got {s.new_tokens}")
    _check_numbers(s)
    for name in ("dtype", "save_dtype"):
        if getattr(s, name) not in DTYPES:
            raise ValueError(f"train_eagle: {name} must be one of {DTYPES}, got {getattr(s, name)!r}")


def _check_numbers(s: EagleSettings) -> None:
    """The budget's fractions and seconds, and the learning rate: finite, in range."""
    numbers = {n: getattr(s, n) for n in ("seconds", "ask", "answer", "reserve", "lr")}
    for name, v in numbers.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"train_eagle: {name} must be a finite number, got {v!r}")
    if not 0 < s.ask < s.answer < 1:
        raise ValueError(f"train_eagle: need 0 < ask < answer < 1 (fractions of seconds), got "
                         f"ask {s.ask} and answer {s.answer}")
    if not (s.seconds > 0 and s.reserve >= 0 and s.lr > 0):
        raise ValueError(f"train_eagle: seconds and lr must be > 0 and reserve >= 0, got "
                         f"seconds {s.seconds}, lr {s.lr}, reserve {s.reserve}")
    if s.reserve >= s.seconds:
        raise ValueError(f"train_eagle: reserve ({s.reserve} s) leaves no time to train within "
                         f"seconds ({s.seconds}): give more --seconds or a smaller --reserve")


def check_paths(s: EagleSettings) -> None:
    """``out``, ``data`` and ``init`` usable: folders that are folders (or can be made),
    files in ``out`` that are this command's, an ``init`` file that exists."""
    for name in ("out", "data"):
        folder = getattr(s, name)
        if folder is None and name == "data":
            continue
        if path_problem(folder) is not None:
            raise ValueError(f"train_eagle: {name} must name a folder, got {folder!r}")
        if Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"train_eagle: {name} {folder} exists and is not a folder")
        safe_files.check_parent(f"train_eagle: {name}", folder, make_parents=True)
    safe_files.check_new_file(Path(s.out) / DRAFT, "train_eagle: out", "draft file", is_draft_file,
                              make_parents=True)
    safe_files.check_new_file(Path(s.out) / REPORT, "train_eagle: out", "training report",
                              is_report, make_parents=True)
    if s.init is not None:
        if path_problem(s.init) is not None:
            raise ValueError(f"train_eagle: init must be a draft file's path or a shipped name "
                             f"{eagle_file.SHIPPED}, got {s.init!r}")
        if not eagle_file.resolve(s.init).is_file():
            raise ValueError(f"train_eagle: init {s.init}: no such draft file")


def is_draft_file(path: Path) -> bool:
    """A file this command may replace: an EAGLE draft file (by its format tag)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("format") == eagle_file.FORMAT
    except Exception:  # not safetensors at all
        return False


def is_report(path: Path) -> bool:
    """A file this command may replace: an earlier run's report."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and "args" in report and "seconds" in report
