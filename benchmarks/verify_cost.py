"""What verifying S tokens a round costs, in decode steps: the curve a tree's size is paid on.

    python benchmarks/verify_cost.py [--model smollm2] [--dtype bfloat16] [--device cuda]
        [--sizes 1 2 4 8 16 24 32 48 63] [--runs 15] [--repeats 3]
        [--json benchmarks/results/verify_cost.json]

``verify_cost`` of the runtime's measurer (``rewriter.runtime.measurer``) on the model as
``optimize`` gives it (the default passes, the torch backend): the decode program over S tokens a row at batch 1 after a
64-token prompt, over its time on one token (medians of ``--runs`` interleaved calls). The
whole curve is measured ``--repeats`` times; the table prints each size's median and
range. A tree of S nodes verifies S tokens (the root included); its drafting, acceptance
and K/V moves come on top (``docs/benchmarks.md``, "Verify cost").
"""
from __future__ import annotations

import argparse
import statistics

import torch
from tabulate import tabulate

import rewriter
from rewriter.runtime.measurer import RuntimeMeasurer
from rewriter.models.checkpoints import cast, load_model
from rewriter.values import context_length

from common import describe, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a GGUF file, 'smollm2' or 'default'")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="timed from CUDA graphs on cuda, as the engine's rounds run there")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32, 48, 63])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/verify_cost.json")
    args = ap.parse_args()
    if min(args.sizes) < 1 or args.runs < 1 or args.repeats < 1:
        ap.error("--sizes, --runs and --repeats must be >= 1")
    model, tok = load_model(args.model)
    model = cast(model, getattr(torch, args.dtype), args.device)
    ir = rewriter.optimize(model, tokenizer=tok).ir
    most = max(args.sizes)
    context = context_length(ir.info.get("config", {}))
    if most >= context:
        ap.error(f"--sizes: {most} tokens do not fit {args.model}'s context of {context}")
    measurer = RuntimeMeasurer("torch", args.device)
    curves = [measurer.verify_cost(ir, most, runs=args.runs) for _ in range(args.repeats)]  # [0, 1, c(2), ..]
    rows = []
    for s in sorted(set(args.sizes)):
        seen = [c[s] for c in curves]
        rows.append({"tokens": s, "median": statistics.median(seen), "low": min(seen), "high": max(seen)})
    print(tabulate([[r["tokens"], f"{r['median']:.3f}", f"{r['low']:.3f}-{r['high']:.3f}"] for r in rows],
                   headers=["tokens verified", "decode steps", "range"]))
    header = describe(args.device)
    print(f"\n{args.model}, {args.dtype}, {header['machine']}, {header['threads']} threads, {header['date']}")
    write_json(args.json, {**header, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
