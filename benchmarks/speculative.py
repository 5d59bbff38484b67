"""Self-speculative decoding and draft heads against our own plain decode, in the same run.

    python benchmarks/speculative.py [--model smollm2|default] [--dtype float32 bfloat16]
                                     [--batch 1 4] [--new 64] [--samples 8] [--max-draft 4] [--budget 24]
                                     [--strategies self medusa hydra lookup eagle] [--heads PATH] [--draft-vocab 4096]
                                     [--eagle DRAFT.safetensors] [--eagle-nodes 8 16]
                                     [--max-nodes 32] [--tree-nodes N] [--dynamic E] [--lookup L]
                                     [--chat eval|wide] [--draft-weights dense|int4]
                                     [--device cpu|cuda] [--backend torch|triton]
                                     [--json benchmarks/results/speculative.json]

On ``--device cuda`` plain decode replays its step as a CUDA graph, and the speculative
strategies replay every fixed-shape call of their rounds (``runtime/replay.py``; the Triton
backend's capture still fails, and its steps then run eagerly); plain decode without the
graph is timed too (a second baseline).

Draft heads (``MedusaHeads``, ``HydraHeads``: the model's shipped heads unless ``--heads``): each
head's held-out top-1 / top-5 accuracy and the training it took (from the heads file),
the tree chosen (``tree="auto"``: measured verify cost and accuracies) and its predicted
tokens per round, then tokens/s against plain decode, mean accepted length (tokens per
round per row: accepted drafts + the model's own) and whether the tokens equal plain
greedy decoding's, with the full vocabulary projection and with the trimmed one. "n of N":
the auto tree's N nodes, or the n of its sub-tree at that batch (``batch_trees``; none:
plain decoding), verified as they are, then adaptively ("adaptive: x": the mean nodes a
round verified when the runtime re-chooses the sub-tree from the heads' accuracies on
these prompts, ``runtime.decoding.tree.adapt``), and with ``--dynamic E`` re-grown every round
from the heads' probabilities ("dynamic: E", ``runtime.decoding.tree.dynamic``), and with ``--lookup L``
with a chain of up to L tokens copied from the row's own text ("lookup: L",
``runtime.decoding.tree.lookup``), in the same run.

Prompt lookup (``--strategies lookup``: ``PromptLookup(tokens=L)``, L from ``--lookup`` or 4):
drafts copied from the row's own text and nothing else, with the rounds choosing how many
copies pay (``adapt``), always the whole chain, and "guarded": as a user gets it, each
generation running the rounds or plain steps, whichever were timed faster on this machine
(``runtime/speed_guard.py``; every other engine here always runs its rounds), against plain
decode in the same run.

For each dtype: the verify cost curve (the decode program over S tokens against one, batch
1 and the largest batch), then for each skip set — LayerSkip's evenly spread one
(``speedup=1.25``) and the one ``SelfSpeculative(calibrate=...)`` finds (its search time
reported) — tokens/s against plain decode, mean accepted drafts per round, full-model and
draft passes per token, the cost model's prediction, whether the tokens equal plain
greedy decoding's (with ``--draft-weights int4``: ``SelfSpeculative(draft_weights="int4")``,
no skip set, instead of both), and "guarded": the speed-up as a user gets it, the speed guard running
plain steps where those were timed faster (and how many timed generations did). Prompts: chat questions through the model's template (SmolLM2) and
held-out code chunks; greedy, no early stop (draft heads on chat: stopping at the end of
the answer, tokens/s counting the answer's tokens); medians of 3 runs after a warm-up.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from collections import Counter

import torch
from tabulate import tabulate

import rewriter
from rewriter.models.checkpoints import cast
from rewriter.decoding import strategy_of
from rewriter.measure.calibrate import predicted_speedup
from rewriter.runtime.measurer import RuntimeMeasurer
from rewriter.models.corpus import load_corpus
from rewriter.api.eval import CHAT_PROMPTS
from rewriter.passes import EagleDraft, HydraHeads, MedusaHeads, PromptLookup, SelfSpeculative
from rewriter.passes.eagle_draft import MAX_DEPTH
from rewriter.passes.layer_skip import kept_positions
from rewriter.runtime import packed_linear
from rewriter.runtime.chat import chat_prompt
from rewriter.maths.sdpa import kernel_only, path_taken
from rewriter.drafts.tree import MAX_NODES, Tree, choose_tree, expected_tokens

from common import describe, load, sync, write_json

# ``--chat wide``: the eval's 8 questions, then 24 more of the kinds people ask a small
# assistant (explain, list, compare, write), whose answers run longer than one fact.
# Written for this benchmark; none is in the heads' training data (SmolLM2 asks its own).
WIDE_CHAT = CHAT_PROMPTS + (
    "Why is the sky blue?",
    "Explain how a bicycle stays upright while moving.",
    "What are the main differences between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "Describe the water cycle in a few sentences.",
    "What is photosynthesis?",
    "Write a short poem about the sea.",
    "How do I make a cup of tea?",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.",
    "What is the difference between weather and climate?",
    "List four healthy breakfast ideas.",
    "How does a refrigerator keep food cold?",
    "Write a polite email asking a colleague for a meeting next week.",
    "What is machine learning, in simple terms?",
    "Why do we need to drink water?",
    "Explain what a prime number is and give two examples.",
    "What should I pack for a weekend camping trip?",
    "How can I improve my writing skills?",
    "What is the role of the heart in the human body?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the benefits of regular exercise?",
    "Explain the difference between a virus and a bacterium.",
    "How do airplanes fly?",
)

RUNS = 3  # timed runs of every prompt set, after a warm-up


def code_prompts(tok, n: int, length: int) -> list[list[int]]:
    """``n`` consecutive chunks of ``length`` tokens from the first held-out files (the
    calibration's prompts)."""
    ids: list[int] = []
    for _, text in load_corpus("heldout"):
        ids += tok.encode(text).ids
        if len(ids) >= (n + 2) * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def spread_code_prompts(tok, n: int, length: int) -> list[list[int]]:
    """``n`` chunks of ``length`` tokens, one per held-out file in turn (files of at least
    twice that), each pass over the files at another point of them (the first at their
    middle; with more prompts than files, a short file's chunks may overlap): consecutive
    chunks of the first files were mostly one file's text, so what the heads guessed
    there said more about that file than about code."""
    files = [ids for _, text in load_corpus("heldout")
             if len(ids := tok.encode(text).ids) >= 2 * length]
    if not files:
        raise SystemExit(f"no held-out file has {2 * length} tokens for a code prompt")
    passes = -(-n // len(files))
    out = []
    for i in range(n):
        ids, j = files[i % len(files)], i // len(files)  # j-th pass: at (j + 1) / (passes + 1)
        at = (len(ids) - length) * (j + 1) // (passes + 1)
        out.append(ids[at:at + length])
    return out


def timed(engine, batches, new: int, runs: int = RUNS, eos: bool = False):
    """(tokens of each batch, tokens/s, stats) over ``batches`` (lists of prompts, generated
    one after another; a run is all of them). With ``eos`` generation stops at the model's
    end of sequence, as a chat answer does (text after it is not what anyone decodes, and
    drafts of it flatter the heads), and tokens/s counts the tokens up to it."""
    return timed_together([(engine, contextlib.nullcontext)], batches, new, runs, eos)[0]


def timed_together(variants, batches, new: int, runs: int = RUNS, eos: bool = False) -> list:
    """``timed`` for several ``(engine, setting)`` variants (``setting()``: a context in
    which the engine runs as that variant), their runs interleaved (A, B, A, B, ..) so
    that a drift of the machine's speed hits every variant alike; each run starts with
    the next variant, so none is always timed right after another."""
    stop = {} if eos else {"eos_token_id": []}
    for engine, setting in variants:
        with setting():
            for prompts in batches:  # every batch's shapes, before any is timed
                engine.generate(prompts, max_new_tokens=4, **stop)
    times = [[] for _ in variants]
    outs: list = [None] * len(variants)
    stats = [Counter() for _ in variants]
    for run in range(runs):
        for j in range(len(variants)):
            i = (run + j) % len(variants)
            engine, setting = variants[i]
            with setting():
                engine.stats.clear()
                sync()
                start = time.perf_counter()
                outs[i] = [engine.generate(prompts, max_new_tokens=new, **stop) for prompts in batches]
                sync()
                times[i].append(time.perf_counter() - start)
                stats[i].update(engine.stats)
    got = []
    for (engine, _), out, t, st in zip(variants, outs, times, stats):
        got.append((out, made_tokens(engine, batches, out, eos) / statistics.median(t), dict(st)))
    return got


def made_tokens(engine, batches, outs, eos: bool) -> int:
    """New tokens in ``outs`` (each batch's output ids): every one, or with ``eos`` each
    row's up to and with the model's end of sequence (a chat answer's)."""
    ends = set(rewriter.runtime.settings.GenerationSettings().for_model(engine.config).eos_token_id)
    return sum(next((i + 1 for i, tok in enumerate(row) if eos and tok in ends), len(row))
               for prompts, o in zip(batches, outs)
               for row in o[:, max(map(len, prompts)):].tolist())


def same(outs, refs) -> str:
    """How many batches' tokens equal the reference's, "k/n"."""
    return f"{sum(torch.equal(a, b) for a, b in zip(outs, refs))}/{len(refs)}"


def baseline(plain, prompts, new: int, eos: bool = False):
    """(tokens, plain tok/s, plain tok/s without the CUDA graph or None). On a GPU both
    baselines are kept: the captured one is what a user gets, and the eager one shows what
    the speculative rounds owe to their own replays."""
    ref, rate, _ = timed(plain, prompts, new, eos=eos)
    return ref, rate, eager_baseline(plain, prompts, new, eos)


def eager_baseline(plain, prompts, new: int, eos: bool = False):
    """Plain tok/s without the CUDA graph on a GPU; None elsewhere."""
    if not torch.cuda.is_available() or next(iter(plain.ir.weights().values())).device.type != "cuda":
        return None
    plain.static_decode = False
    try:
        return timed(plain, prompts, new, eos=eos)[1]
    finally:
        plain.static_decode = None


def strategy_engine(model, **kw):
    """``rewriter.optimize(model, **kw)`` whose generations always run the strategy's rounds:
    its own speed, not the speed guard's plain fallback (``runtime/speed_guard.py``)."""
    engine = rewriter.optimize(model, **kw)
    engine.fallback = False
    return engine


class Guarded:
    """A ``strategy_engine`` as a user gets it, with the speed guard on (``setting()``
    for ``timed_together``): the same programs and pass (each ``optimize`` re-times the
    pass's costs: minutes on a GPU), with the guard's timings and the learnt trees and
    chains of its own, as a separately optimized engine has them (the engine records every
    generation's speed, its unguarded ones too, which would tell the guard what it has not
    tried)."""

    def __init__(self, engine):
        self.engine, self.guards, self.trees = engine, {}, {}

    @contextlib.contextmanager
    def __call__(self):
        e = self.engine
        saved = e.guards, e.trees
        e.guards, e.trees, e.fallback = self.guards, self.trees, True
        try:
            yield
        finally:
            e.guards, e.trees, e.fallback = *saved, False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8,
                    help="batches of prompts per kind, generated one after another (accepted "
                         "lengths from a single prompt vary by half a token)")
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--budget", type=int, default=24, help="sub-layers the calibration tries")
    ap.add_argument("--strategies", nargs="+", default=["self", "medusa", "hydra"],
                    choices=["self", "medusa", "hydra", "lookup", "eagle"])
    ap.add_argument("--eagle", default=None,
                    help="an EAGLE draft file (rewriter.drafts.eagle_file), for --strategies eagle")
    ap.add_argument("--eagle-nodes", type=int, nargs="+", default=[8],
                    help="eagle: tokens a round verifies (the root included)")
    ap.add_argument("--eagle-depth", type=int, default=4,
                    help="eagle: the tree's levels (both drafts; the heads have 4)")
    ap.add_argument("--draft-weights", default="dense", choices=["dense", "int4"],
                    help="self: int4 times SelfSpeculative(draft_weights='int4') with no skip "
                         "set instead of the spread and calibrated skip sets (its prediction: "
                         "docs/benchmarks.md, quantized_draft.py)")
    ap.add_argument("--heads", default=None, help="heads file (default: the model's shipped heads; "
                                                   "with one of medusa, hydra; with eagle, 'none' "
                                                   "times the EAGLE draft alone)")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="trimmed draft vocabulary (0: none)")
    ap.add_argument("--max-nodes", type=int, default=32, help="largest tree the choice considers")
    ap.add_argument("--tree-nodes", type=int, default=None,
                    help="a fixed tree of this many nodes, each heads file's best by its own "
                         "accuracies (compares heads at one cost; default: tree='auto')")
    ap.add_argument("--dynamic", type=int, default=0,
                    help="also time the tree re-grown every round, expanding E nodes a level")
    ap.add_argument("--lookup", type=int, default=0,
                    help="also time the tree with a chain of L tokens copied from the text")
    ap.add_argument("--default-only", action="store_true",
                    help="heads (medusa, hydra): time only what the pass gives by default (the "
                         "adaptive tree, with --lookup the chosen chain), and with --draft-vocab "
                         "the trimmed vocabulary only (compares heads files in a third of the time)")
    ap.add_argument("--chat", default="eval", choices=["eval", "wide"],
                    help="chat questions: the eval's 8 (as every figure before 2026-11-25), or "
                         "those and 24 more with longer answers (WIDE_CHAT; with --samples 32 "
                         "at batch 1, each once)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="torch", choices=["torch", "triton"])
    ap.add_argument("--attention-kernel", action="store_true",
                    help="every one-query attention by ATen's SDPA kernel, as before 2026-11-29 "
                         "(rewriter.maths.sdpa: slower in bfloat16 on a CPU; reproduces older figures)")
    ap.add_argument("--json", default="benchmarks/results/speculative.json")
    args = ap.parse_args()
    with kernel_only() if args.attention_kernel else contextlib.nullcontext():
        run(args, ap)


def run(args, ap):
    if args.samples < 1:
        ap.error(f"--samples must be at least 1, got {args.samples}")
    for name, v, top in (("--dynamic", args.dynamic, 16), ("--lookup", args.lookup, 16)):
        if not 0 <= v <= top:
            ap.error(f"{name} must be in [0, {top}], got {v}")
    if ("eagle" in args.strategies) != (args.eagle is not None):
        ap.error("--strategies eagle and --eagle FILE go together")
    if not all(2 <= n < MAX_NODES for n in args.eagle_nodes):
        ap.error(f"--eagle-nodes must be in [2, {MAX_NODES - 1}], got {args.eagle_nodes}")
    if args.heads == "none" and {"medusa", "hydra"} & set(args.strategies):
        ap.error("--heads none times the EAGLE draft alone: not with --strategies medusa or hydra")
    deepest = MAX_DEPTH if args.heads == "none" else 4  # the heads compared have 4
    if not 1 <= args.eagle_depth <= deepest:
        ap.error(f"--eagle-depth must be in [1, {deepest}] (with --heads none: the draft alone), "
                 f"got {args.eagle_depth}")
    if args.tree_nodes is not None and not 1 <= args.tree_nodes < MAX_NODES:
        ap.error(f"--tree-nodes must be in [1, {MAX_NODES - 1}], got {args.tree_nodes}")
    results = {**describe(args.device), "model": args.model, "device": args.device,
               "backend": args.backend, "new_tokens": args.new, "max_draft": args.max_draft, "chat": args.chat,
               "attention_kernel": args.attention_kernel,
               "sdpa_path_bfloat16": path_taken(torch.bfloat16),  # one-query calls: rewriter.maths.sdpa
               # bfloat16 CPU linears on packed weights (runtime.packed_linear)
               "packed_linears_bfloat16": args.device == "cpu" and args.backend == "torch"
               and packed_linear._machine_ok() and packed_linear.pays(),
               "runs": []}
    rows, curves, head_rows, lookup_rows, eagle_table = [], [], [], [], []
    for dtype in args.dtype:
        model, tok = load(args.model)
        model = cast(model, getattr(torch, dtype), args.device)
        plain = rewriter.optimize(model, tokenizer=tok, backend=args.backend)
        tok = plain.tokenizer
        calib = code_prompts(tok, 2, 256)
        measurer = RuntimeMeasurer(args.backend, args.device)  # as optimize() times the passes
        curve = measurer.verify_cost(plain.ir, 9)
        curves.append([dtype, *(f"{c:.2f}" for c in curve[1:])])
        for arch in ("medusa", "hydra"):
            if arch in args.strategies:
                heads_rows(model, tok, plain, args, dtype, results, head_rows, arch)
        if "lookup" in args.strategies:
            prompt_lookup_rows(model, tok, plain, args, dtype, results, lookup_rows)
        if "eagle" in args.strategies:
            eagle_rows(model, tok, plain, args, dtype, results, eagle_table)
        if "self" not in args.strategies:
            continue
        layers = sorted(s["index"] for s in plain.ir.layers)
        spread = [i for p, i in enumerate(layers) if p not in kept_positions(len(layers), 1.25)]
        if args.draft_weights == "int4":
            self_int4_rows(model, tok, plain, args, dtype, results, rows)
            continue
        start = time.perf_counter()
        calibrated = SelfSpeculative(calibrate=calib, budget=args.budget, max_draft=args.max_draft,
                                     threshold=0.0)
        try:
            tuned = strategy_engine(model, passes=[calibrated], tokenizer=tok, backend=args.backend)
        except rewriter.RewriterError as e:
            tuned, note = None, str(e)
        else:
            note = ""
        calib_s = time.perf_counter() - start
        sets = {"spread (LayerSkip 1.25)": dict(skip_layers=spread)}
        if tuned is not None:
            sets["calibrated"] = dict(skip_attention=tuned.ir.info["decoding"]["skip_attention"],
                                      skip_mlp=tuned.ir.info["decoding"]["skip_mlp"])
        for name, skip in sets.items():
            spec = strategy_engine(model, tokenizer=tok, backend=args.backend, passes=[
                SelfSpeculative(**skip, max_draft=args.max_draft, threshold=0.0)])
            pred = predicted_speedup(plain.ir, calib, skip.get("skip_layers", []),
                                     skip.get("skip_attention", []), skip.get("skip_mlp", []),
                                     args.max_draft, measurer)
            for b in args.batch:
                for kind, prompts in prompt_sets(plain, tok, b, args.samples, args.chat).items():
                    ref, base_rate, eager = baseline(plain, prompts, args.new)
                    # and as a user gets it: the speed guard runs plain steps where those
                    # were faster (runs interleaved)
                    (out, rate, st), (_, guarded_rate, gst) = timed_together(
                        [(spec, contextlib.nullcontext), (spec, Guarded(spec))],
                        prompts, args.new)
                    fell_back = f"{gst.get('plain_generations', 0)}/{RUNS * len(prompts)}"
                    run = {"dtype": dtype, "skip_set": name, "skip": skip, "batch": b, "prompts": kind,
                           "plain_tok_s": base_rate, "plain_eager_tok_s": eager,
                           "spec_tok_s": rate, "speedup": rate / base_rate,
                           "accepted_per_round": st["accepted"] / st["row_rounds"],
                           "forward_per_token": st["forward_passes"] / st["tokens"],
                           "draft_per_token": st["draft_passes"] / st["tokens"],
                           "same_tokens": same(out, ref), "samples": len(prompts), "predicted": pred,
                           "calibration_s": calib_s if name == "calibrated" else None,
                           "calibration_note": note, "guarded_tok_s": guarded_rate,
                           "guarded_speedup": guarded_rate / base_rate,
                           "guarded_plain_generations": fell_back}
                    keep_row(results, run, args.json)
                    rows.append([dtype, name, b, kind, f"{base_rate:.1f}",
                                 f"{eager:.1f}" if eager else "-", f"{rate:.1f}",
                                 f"{rate / base_rate:.2f}x", f"{run['accepted_per_round']:.2f}",
                                 f"{run['forward_per_token']:.2f}", f"{pred['agreement']:.2f}",
                                 f"{pred['predicted_speedup']:.2f}x", run["same_tokens"],
                                 f"{guarded_rate / base_rate:.2f}x ({fell_back} plain)"])
        if note:
            print(f"{dtype}: calibration ({calib_s:.0f} s): {note}")
        elif tuned is not None:
            print(f"{dtype}: calibration took {calib_s:.0f} s; chose {sets['calibrated']}")
    print("\nverify cost: the decode program over S tokens / over 1, batch 1, after 64 tokens\n")
    print(tabulate(curves, headers=["dtype", *(f"S={s}" for s in range(1, 10))]))
    print(f"\n{args.model}, {args.new} new tokens, max_draft {args.max_draft}, "
          f"{results['machine']}, {args.backend} backend, {results['threads']} threads, "
          f"{results['date']}\n")
    if head_rows:
        print_heads(args, results, head_rows)
    if eagle_table:
        print(tabulate(eagle_table, headers=["dtype", "draft", "draft vocab", "tree nodes", "batch", "prompts",
                                             "plain tok/s", "tok/s", "speed-up", "accepted length",
                                             "draft calls/round", "same tokens"]))
        print()
    if lookup_rows:
        print(tabulate(lookup_rows, headers=["dtype", "PromptLookup", "batch", "prompts", "plain tok/s",
                                             "tok/s", "speed-up", "accepted length",
                                             "copies verified/round", "plain generations",
                                             "same tokens"]))
        print()
    if rows:
        print(tabulate(rows, headers=["dtype", "skip set", "batch", "prompts", "plain tok/s",
                                      "plain no-graph tok/s",
                                      "speculative tok/s", "speed-up", "accepted/round", "full passes/tok",
                                      "agreement (teacher-forced)", "predicted", "same tokens",
                                      "guarded"]))
    results["verify_cost"] = curves
    write_json(args.json, results)


def self_int4_rows(model, tok, plain, args, dtype, results, rows) -> None:
    """``SelfSpeculative(draft_weights="int4")``, no skip set, against plain decode: the
    same columns as the skip sets' rows (agreement and prediction left out)."""
    spec = strategy_engine(model, tokenizer=tok, backend=args.backend, passes=[
        SelfSpeculative(draft_weights="int4", max_draft=args.max_draft, threshold=0.0)])
    name = "none, 4-bit draft"
    for b in args.batch:
        for kind, prompts in prompt_sets(plain, tok, b, args.samples, args.chat).items():
            ref, base_rate, eager = baseline(plain, prompts, args.new)
            (out, rate, st), (_, guarded_rate, gst) = timed_together(
                [(spec, contextlib.nullcontext), (spec, Guarded(spec))], prompts, args.new)
            fell_back = f"{gst.get('plain_generations', 0)}/{RUNS * len(prompts)}"
            run = {"dtype": dtype, "skip_set": name, "skip": {}, "draft_weights": "int4",
                   "batch": b, "prompts": kind, "plain_tok_s": base_rate,
                   "plain_eager_tok_s": eager, "spec_tok_s": rate, "speedup": rate / base_rate,
                   "accepted_per_round": st["accepted"] / st["row_rounds"],
                   "forward_per_token": st["forward_passes"] / st["tokens"],
                   "draft_per_token": st["draft_passes"] / st["tokens"],
                   "same_tokens": same(out, ref), "samples": len(prompts),
                   "guarded_tok_s": guarded_rate, "guarded_speedup": guarded_rate / base_rate,
                   "guarded_plain_generations": fell_back}
            keep_row(results, run, args.json)
            rows.append([dtype, name, b, kind, f"{base_rate:.1f}", f"{eager:.1f}" if eager else "-",
                         f"{rate:.1f}", f"{rate / base_rate:.2f}x",
                         f"{run['accepted_per_round']:.2f}", f"{run['forward_per_token']:.2f}",
                         "-", "-", run["same_tokens"],
                         f"{guarded_rate / base_rate:.2f}x ({fell_back} plain)"])


def heads_rows(model, tok, plain, args, dtype, results, rows, arch):
    """Draft heads with the full and the trimmed vocabulary projection, every batch and
    prompt set, against plain decode."""
    from rewriter.drafts import heads as heads_file
    weights = args.heads or args.model
    trained = heads_file.load(weights, arch)
    results.setdefault("heads", {})
    results["heads"].setdefault(arch, {"weights": str(heads_file.resolve(weights, arch)),
                                       "top1": [round(a[0], 4) for a in trained.accuracy],
                                       "top5": [round(sum(a[:5]), 4) for a in trained.accuracy],
                                       "training": {k: v for k, v in trained.trained.items()}})
    cls = HydraHeads if arch == "hydra" else MedusaHeads
    given = "auto"
    if args.tree_nodes is not None:  # the same budget for every heads file: its own best-first tree
        given = choose_tree(trained.accuracy, [1.0] * (args.tree_nodes + 2), args.tree_nodes)[0].record()
    vocabs = (None, args.draft_vocab) if args.draft_vocab else (None,)
    for vocab in vocabs[-1:] if args.default_only else vocabs:
        # with --lookup the pass measures the costs of verifying the chain too (the adaptive
        # rounds choose its length by them); each mode below sets the record's own lookup
        p = cls(weights=weights, draft_vocab=vocab, max_nodes=args.max_nodes, tree=given,
                lookup=args.lookup)
        med = strategy_engine(model, tokenizer=tok, passes=[p], backend=args.backend)
        record = med.ir.info["decoding"]
        tree, adapt = record["tree"], record.get("adapt")
        for b in args.batch:
            whole = len(tree)
            sub = strategy_of(med.ir.info).tree_at(b)  # the paths verified at b rows
            nodes = len(sub)
            for kind, prompts in prompt_sets(plain, tok, b, args.samples, args.chat).items():
                # plain decode; the pass's tree (or its sub-tree at b rows) as it is; and
                # re-chosen as the heads' accuracies on these prompts come in
                # (runtime.decoding.tree.adapt): runs interleaved
                modes = [(False, 0, 0)] + ([(True, 0, 0)] if adapt else []) + \
                    ([(False, args.dynamic, 0)] if args.dynamic else []) + \
                    ([(False, 0, args.lookup)] if args.lookup else []) + \
                    ([(True, 0, args.lookup)] if args.lookup and adapt else []) + \
                    ([(False, args.dynamic, args.lookup)] if args.lookup and args.dynamic else [])
                if args.default_only:
                    modes = [(bool(adapt), 0, args.lookup)]
                variants = [(plain, contextlib.nullcontext)] + [
                    (med, functools.partial(_adapting, record, adapt if a else None, e, k))
                    for a, e, k in modes]
                (ref, base_rate, _), *timings = timed_together(variants, prompts, args.new,
                                                               eos=kind == "chat")
                eager = eager_baseline(plain, prompts, args.new, eos=kind == "chat")
                for (adaptive, dynamic, lookup), (out, rate, st) in zip(modes, timings):
                    n = nodes
                    verified = st.get("drafted", 0) / st["row_rounds"] if st.get("row_rounds") else 0.0
                    run = {"dtype": dtype, "strategy": arch, "draft_vocab": vocab, "batch": b,
                           "prompts": kind, "tree": tree, "nodes": n, "adaptive": adaptive,
                           "dynamic": dynamic, "lookup": lookup,
                           "nodes_verified": verified, "tree_changes": st.get("tree_changes", 0),
                           "report": p.report,
                           "plain_tok_s": base_rate, "plain_eager_tok_s": eager,
                           "heads_tok_s": rate, "speedup": rate / base_rate,
                           "accepted_length": 1 + st.get("accepted", 0) / st["row_rounds"]
                           if st.get("row_rounds") else 1.0,  # plain decoding has no rounds
                           "forward_per_token": st["forward_passes"] / max(st["tokens"], 1),
                           "same_tokens": same(out, ref), "samples": len(prompts)}
                    keep_row(results, run, args.json)
                    predicted = expected_tokens(Tree(tuple(map(tuple, sub))), trained.accuracy)
                    rows.append([dtype, arch, vocab or "full",
                                 f"{n} of {whole}" + (f", adaptive: {verified:.1f}" if adaptive else "")
                                 + (f", dynamic: {dynamic}" if dynamic else "")
                                 + (f", lookup: {lookup}" if lookup else ""),
                                 b, kind,
                                 f"{base_rate:.1f}", f"{eager:.1f}" if eager else "-",
                                 f"{rate:.1f}", f"{rate / base_rate:.2f}x",
                                 f"{run['accepted_length']:.2f}", f"{predicted:.2f}",
                                 run["same_tokens"]])


def eagle_rows(model, tok, plain, args, dtype, results, rows) -> None:
    """The EAGLE draft layer (``EagleDraft``) against plain decode and against Hydra heads
    (``--heads``, default the model's shipped ones; ``none``: the draft alone) given the same
    rounds: a tree of as many nodes re-grown every round from the draft's probabilities
    (``--dynamic`` nodes expanded a level, 4 without it), ``--eagle-depth`` levels, the
    ``--draft-vocab`` most produced tokens
    (0: the whole vocabulary), ``--lookup`` tokens copied from the text (0: none). Runs
    interleaved."""
    from rewriter.passes.eagle_draft import budget_tree
    expand = args.dynamic or 4
    vocab = args.draft_vocab or None
    for nodes in args.eagle_nodes:
        tree = budget_tree(nodes, args.eagle_depth).record()
        engines = {"EAGLE layer": strategy_engine(model, tokenizer=tok, backend=args.backend, passes=[
                       EagleDraft(weights=args.eagle, nodes=nodes, expand=expand, depth=args.eagle_depth,
                                  draft_vocab=vocab, lookup=args.lookup)])}
        if args.heads != "none":  # the heads on the same rounds, for comparison
            engines["Hydra heads"] = strategy_engine(model, tokenizer=tok, backend=args.backend, passes=[
                HydraHeads(weights=args.heads or args.model, tree=tree, dynamic=expand,
                           lookup=args.lookup, draft_vocab=vocab)])
        for b in args.batch:
            for kind, prompts in prompt_sets(plain, tok, b, args.samples, args.chat).items():
                variants = [(plain, contextlib.nullcontext)] + \
                    [(e, contextlib.nullcontext) for e in engines.values()]
                (ref, base_rate, _), *timings = timed_together(variants, prompts, args.new,
                                                               eos=kind == "chat")
                for name, (out, rate, st) in zip(engines, timings):
                    rounds = st.get("row_rounds") or 0
                    run = {"dtype": dtype, "strategy": "eagle" if name.startswith("EAGLE") else "hydra",
                           "draft": args.eagle if name.startswith("EAGLE") else args.heads or args.model,
                           "nodes": nodes, "expand": expand, "draft_vocab": vocab, "batch": b,
                           "lookup": args.lookup, "depth": args.eagle_depth,
                           "prompts": kind,
                           "plain_tok_s": base_rate, "tok_s": rate, "speedup": rate / base_rate,
                           "accepted_length": 1 + st.get("accepted", 0) / rounds if rounds else 1.0,
                           "draft_calls_per_round": st.get("head_passes", 0) / st["rounds"]
                           if st.get("rounds") else 0.0,
                           "same_tokens": same(out, ref), "samples": len(prompts)}
                    keep_row(results, run, args.json)
                    rows.append([dtype, name, vocab or "full", nodes, b, kind, f"{base_rate:.1f}", f"{rate:.1f}",
                                 f"{rate / base_rate:.2f}x", f"{run['accepted_length']:.2f}",
                                 f"{run['draft_calls_per_round']:.1f}", run["same_tokens"]])


def prompt_lookup_rows(model, tok, plain, args, dtype, results, rows) -> None:
    """``PromptLookup`` choosing its chain's length and always verifying the whole chain,
    every batch and prompt set, against plain decode (interleaved runs)."""
    tokens = args.lookup or 4
    adapting = strategy_engine(model, tokenizer=tok, backend=args.backend,
                               passes=[PromptLookup(tokens=tokens)])
    engines = {f"tokens={tokens}": (adapting, contextlib.nullcontext),
               f"tokens={tokens}, adapt=False": (strategy_engine(
                   model, tokenizer=tok, backend=args.backend,
                   passes=[PromptLookup(tokens=tokens, adapt=False)]), contextlib.nullcontext),
               # what a user gets by default: rounds or plain steps, whichever were timed faster
               f"tokens={tokens}, guarded": (adapting, Guarded(adapting))}
    for b in args.batch:
        for kind, prompts in prompt_sets(plain, tok, b, args.samples, args.chat).items():
            variants = [(plain, contextlib.nullcontext)] + list(engines.values())
            (ref, base_rate, _), *timings = timed_together(variants, prompts, args.new,
                                                           eos=kind == "chat")
            for name, (out, rate, st) in zip(engines, timings):
                rounds = st.get("row_rounds") or 0
                run = {"dtype": dtype, "strategy": "lookup", "setting": name, "batch": b,
                       "prompts": kind, "plain_tok_s": base_rate, "lookup_tok_s": rate,
                       "speedup": rate / base_rate,
                       "accepted_length": 1 + st.get("accepted", 0) / rounds if rounds else 1.0,
                       "copied_per_round": st.get("copied", 0) / st["rounds"] if st.get("rounds") else 0.0,
                       "same_tokens": same(out, ref), "samples": len(prompts),
                       # timed generations that ran plain steps (the guard's, or the chain's rest)
                       "plain_generations": st.get("plain_generations", 0),
                       "generations": RUNS * len(prompts)}
                keep_row(results, run, args.json)
                rows.append([dtype, name, b, kind, f"{base_rate:.1f}", f"{rate:.1f}",
                             f"{rate / base_rate:.2f}x", f"{run['accepted_length']:.2f}",
                             f"{run['copied_per_round']:.1f}",
                             f"{run['plain_generations']}/{run['generations']}", run["same_tokens"]])


@contextlib.contextmanager
def _adapting(record: dict, adapt, dynamic: int = 0, lookup: int = 0):
    """The decoding record with ``adapt`` (None: without it, the fixed tree), ``dynamic``
    (0: the tree's own shape) and ``lookup`` (0: no chain copied from the text), then as
    it was."""
    kept = {k: record.pop(k) for k in ("adapt", "dynamic", "lookup") if k in record}
    if adapt is not None:
        record["adapt"] = adapt
    if dynamic:
        record["dynamic"] = dynamic
    if lookup:
        record["lookup"] = lookup
    try:
        yield
    finally:
        for k in ("adapt", "dynamic", "lookup"):
            record.pop(k, None)
        record.update(kept)


def print_heads(args, results, rows) -> None:
    print()
    for arch, h in results["heads"].items():
        t = h["training"]
        data = t.get("seconds_data")
        print(f"{arch} heads {h['weights']}: held-out top-1 {h['top1']}, top-5 {h['top5']}; "
              f"trained on {t.get('train_tokens')} tokens ({t.get('positions')} positions, "
              f"{t.get('epochs')} epochs) in {t.get('seconds_training')} s of training"
              + (f" + {data} s making the data" if data else "")
              + (f", {t['seconds_total']} s in all" if t.get("seconds_total") else ""))
    print()
    print(tabulate(rows, headers=["dtype", "heads", "draft vocab", "tree nodes", "batch", "prompts",
                                  "plain tok/s", "plain no-graph tok/s", "heads tok/s", "speed-up", "accepted length",
                                  "predicted", "same tokens"]))
    print()


def keep_row(results: dict, run: dict, path: str):
    """Keeps a finished row: in the results, as a line of the log and in the JSON file, so a
    run stopped at its time limit (a GPU lease) keeps the rows it finished."""
    results["runs"].append(run)
    print(json.dumps(run, default=str), flush=True)
    write_json(path, results)


def prompt_sets(plain, tok, batch: int, samples: int, chat: str = "eval") -> dict:
    """Per kind, ``samples`` batches of ``batch`` prompts: code chunks of distinct files
    while there are files enough (docs/history/benchmarks-notebook.md's figures before its
    section "Mixed data, self-asked questions, and code prompts from many held-out files" used
    consecutive chunks of the first files, ``code_prompts``); chat
    questions (``chat``: "eval", the eval's 8, or "wide", ``WIDE_CHAT``), as many distinct
    batches as there are questions for."""
    code = spread_code_prompts(tok, batch * samples, 128)
    sets = {"code": [code[i * batch:(i + 1) * batch] for i in range(samples)]}
    if plain.text.chat_template is not None:
        pool = WIDE_CHAT if chat == "wide" else CHAT_PROMPTS
        n = max(1, min(samples, len(pool) // batch))
        questions = [pool[j % len(pool)] for j in range(n * batch)]
        sets["chat"] = [[chat_prompt(tok, plain.text, q) for q in questions[i * batch:(i + 1) * batch]]
                        for i in range(n)]
    return sets


if __name__ == "__main__":
    main()
