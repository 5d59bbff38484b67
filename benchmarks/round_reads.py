"""Reads back and host-to-device copies per round of each round-based strategy.

    python benchmarks/round_reads.py [--json benchmarks/results/round_reads.json]

On a GPU each read back (``tolist``, ``item``, ``bool`` of a tensor) and each copy from
pageable host memory waits for the work queued before it, so their number bounds how fast a
round goes there (docs/benchmarks.md, "Second GPU lease"). They are counted here on the CPU,
where the same calls are made: the default model with its shipped heads, 2 rows, 48 new
tokens, greedy, with and without an end of sequence to watch for; per round, averaged over
one generation after a warm-up. The counts include the generation's own (the prompt's
first token, the rows' prompts for prompt lookup).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tabulate import tabulate

import rewriter
from rewriter.host_reads import counting
from rewriter.passes import HydraHeads, MedusaHeads, PromptLookup, SelfSpeculative

ROWS = [list(range(3, 40)), list(range(50, 70))]
STRATEGIES = {
    "SelfSpeculative(skip_layers=[1], max_draft=3)":
        lambda: SelfSpeculative(skip_layers=[1], max_draft=3, threshold=0.0),
    "MedusaHeads, a fixed 6-node tree":
        lambda: MedusaHeads(weights="default", tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "MedusaHeads (defaults: adaptive tree, prompt lookup)": lambda: MedusaHeads(weights="default"),
    "HydraHeads (defaults)": lambda: HydraHeads(weights="default"),
    "PromptLookup(tokens=4)": lambda: PromptLookup(tokens=4),
}


def counted(engine, eos: list[int]) -> dict:
    """Per round: reads back and copies from the host of one generation."""
    engine.stats.clear()
    with counting() as count:
        engine.generate(ROWS, max_new_tokens=48, eos_token_id=eos)
    rounds = max(1, engine.stats["rounds"])
    return {"rounds": engine.stats["rounds"], "reads_per_round": count["reads"] / rounds,
            "copies_per_round": count["copies"] / rounds}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/round_reads.json")
    args = ap.parse_args()
    model, tok = rewriter.default_model()
    rows, results = [], []
    for name, make in STRATEGIES.items():
        engine = rewriter.optimize(model, tokenizer=tok, passes=[make()])
        engine.fallback = False  # the rounds, never plain steps
        engine.generate(ROWS, max_new_tokens=8, eos_token_id=[])  # warm-up
        for eos in ([], [2]):
            got = {"strategy": name, "eos": eos, **counted(engine, eos)}
            results.append(got)
            rows.append([name, "yes" if eos else "no", got["rounds"],
                         f"{got['reads_per_round']:.2f}", f"{got['copies_per_round']:.2f}"])
    print(tabulate(rows, headers=["strategy", "EOS watched", "rounds", "reads back/round",
                                  "host copies/round"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
