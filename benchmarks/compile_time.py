"""Compile time: trace, lift and pass-pipeline time for Llama configs of 2, 8 and 32 layers.

    python benchmarks/compile_time.py [--layers 2 8 32] [--json benchmarks/results/compile_time.json]

Target (issue 2): everything after tracing (lift + passes + verification) under one second
for 32 layers on a 2-core CPU. Each figure is the median of ``--repeat`` runs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate
from transformers import LlamaConfig, LlamaForCausalLM

import rewriter
from rewriter.frontend.annotate import annotate
from rewriter.frontend.lift import Lifter
from rewriter.frontend.trace import trace
from rewriter.ir.core import IR
from rewriter.ir.layers import layer_spans
from rewriter.ir.shapes import lm_input_specs, propagate_shapes
from rewriter.ir.verify import verify
from rewriter.ir.pass_manager import run_pipeline
from rewriter.passes import LayerSkip

from common import describe, write_json


def llama(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


def one_run(model) -> dict[str, float]:
    t0 = time.perf_counter()
    traced = trace(model)
    t1 = time.perf_counter()
    lifter = Lifter(traced)
    gm = lifter.run(causal_lm=True)
    annotate(gm, traced.scope_prefix, lifter.layer_container)
    info = {"family": "llama", "causal_lm": True, "config": model.config.to_dict(),
            "inputs": lm_input_specs(), "lift_report": lifter.report}
    propagate_shapes(gm, info["inputs"])
    ir = IR(gm, info)
    info["layers"] = layer_spans(gm)
    verify(ir)
    t2 = time.perf_counter()
    run_pipeline(ir, [LayerSkip(speedup=1.5)])
    t3 = time.perf_counter()
    rewriter.optimize(model, passes=[LayerSkip(speedup=1.5)])  # end to end, dump snapshots too
    t4 = time.perf_counter()
    return {"trace_s": t1 - t0, "lift_s": t2 - t1, "passes_s": t3 - t2, "after_trace_s": t3 - t1,
            "optimize_s": t4 - t3}


def main():
    ap = argparse.ArgumentParser(description="trace/lift/pass time per Llama depth")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/compile_time.json")
    args = ap.parse_args()
    rows, results = [], []
    for n in args.layers:
        model = llama(n)
        runs = [one_run(model) for _ in range(args.repeat)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append({"layers": n, **med})
        ok = "yes" if med["after_trace_s"] < 1.0 else "NO"
        rows.append([n, f"{med['trace_s']:.2f}", f"{med['lift_s']:.3f}", f"{med['passes_s']:.3f}",
                     f"{med['after_trace_s']:.3f}", ok, f"{med['optimize_s']:.2f}"])
    meta = {**describe(), "rewriter": rewriter.__version__}
    print(f"{meta['machine']}, {meta['threads']} threads, {meta['date']}\n")
    print(tabulate(rows, headers=["layers", "trace s", "lift s", "LayerSkip(1.5) s",
                                  "after trace s", "< 1 s", "optimize() s"]))
    write_json(args.json, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
