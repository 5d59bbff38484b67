"""``rewriter train-eagle``: an EAGLE draft layer made in one timed run, chat data the model
writes for itself, then the layer trained on it, each phase within its share of
``seconds`` (a GPU is often lent for minutes).

    from rewriter.training.train_eagle import train_eagle
    from rewriter.training.train_eagle_settings import EagleSettings
    train_eagle(model, tokenizer, EagleSettings(out="D", seconds=470), device="cuda")

Phases, each ending at its deadline (a fraction of ``seconds`` from the start):

1. ``ask``: the model asks itself chat questions (``prompts.self_asked``, Magpie),
   ``question_batch`` at a time, up to ``questions``;
2. ``answer``: it answers them greedily (``new_tokens``), together with ``code_prompts``
   code prompts (``prompts.make_prompts``: code chunks and chat questions about them)
   and 48 held-out ones;
3. its last hidden states over every row (the features the layer reads);
4. the layer (``eagle_layer.DraftLayer``, from random, or from the draft file ``init``: a
   later run goes on from an earlier one's layer on new questions) trained until
   ``seconds`` less ``reserve``, checkpointed to ``out/eagle.safetensors`` every 100 steps;
5. held-out top-1 of each draft step: the last ``chat_heldout`` chat rows and the held-out
   code prompts (with ``init``, the file's too, before training: what the run added).

``train_vocab N`` trains on the ``N`` tokens ``EagleDraft(draft_vocab=N)`` drafts from
(``heads.draft_vocab`` of the run's counts, the file's included): the loss is the
cross-entropy over the LM head's rows for them, a target outside them is no target, and
top-1 (``init``'s too) is measured as the runtime drafts, a target outside them a miss.

``out/eagle.safetensors`` is the draft file ``EagleDraft(weights=...)`` reads (with the
tokens' counts for ``draft_vocab``), ``out/train_eagle.json`` what was made and measured.

Without ``data`` nothing is cached: the data lives for the run. With ``data`` (a folder,
``eagle_data``) the run keeps its answered rows there and trains on every earlier run's
rows in it as well. Earlier runs' held-out code prompts, and their rows that ask one of
this run's held-out chat questions again, are left out. The draft file records the seeds
whose rows it trained on, and a later ``init`` of it refuses them as it refuses its own.
A run whose seed already has rows there was cut short: it takes them instead of asking
and answering again, and goes on from its own checkpoint (``init out/eagle.safetensors``,
made by a run of that seed). Token counts already in ``init`` are counted again (they
only rank the draft vocabulary; a resumed run keeps its checkpoint's, so its
``train_vocab`` stays the one it began with).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from rewriter.training import eagle_data

from rewriter.drafts import eagle_file
from rewriter.drafts.heads import draft_vocab

from rewriter.files import safe_files
from rewriter.training.eagle_layer import DraftLayer, produced_counts
from rewriter.measure.machine import machine
from rewriter.training.prompts import question_prefix
from rewriter.training.train_eagle_checks import counts_of, enough_rows, rows_of, start_of
from rewriter.training.train_eagle_data import PROMPT_TOKENS, own_rows, training_sets
from rewriter.training.train_eagle_settings import DRAFT, REPORT, EagleSettings, check_paths, check_settings
from rewriter.values import within_context


class Phases:
    """The run's clock: each phase's deadline, and the seconds each phase took."""

    def __init__(self, seconds: float):
        self.began, self.total, self.seconds = time.perf_counter(), seconds, {}

    def at(self, fraction: float) -> float:
        """The deadline ``fraction`` of the budget after the start (``time.perf_counter``)."""
        return self.began + fraction * self.total

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def done(self, name: str) -> None:
        """Phase ``name`` ended now: its seconds, since the last phase ended."""
        self.seconds[name] = round(self.elapsed() - sum(self.seconds.values()), 1)


def train_eagle(model, tokenizer, s: EagleSettings, device="cpu") -> dict:
    """Make ``s.out/eagle.safetensors`` for ``model`` (a Hugging Face Llama-style model with
    its ``tokenizer``) on ``device``; returns the report written beside it."""
    check_settings(s)
    check_paths(s)
    within_context("train_eagle", getattr(model.config, "max_position_embeddings", None) or 2048,
                   prompt_tokens=PROMPT_TOKENS, new_tokens=s.new_tokens)
    phases = Phases(s.seconds)
    device = torch.device(device)
    model = model.to(device).eval()
    lm = model.lm_head.weight.detach().cpu()
    earlier, resumed = rows_of(s, lm)  # refused now, not minutes later
    init = start_of(s, model, resuming=resumed is not None)
    if resumed is None:
        question_prefix(model, tokenizer, "train_eagle")  # a chat template to ask with
    report = {"args": {k: v for k, v in asdict(s).items() if k != "steps_done"},
              "cpu": machine(), "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "seconds": phases.seconds}
    phases.done("load")
    rows, questions = own_rows(model, tokenizer, s, phases, resumed)
    if resumed is None:
        enough_rows(rows[2], s, "give more --seconds")  # a resumed run would stop here again
        if s.data:
            eagle_data.save(s.data, eagle_data.Rows(*rows, s.seed, s.new_tokens, s.chat_heldout), lm)
    train, heldout, parts, report["data"] = training_sets(model, tokenizer, s, rows, earlier)
    report["data"]["questions"] = questions
    phases.done("hidden")
    print(report["data"], flush=True)
    draft, counts = _layer(model, s, init, produced_counts(parts, lm.shape[0]), resumed, report)
    del parts  # their hidden states: the training set has them
    if init is not None:  # where it started, on the same held-out rows: what training adds
        report["heldout_top1_init"] = {k: draft.accuracy(v) for k, v in heldout.items()}
        print(f"init's held-out top-1: {report['heldout_top1_init']}", flush=True)
    with safe_files.new_dirs(Path(s.out)):
        _train_and_save(draft, counts, train, heldout, s, init, earlier, phases, report, lm)
    return report


def _layer(model, s: EagleSettings, init, own_counts, resumed, report: dict) -> tuple:
    """``(the layer to train, the token counts its file keeps)``: from random (seeded) or
    ``init``, trimmed to ``s.train_vocab`` tokens if asked."""
    torch.manual_seed(s.seed)
    draft = DraftLayer(model, "random", s.depth, model.lm_head.weight.device)
    counts = counts_of(own_counts, init, resumed is not None)
    if init is not None:
        draft.start_from(init)
    if s.train_vocab:  # the runtime's EagleDraft(draft_vocab=N) takes the same N tokens
        kept = draft_vocab(counts, s.train_vocab)
        draft.trim(kept)
        report["train_vocab"] = {"tokens": len(kept), "covers": round(
            float(counts[kept].sum()) / max(1, float(counts.sum())), 4)}
        print(f"trained and measured on the {len(kept)} most produced tokens: "
              f"{report['train_vocab']['covers']:.1%} of the tokens counted", flush=True)
    return draft, counts


def _train_and_save(draft: DraftLayer, counts, train: dict, heldout: dict, s: EagleSettings,
                    init, earlier: list, phases: Phases, report: dict, lm) -> None:
    """Train until the budget less ``s.reserve`` is spent (checkpoints every 100 steps),
    measure held-out top-1, write the draft file and the report."""
    out = Path(s.out)
    positions = int((train["end"] - train["start"]).sum())

    def save(step: int, accuracy: list) -> None:
        trained = {"steps": step, "seconds": round(phases.elapsed(), 1), "rows": len(train["tokens"]),
                   "positions": positions, "lr": s.lr, "seed": s.seed, "depth": s.depth,
                   "batch_rows": s.rows, "batch_positions": s.positions,
                   **({"train_vocab": s.train_vocab} if s.train_vocab else {}),
                   "device": report["device_name"], "stored": s.save_dtype,
                   "data_seeds": [e.seed for e in earlier],
                   **({"init": {"file": s.init, **init.trained}} if init else {}),
                   "accuracy_on": "held-out self-asked chat rows" + (
                       f", within the {s.train_vocab} most produced tokens" if s.train_vocab else "")}
        eagle_file.made({n: t.detach().cpu() for n, t in draft.p.items()}, draft.shape, lm,
                        accuracy=accuracy, counts=counts, trained=trained
                        ).save(out / DRAFT, dtype=getattr(torch, s.save_dtype))

    def checkpoint(step: int) -> None:  # the last good one stays where a run diverges
        try:
            save(step, [])
        except eagle_file.DraftFileError as e:
            print(f"step {step}: no checkpoint: {e}", flush=True)
    phases.done("prepare")
    budget = phases.at(1.0) - s.reserve - time.perf_counter()
    if budget <= 0:
        raise ValueError(f"train_eagle: no time left to train ({budget:.0f} s): give more --seconds")
    loss = draft.train(train, s, seconds=budget, checkpoint=checkpoint)
    phases.done("train")
    accuracy = {k: draft.accuracy(v) for k, v in heldout.items()}
    phases.done("accuracy")
    save(s.steps_done, accuracy["chat"])
    report.update(steps=s.steps_done, final_loss=round(loss, 4), heldout_top1=accuracy)
    safe_files.replace_path(out / REPORT, json.dumps(report, indent=1).encode())
    print(json.dumps({k: report[k] for k in ("seconds", "data", "steps", "final_loss",
                                             "heldout_top1", "device_name")}), flush=True)
