"""Draft heads in a batch: the adaptive tree weighing the lagging row, weighing every row
alike, and the fixed tree, on more chat questions than the speculative benchmark has.

    python3 benchmarks/adaptive_lag.py [--batch 4] [--new 48] [--dtype bfloat16]
                                       [--json benchmarks/results/adaptive_lag.json]

In a batch, the adaptive tree (``runtime.tree_adapt``) re-chooses its sub-tree from the
counts of the row that lags (the fewest tokens), since the batch ends with it; the lagging
row is also the one whose drafts went worst so far, so its counts could be biased low.
This times, on SmolLM2 with its shipped Hydra heads (4096-token draft vocabulary, chains
copied from the text: the README command's pass), plain decode against the default (the
lagging row's counts), the pooled counts of every row (``_choose_tree`` with no row's
counts), and the pass's fixed tree with every chain whole, runs interleaved, on the
benchmark's 8 chat questions and 16 more (``QUESTIONS``), answers stopping at their end.
Every variant starts each run with no counts learnt. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.checkpoints import cast
from rewriter.eval import CHAT_PROMPTS
from rewriter.passes import HydraHeads
from rewriter.runtime import tree_decoding
from rewriter.runtime.chat import chat_prompt

from speculative import RUNS, _adapting, device_name, load, same, strategy_engine, timed_together

QUESTIONS = CHAT_PROMPTS + (
    "How do I boil an egg?", "What causes rain?", "Give me three tips for better sleep.",
    "Explain what a noun is.", "Why is the sky blue?",
    "What is the largest planet in the solar system?", "Write a haiku about the sea.",
    "How many days are in a leap year?", "What does a computer's CPU do?",
    "Suggest a name for a pet cat.", "What is photosynthesis?", "How do I make a cup of tea?",
    "Name two kinds of trees.", "What is the difference between weather and climate?",
    "Describe a rainbow in one sentence.", "What is 12 times 12?")


def pooled(self, rows, done, length) -> None:
    """``_TreeRounds._choose_tree`` weighing every row alike: the pooled counts only."""
    tree = self.adapt.next(self.budget, None)
    self.adapt.current = tree
    if tree != self.budget:
        self.use(tree)
        self.stats.update(tree_changes=1)


@contextlib.contextmanager
def variant(engine, record: dict, adapt: bool, pool: bool):
    """The engine as one variant, from no learnt counts."""
    lagging = tree_decoding._TreeRounds._choose_tree
    with _adapting(record, record.get("adapt") if adapt else None, 0, record.get("lookup", 0)):
        if pool:
            tree_decoding._TreeRounds._choose_tree = pooled
        engine.trees.clear()
        try:
            yield
        finally:
            tree_decoding._TreeRounds._choose_tree = lagging


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default="benchmarks/results/adaptive_lag.json")
    args = ap.parse_args()
    if not 2 <= args.batch <= len(QUESTIONS):
        ap.error(f"--batch must be in [2, {len(QUESTIONS)}], got {args.batch}")
    if not 1 <= args.new <= 512:
        ap.error(f"--new must be in [1, 512], got {args.new}")
    model, tok = load("smollm2")
    model = cast(model, getattr(torch, args.dtype), "cpu")
    plain = rewriter.optimize(model, tokenizer=tok)
    heads = strategy_engine(model, tokenizer=plain.tokenizer,
                            passes=[HydraHeads(weights="smollm2", draft_vocab=4096, lookup=4)])
    record = heads.ir.info["decoding"]
    b = args.batch
    prompts = [[chat_prompt(plain.tokenizer, plain.text, q) for q in QUESTIONS[i:i + b]]
               for i in range(0, len(QUESTIONS) - b + 1, b)]
    modes = {"adaptive, lagging row (the default)": (True, False),
             "adaptive, every row alike": (True, True), "fixed tree, whole chain": (False, False)}
    variants = [(plain, contextlib.nullcontext)] + [
        (heads, functools.partial(variant, heads, record, *m)) for m in modes.values()]
    (ref, base, _), *got = timed_together(variants, prompts, args.new, eos=True)
    rows, runs = [], []
    for name, (out, rate, st) in zip(modes, got):
        per_row = st.get("row_rounds") or 1
        run = {"variant": name, "tok_s": rate, "speedup": rate / base,
               "accepted_length": 1 + st.get("accepted", 0) / per_row,
               "nodes_verified": st.get("drafted", 0) / per_row, "same_tokens": same(out, ref)}
        runs.append(run)
        rows.append([name, f"{rate:.1f}", f"{rate / base:.2f}x", f"{run['accepted_length']:.2f}",
                     f"{run['nodes_verified']:.2f}", run["same_tokens"]])
    print(f"\nsmollm2 {args.dtype}, Hydra heads (4096-token draft vocabulary, lookup 4), batch {b}, "
          f"{len(prompts)} batches of chat questions, {args.new} new tokens at most, "
          f"{device_name('cpu')}, {torch.get_num_threads()} threads; plain decode {base:.1f} tok/s\n")
    print(tabulate(rows, headers=["tree", "tok/s", "speed-up", "accepted length",
                                  "nodes verified/round", "same tokens"]))
    results = {"model": "smollm2", "dtype": args.dtype, "batch": b, "new_tokens": args.new,
               "batches": len(prompts), "runs_each": RUNS, "tree": record["tree"],
               "batch_trees": record.get("batch_trees"), "plain_tok_s": base,
               "date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
