"""How far a chain copied from the text can be trusted, by the length of the match that found it.

    python3 benchmarks/chain_orders.py --model smollm2 --new 64

Prompt lookup (``runtime.tree_lookup``) copies the tokens that followed the latest earlier
occurrence of the text's last 3, 2 or 1 tokens (the longest that occurred: the match's
order). This generates the model's plain greedy text for the speculative benchmark's
prompts (``speculative.prompt_sets``; chat answers to their end) and, at every position of
it, proposes a chain as the rounds do (``Context.match``) and counts how many of its
copies were the text's own, by order. No timing: the counts are the same on any machine.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.checkpoints import cast
from rewriter.runtime.settings import GenerationSettings
from rewriter.runtime.tree_lookup import NGRAM, Context

from speculative import load, prompt_sets


def texts(plain, batches, new: int, eos: bool) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy continuation) per prompt; with ``eos`` cut after the end of sequence."""
    ends = set(GenerationSettings().for_model(plain.config).eos_token_id)
    out = []
    for batch in batches:
        for prompt in batch:
            made = plain.generate([prompt], max_new_tokens=new,
                                  **({} if eos else {"eos_token_id": []}))[0, len(prompt):].tolist()
            cut = next((i + 1 for i, t in enumerate(made) if t in ends), len(made)) if eos else len(made)
            out.append((prompt, made[:cut]))
    return out


def count(rows, length: int) -> dict[int, list[int]]:
    """``{order: histogram}``: at each position after the first new token whose next
    ``length`` tokens are known (as the rounds score a chain), how many of a
    ``length``-token chain's copies were the text's own (``histogram[m]``)."""
    hist = {n: [0] * (length + 1) for n in range(NGRAM + 1)}
    for prompt, made in rows:
        context = Context(prompt + made[:1])
        for t in range(1, len(made) - length + 1):
            order, chain = context.match(length)
            m = 0
            while m < len(chain) and chain[m] == made[t + m]:
                m += 1
            hist[order][m] += 1
            context.extend(made[t:t + 1])
    return hist


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--samples", type=int, default=8, help="prompts per kind")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--length", type=int, default=4, help="copies a chain proposes")
    ap.add_argument("--json", default="benchmarks/results/chain_orders.json")
    args = ap.parse_args()
    for name, v, top in (("--samples", args.samples, 64), ("--new", args.new, 4096),
                         ("--length", args.length, 64)):
        if not 1 <= v <= top:
            ap.error(f"{name} must be in [1, {top}], got {v}")
    model, tok = load(args.model)
    plain = rewriter.optimize(cast(model, torch.float32, "cpu"), tokenizer=tok)
    results = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "new_tokens": args.new,
               "length": args.length, "kinds": {}}
    table = []
    for kind, batches in prompt_sets(plain, plain.tokenizer, 1, args.samples).items():
        hist = count(texts(plain, batches, args.new, eos=kind == "chat"), args.length)
        total = sum(map(sum, hist.values()))
        results["kinds"][kind] = {"positions": total, "histograms": hist}
        for order in range(NGRAM, -1, -1):
            h, n = hist[order], sum(hist[order])
            right = sum(m * c for m, c in enumerate(h)) / n if n and order else None
            first = sum(h[1:]) / n if n and order else None
            table.append([kind, order or "none", f"{n / max(total, 1):.2f}",
                          "-" if right is None else f"{right:.2f}",
                          "-" if first is None else f"{first:.2f}"])
    print(tabulate(table, headers=["prompts", "match order", "share of positions",
                                   f"copies right, mean of {args.length}", "first copy right"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
