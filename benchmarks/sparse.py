"""Sparse attention against dense attention, through the KV-cache runtime, in one run.

    python benchmarks/sparse.py [--model default|smollm2|PATH] [--lengths 256 512 1024]
                                [--depths 0.1 0.5 0.9] [--trials 4] [--windows 128 512]
                                [--sinks 4] [--top-k 64 128] [--selection-layers 0]
                                [--tidal-max-read 0.25] [--tidal-select-own]
                                [--quest-budget 64 128] [--quest-page 16] [--quest-dense-layers 2]
                                [--recent 0 64] [--kv-length 4096]
                                [--duo-gates default] [--duo-sparsity 0.5 0.75]
                                [--duo-sinks 16] [--duo-window 240]
                                [--ppl-length 1024] [--ppl-chunks 4]
                                [--batch 1 8] [--new 32] [--json benchmarks/results/sparse.json]
                                [--device cuda] [--backend triton] [--dtype bfloat16]

Pipelines: dense attention, ``StreamingAttention(sinks, window)`` for each window,
``TidalDecode(selection_layers, top_k, recent)`` for each top_k and recent window (with
``--tidal-select-own``, each with ``select_own=True``),
``Quest(page, budget, recent)`` for each ``--quest-budget`` and recent window, and with
``--duo-gates``
``DuoAttention(gates)`` at its threshold and at each ``--duo-sparsity`` (the gates file's
sinks and window).
Columns: pass-key accuracy by context length and by depth (where in the context the key
lies: StreamingLLM is the control that must fail when the key falls outside its window),
held-out perplexity (second half of each chunk scored one decode step at a time, so the
cache policy shows) and its ratio to dense, KV memory allocated for one sequence of
``--kv-length`` tokens (default: the longest pass-key length), KV bytes a decode step reads
there (``engine.kv_read_bytes``), and decode tokens/s at that length for each batch size (the median of ``--new``
decode steps timed one by one after one prefill, the first 2 not counted), with the
ratio to dense.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import rewriter
from rewriter.models.checkpoints import cast
from rewriter.api.eval import heldout_chunks, passkey_accuracy, perplexity
from rewriter.passes import DuoAttention, Quest, StreamingAttention, TidalDecode

from common import describe, load, write_json


def decode_rate(engine, batch: int, length: int, new: int, warmup: int = 2) -> float:
    """Decode tokens/s after a ``length - new - 1`` token prompt, from the median time of one
    decode step: one prefill, then ``new`` steps timed one by one, the first ``warmup``
    not counted. One prefill per figure, not one per run: at 8k tokens and batch 8 the
    prompt costs minutes on a CPU, a decode step well under a second."""
    prompt = torch.randint(1, 1000, (batch, length - new - 1), generator=torch.Generator().manual_seed(0))
    steps = engine.stream(prompt, max_new_tokens=new + 1, eos_token_id=[])
    next(steps)  # prefill: its token is the first one
    times = []
    cuda = engine._device().type == "cuda"
    for _ in range(new):
        start = time.perf_counter()
        next(steps)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return batch / statistics.median(times[warmup:])


def selection_sets(ap, items: list) -> list:
    """``--selection-layers``: plain integers are one set (``2 8 14``), comma-joined ones a
    set each (``2,8,14 3,14``)."""
    try:
        sets = ([[int(x) for x in i.split(",") if x] for i in items] if any("," in i for i in items)
                else [[int(i) for i in items]])
    except ValueError:
        sets = []
    if not sets or not all(sets):
        ap.error(f"--selection-layers: layer indices, got {' '.join(items)}")
    return sets


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--lengths", type=int, nargs="*", default=[256, 512, 1024],
                    help="pass-key prompt lengths (none: no pass key)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--windows", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--top-k", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--selection-layers", nargs="+", default=["0"],
                    help="TidalDecode's selection layers: one set (2 8 14) or several, one row "
                         "each (2,8,14 3,14)")
    ap.add_argument("--tidal-select-own", action="store_true",
                    help="TidalDecode rows with select_own=True: a selection layer attends to "
                         "its own selection too (every key read to choose, the chosen values)")
    ap.add_argument("--tidal-max-read", type=float, nargs="*", default=[],
                    help="TidalDecode rows whose selection layers are calibrated "
                         "(TidalDecode(calibrate=...)) on 4 held-out prose chunks of "
                         "--ppl-length tokens, a decode step reading at most this fraction "
                         "of dense attention's KV bytes; one row each per top_k and recent")
    ap.add_argument("--quest-budget", type=int, nargs="*", default=[],
                    help="token budgets, one Quest row each")
    ap.add_argument("--recent", type=int, nargs="+", default=[0],
                    help="local windows kept beside TidalDecode's and Quest's selections, "
                         "one row each")
    ap.add_argument("--quest-page", type=int, default=16)
    ap.add_argument("--quest-dense-layers", type=int, default=2)
    ap.add_argument("--duo-gates", default=None,
                    help="a gates file (or shipped name) for DuoAttention rows; none: no rows")
    ap.add_argument("--duo-sparsity", type=float, nargs="*", default=[0.5],
                    help="fractions of KV heads made streaming, one DuoAttention row each")
    ap.add_argument("--duo-sinks", type=int, default=None,
                    help="DuoAttention's streaming heads' sinks (default: the gates file's)")
    ap.add_argument("--duo-window", type=int, default=None,
                    help="DuoAttention's streaming heads' window (default: the gates file's)")
    ap.add_argument("--ppl-length", type=int, default=1024)
    ap.add_argument("--ppl-chunks", type=int, default=4, help="0: no perplexity")
    ap.add_argument("--kv-length", type=int, default=None,
                    help="tokens in the cache for the KV and decode-speed figures (default: "
                         "the longest pass-key length, else the perplexity length)")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--json", default="benchmarks/results/sparse.json")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="torch", choices=["torch", "triton"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    if args.new < 3:
        ap.error(f"--new {args.new}: at least 3 decode steps (the first 2 are a warm-up)")
    model, tok = load(args.model)
    model = cast(model, getattr(torch, args.dtype), args.device)
    pipelines = {"dense": []}
    for w in args.windows:
        pipelines[f"StreamingAttention(sinks={args.sinks}, window={w})"] = [
            StreamingAttention(sinks=args.sinks, window=w)]
    for k in args.top_k:
        for r in args.recent:
            for layers in selection_sets(ap, args.selection_layers):
                p = TidalDecode(selection_layers=layers, top_k=k, recent=r,
                                select_own=args.tidal_select_own)
                pipelines[repr(p)] = [p]
            for most in args.tidal_max_read:  # prose calibrates, code is scored
                prose = heldout_chunks(tok, 4, args.ppl_length, corpus="prose").tolist()
                p = TidalDecode(calibrate=prose, top_k=k, recent=r, max_read=most,
                                select_own=args.tidal_select_own)
                pipelines[repr(p).replace("<4 prompts>", "prose")] = [p]
    for b in args.quest_budget:
        for r in args.recent:
            p = Quest(page=args.quest_page, budget=b, dense_layers=args.quest_dense_layers, recent=r)
            pipelines[repr(p)] = [p]
    ring = dict(sinks=args.duo_sinks, window=args.duo_window)  # None: the gates file's
    shown = "".join(f", {k}={v}" for k, v in ring.items() if v is not None)
    if args.duo_gates:  # the gates' threshold (0.5), then each sparsity
        pipelines[f"DuoAttention(threshold=0.5{shown})"] = [DuoAttention(args.duo_gates, **ring)]
    for f in args.duo_sparsity if args.duo_gates else []:
        pipelines[f"DuoAttention(sparsity={f}{shown})"] = [
            DuoAttention(args.duo_gates, sparsity=f, **ring)]
    longest = args.kv_length or max(args.lengths, default=args.ppl_length)
    if args.batch and longest <= args.new + 1:
        ap.error(f"a {longest}-token cache leaves no prompt before {args.new + 1} new tokens "
                 f"(--kv-length, --new)")
    chunks = heldout_chunks(tok, args.ppl_chunks, args.ppl_length) if args.ppl_chunks else None
    results = {**describe(args.device), "model": args.model, "args": vars(args), "rows": []}
    for name, passes in pipelines.items():
        engine = rewriter.optimize(model, passes=passes, tokenizer=tok, backend=args.backend)
        started = time.perf_counter()
        by_length = passkey_accuracy(engine, tok, args.lengths, args.depths, args.trials)
        deepest = max(args.lengths, default=None)
        by_depth = {d: passkey_accuracy(engine, tok, [deepest], [d], args.trials).get(deepest)
                    for d in args.depths} if deepest else {}
        ppl = perplexity(engine, chunks) if args.ppl_chunks else float("nan")
        rates = {b: decode_rate(engine, b, longest, args.new) for b in args.batch}
        row = {"pipeline": name, "passkey_by_length": by_length, "passkey_by_depth": by_depth,
               "perplexity": ppl, "kv_bytes": engine.kv_bytes_per_token(longest) * longest,
               "kv_read_bytes": engine.kv_read_bytes(longest), "tok_s": rates,
               "seconds": time.perf_counter() - started}
        if any(p.report for p in passes if isinstance(p, TidalDecode)):
            row["calibration"] = {k: v for k, v in passes[0].report.items() if k != "kept"}
            name = row["pipeline"] = name + f" -> {passes[0].selection_layers}"
        results["rows"].append(row)
        print(f"{name}: {row['seconds']:.0f} s", flush=True)
        write_json(args.json, results)  # so far
    dense = results["rows"][0]
    table = []
    for r in results["rows"]:
        table.append([r["pipeline"],
                      *(f"{r['passkey_by_length'].get(n, float('nan')):.2f}" for n in args.lengths),
                      *(f"{r['passkey_by_depth'][d]:.2f}" for d in args.depths if args.lengths),
                      f"{r['perplexity']:.2f}", f"{r['perplexity'] / dense['perplexity']:.3f}",
                      f"{r['kv_bytes'] / 2**10:.0f}", f"{dense['kv_bytes'] / r['kv_bytes']:.2f}x",
                      f"{r['kv_read_bytes'] / 2**10:.0f}",
                      f"{dense['kv_read_bytes'] / r['kv_read_bytes']:.2f}x",
                      *(f"{r['tok_s'][b]:.0f} ({r['tok_s'][b] / dense['tok_s'][b]:.2f}x)"
                        for b in args.batch)])
    print(f"\n{args.model} on {results['machine']} ({args.device}, {args.backend} backend, {args.dtype}), "
          f"{args.trials} trials per depth, perplexity over "
          f"{args.ppl_chunks} x {args.ppl_length} tokens, KV figures for one sequence of "
          f"{longest} tokens, {results['threads']} threads, {results['date']}\n")
    print(tabulate(table, headers=["pipeline", *(f"key@{n}" for n in args.lengths),
                                   *(f"key@depth {d}" for d in args.depths if args.lengths),
                                   "ppl", "ppl ratio",
                                   "KV KiB", "less KV", "KV read KiB/step", "less read",
                                   *(f"tok/s b={b} @{longest}" for b in args.batch)]))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
