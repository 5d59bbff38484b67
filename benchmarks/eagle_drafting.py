"""What an EAGLE round's drafting costs on its own: the catch-up and the tree's levels.

    python benchmarks/eagle_drafting.py [--model smollm2] [--dtype bfloat16] [--batch 1 4]
                                        [--nodes 8 16] [--rounds 60] [--runs 3]
                                        [--json benchmarks/results/eagle_drafting.json]

The shipped draft (``EagleDraft(weights=MODEL)``, a 4096-token draft vocabulary) runs as
the runtime runs it (``runtime.eagle_rows.EagleRows`` and ``runtime.tree_dynamic.grow``),
without the model: every row is caught up over a 200-position text, then each timed round
catches every row up over 2 accepted positions (the chat rounds' mean) and grows a tree of
``--nodes`` tokens, 4 levels, 4 expanded a level. Features and tokens are random (the cost
does not depend on them; the tree's shape does a little). Prints ms a round (medians of
``--runs`` runs of ``--rounds`` rounds) and the same in plain decode steps of the model,
timed here too (one token after a 200-token prompt, batch 1 and each batch).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.checkpoints import cast
from rewriter.passes import EagleDraft
from rewriter.runtime.eagle_rows import EagleProgram, EagleRows
from rewriter.runtime.tree_dynamic import grow

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import load  # noqa: E402  (benchmarks/ is not a package)
from step_time import machine  # noqa: E402

TEXT = 200  # positions each row's cache holds before the timed rounds
ACCEPTED = 2  # positions a round catches each row up over
DEPTH, EXPAND = 4, 4


def drafting_ms(program: EagleProgram, batch: int, nodes: int, rounds: int) -> float:
    """ms a round of catch-up and growing, over ``rounds`` rounds (the cache grows by
    ``ACCEPTED`` positions a round, as a generation's does)."""
    g = torch.Generator().manual_seed(batch * 100 + nodes)
    hidden, vocab = program.shape.hidden, program.embed.shape[0]
    dtype = program.lm.dtype
    draft = EagleRows(program, batch, "cpu")
    for r in range(batch):
        draft.catch_up(r, torch.randn(TEXT, hidden, generator=g).to(dtype),
                       torch.randint(vocab, (TEXT,), generator=g).tolist())
    vocab_ids = torch.arange(program.lm.shape[0])

    def call(d: int, chains):
        logp, rows = draft.call(d, chains, EXPAND)
        return logp, vocab_ids[rows]

    start = time.perf_counter()
    for _ in range(rounds):
        for r in range(batch):
            draft.catch_up(r, torch.randn(ACCEPTED, hidden, generator=g).to(dtype),
                           torch.randint(vocab, (ACCEPTED,), generator=g).tolist())
        root = torch.randint(vocab, (batch,), generator=g)
        grow(call, root, nodes, DEPTH, EXPAND, None, EXPAND)
    return (time.perf_counter() - start) / rounds * 1e3


def step_ms(engine, batch: int, runs: int = 15) -> float:
    """The model's plain decode step, ms: one token after a ``TEXT``-token prompt."""
    prompt = [list(range(100, 100 + TEXT))] * batch
    times = []
    for _ in range(runs):
        stream = engine.stream(prompt, max_new_tokens=3, eos_token_id=[])
        next(stream)  # the prefill
        start = time.perf_counter()
        next(stream)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/eagle_drafting.json")
    args = ap.parse_args()
    if min(args.batch) < 1 or min(args.nodes) < 2 or args.rounds < 1 or args.runs < 1:
        ap.error("--batch and --rounds and --runs must be positive, --nodes at least 2")
    model, tok = load(args.model)
    model = cast(model, getattr(torch, args.dtype), "cpu")
    engine = rewriter.optimize(model, tokenizer=tok, passes=[
        EagleDraft(weights=args.model, draft_vocab=4096, nodes=max(args.nodes))])
    program = EagleProgram.of(engine.ir)
    plain = rewriter.optimize(model, tokenizer=tok)
    rows = []
    with torch.inference_mode():
        for b in args.batch:
            step = step_ms(plain, b)
            for n in args.nodes:
                drafting_ms(program, b, n, 5)  # warm-up
                ms = statistics.median(drafting_ms(program, b, n, args.rounds) for _ in range(args.runs))
                rows.append({"batch": b, "nodes": n, "drafting_ms": ms, "plain_step_ms": step,
                             "in_plain_steps": ms / step})
                print(rows[-1], flush=True)
    print(tabulate([[r["batch"], r["nodes"], f"{r['drafting_ms']:.2f}", f"{r['plain_step_ms']:.1f}",
                     f"{r['in_plain_steps']:.3f}"] for r in rows],
                   ["batch", "nodes", "drafting ms a round", "plain step ms", "in plain steps"]))
    out = {"machine": machine(), "torch": torch.__version__, "dtype": args.dtype,
           "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
