"""KV sharing across layers: how alike the layers' caches are, the premise of sharing them.

    python benchmarks/kv_sharing.py [--model default|smollm2|PATH] [--corpus code prose]
                                    [--chunks 2] [--length 256] [--json benchmarks/results/kv_sharing.json]
                                    [--share every=2 last=4 ...]

Prints, for each corpus, the per-token cosine between every pair of layers' cached keys
and values (``rewriter.measure.kv_similarity``), averaged over tokens, KV heads and
chunks, and the pairs most alike: 1 means a reader of the other layer's cache would
attend with its own directions (MiniCache merges directions and keeps magnitudes), near
0 means its keys would be unrelated to its queries' training.

With ``--share``, each ``ShareKV`` setting (``every=2``, ``last=4``) is measured against
the plain model in the same run, through the KV-cache runtime: KV bytes allocated per
token and held-out perplexity (second half of each chunk scored one decode step at a time)
on each corpus, with its ratio to the plain model's.
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

import rewriter
from rewriter.api.eval import heldout_chunks, perplexity
from rewriter.measure.kv_similarity import layer_kv, similarity

from common import describe, load, write_json


def matrix_table(m: torch.Tensor) -> str:
    """``[L, L]`` as a table with layer numbers on both sides, two decimals."""
    n = m.shape[0]
    rows = [[i, *(f"{float(m[i, j]):.2f}" for j in range(n))] for i in range(n)]
    return tabulate(rows, headers=["", *range(n)], tablefmt="plain")


def closest(m: torch.Tensor, most: int) -> list:
    """The ``most`` pairs ``(i, j)`` with ``i < j`` of the highest value."""
    n = m.shape[0]
    pairs = [(float(m[i, j]), i, j) for i in range(n) for j in range(i + 1, n)]
    return sorted(pairs, reverse=True)[:most]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--corpus", nargs="+", default=["code", "prose"], choices=["code", "prose"])
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--json", default="benchmarks/results/kv_sharing.json")
    ap.add_argument("--share", nargs="*", default=[],
                    help="ShareKV settings measured against plain: every=K or last=N")
    args = ap.parse_args()
    for setting in args.share:  # every=K or last=N, integers
        key, _, value = setting.partition("=")
        if key not in ("every", "last") or not value.isdigit():
            ap.error(f"--share {setting!r}: every=K or last=N (an integer)")
    model, tok = load(args.model)
    ir = rewriter.optimize(model, tokenizer=tok).ir
    results = {**describe(), "model": args.model, "args": vars(args), "similarity": {}}
    for corpus in args.corpus:
        keys, values = similarity(layer_kv(ir, heldout_chunks(tok, args.chunks, args.length, corpus)))
        results["similarity"][corpus] = {"keys": keys.tolist(), "values": values.tolist()}
        for name, m in (("keys", keys), ("values", values)):
            print(f"\n{args.model}, {corpus}, {args.chunks} x {args.length} tokens: cosine of "
                  f"{name}, layer x layer ({results['machine']}, {results['date']})\n")
            print(matrix_table(m))
            print("most alike:", ", ".join(f"{i}-{j} {c:.2f}" for c, i, j in closest(m, 5)))
    if args.share:
        results["pipelines"] = share_rows(model, tok, args)
    write_json(args.json, results)


def share_rows(model, tok, args) -> list:
    """KV bytes per token and perplexity of each ``--share`` setting against plain, printed."""
    from rewriter.passes import ShareKV
    traced = rewriter.trace(model, tokenizer=tok)
    chunks = {c: heldout_chunks(tok, args.chunks, args.length, c) for c in args.corpus}
    rows = []
    for setting in ["plain", *args.share]:
        key, _, value = setting.partition("=")
        passes = [] if setting == "plain" else [ShareKV(**{key: int(value)})]
        engine = rewriter.optimize(traced, passes=passes)
        rows.append({"pipeline": setting, "kv_bytes_per_token": engine.kv_bytes_per_token(),
                     **{c: perplexity(engine, x) for c, x in chunks.items()}})
        print(f"{setting}: done", flush=True)
    plain = rows[0]
    print(tabulate([[r["pipeline"], r["kv_bytes_per_token"],
                     f"{plain['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f}x",
                     *(f"{r[c]:.2f} ({r[c] / plain[c]:.3f})" for c in args.corpus)] for r in rows],
                   headers=["pipeline", "KV B/token", "less KV",
                            *(f"ppl {c} (ratio)" for c in args.corpus)]))
    return rows


if __name__ == "__main__":
    main()
