"""How much attention a TidalDecode selection keeps, layer by layer, and the selection
layers that keep the most within a KV-bytes budget (``rewriter.measure.attention_recall``).

    python benchmarks/selection_recall.py [--model default|smollm2|PATH] [--text passkey|code]
                                          [--length 1024] [--rows 8] [--queries 32]
                                          [--top-k 96] [--recent 32] [--budget 0.25 0.35]
                                          [--select-own]
                                          [--json benchmarks/results/selection_recall.json]

The model runs densely over ``--rows`` texts of ``--length`` tokens: pass-key prompts with
their answers (``passkey``: the queries are the answer's digits and the tokens before
them) or held-out code or prose (``code``, ``prose``: ``benchmarks/sparse.py`` scores
perplexity on the code, so calibrate on the prose to keep the two apart). For the last ``--queries`` positions of each, every
layer's softmax rows are kept; the table gives, per selection layer, the mean attention
weight every later layer keeps when it reads that layer's ``top_k + recent`` selection.
Then, for each budget (KV bytes a decode step reads, as a fraction of dense attention's,
at ``--length`` tokens), the selection layers that keep the most attention summed over
layers, and with ``--select-own`` the same for ``TidalDecode(select_own=True)``'s cost
model (a selection layer reads every key and its selection's values and keeps its own
top-k's mass). Nothing is timed: the figures do not depend on the machine.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
from tabulate import tabulate

import rewriter
from rewriter.measure.attention_recall import attention_rows, best_selection_layers, kept_mass
from rewriter.models.corpus import passkey_sample
from rewriter.api.eval import _backend, _code_lines, heldout_chunks

from common import describe, write_json


def passkey_texts(tokenizer, rows: int, length: int) -> list:
    """Pass-key prompts of ``length`` tokens with their answers appended, depths 0.1-0.9,
    sentence and code filler alternating (the eval's generator, another seed)."""
    tok = _backend(tokenizer)
    rng = random.Random(f"selection-recall-{length}")
    depths = [0.1, 0.5, 0.9]
    out = []
    for i in range(rows):
        s = passkey_sample(tok, length, depths[i % 3], rng,
                           filler="sentences" if i % 2 == 0 else "code", lines=_code_lines())
        out.append(torch.tensor(tok.encode(s.prompt + " " + s.key).ids))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--text", default="passkey", choices=["passkey", "code", "prose"])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=96)
    ap.add_argument("--recent", type=int, default=32)
    ap.add_argument("--budget", type=float, nargs="+", default=[0.25])
    ap.add_argument("--select-own", action="store_true",
                    help="also choose under select_own's cost model, a row each budget")
    ap.add_argument("--json", default="benchmarks/results/selection_recall.json")
    args = ap.parse_args()
    for name in ("length", "rows", "queries", "top_k"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.recent < 0 or not all(0 < b <= 1 for b in args.budget):
        ap.error("--recent must be >= 0 and each --budget in (0, 1]")

    opt = rewriter.from_pretrained(args.model)  # the unoptimized IR: dense attention
    tok = opt.tokenizer
    if args.text == "passkey":
        texts = passkey_texts(tok, args.rows, args.length)
    else:
        texts = list(heldout_chunks(tok, args.rows, args.length, corpus=args.text))
    start = time.perf_counter()
    total = None
    for ids in texts:  # one row at a time: the rows are [Hq, Q, T] per layer
        rows = attention_rows(opt.ir, ids[None], min(args.queries, len(ids) - 1))
        m = kept_mass(rows, args.top_k, args.recent)
        total = m if total is None else total + m
    kept = total / len(texts)
    seconds = time.perf_counter() - start
    n = kept.shape[0]

    table = [[s] + [f"{kept[s, l]:.2f}" if l >= s else "" for l in range(n)] for s in range(n)]
    print(f"\n{args.model}: {args.rows} {args.text} texts of {args.length} tokens, last "
          f"{args.queries} queries, top_k={args.top_k}, recent={args.recent} "
          f"({seconds:.0f} s). Row: selection layer; column: the layer reading it "
          f"(diagonal: the layer's own top-k).\n")
    print(tabulate(table, headers=["sel \\ layer"] + list(range(n))))
    choices = []
    for own in ([False, True] if args.select_own else [False]):
        for budget in args.budget:
            c = best_selection_layers(kept, args.length, args.top_k, args.recent, budget,
                                      select_own=own)
            choices.append({"budget": budget, "select_own": own,
                            **(c.__dict__ if c else {"selection_layers": None})})
    print()
    print(tabulate([[c["budget"], c["select_own"], c["selection_layers"],
                     f"{1 / c['bytes_read']:.2f}x" if c.get("bytes_read") else "",
                     f"{c['kept']:.3f}" if c.get("kept") is not None else "nothing fits"] for c in choices],
                   headers=["budget", "select_own", "selection layers", "fewer KV bytes", "mean kept"]))
    out = {"model": args.model, "text": args.text, "length": args.length, "rows": args.rows,
           "queries": args.queries, "top_k": args.top_k, "recent": args.recent,
           **describe(), "seconds": seconds,
           "kept": [[float(x) for x in row] for row in kept], "choices": choices}
    write_json(args.json, out)


if __name__ == "__main__":
    main()
