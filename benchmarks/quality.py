"""Quality kept against cost saved, for pass pipelines on SmolLM2 or the default model.

    python benchmarks/quality.py [--model smollm2|default|PATH] [--pipelines unoptimized ...]
                                 [--dtype float32|bfloat16]
                                 [--quick] [--json benchmarks/results/quality.json]

Rows: pipelines; columns: perplexity (and ratio to the unoptimized model), greedy agreement
with the unoptimized model and mean first-divergence position, pass-key accuracy per
context length, forward passes and decoder layers per generated token, KV-cache bytes per
token, and CPU milliseconds per token at batch 1. See ``rewriter.api.eval``.
"""
from __future__ import annotations

import argparse
import time

import torch

import rewriter
from rewriter.models.checkpoints import cast
from rewriter.api.eval import EvalSettings, evaluate, format_table, settings_dict
from rewriter.passes import (FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU, Int4Weights, LayerSkip,
                             SelfSpeculative)

from common import describe, load, write_json

PIPELINES = {
    "unoptimized": [],
    "fusions": [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()],
    "LayerSkip(speedup=1.1)": [LayerSkip(speedup=1.1)],
    "LayerSkip(speedup=1.33)": [LayerSkip(speedup=1.33)],
    "LayerSkip(speedup=1.6)": [LayerSkip(speedup=1.6)],
    "LayerSkip(speedup=2.0)": [LayerSkip(speedup=2.0)],
    "SelfSpeculative(speedup=1.25)": [SelfSpeculative(speedup=1.25)],
    "Int4Weights": [Int4Weights()],
    "fusions+Int4Weights": [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE(), Int4Weights()],
    "fusions+Int4Weights(lm_head)": [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE(),
                                     Int4Weights(lm_head=True)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2', 'default' or a checkpoint path")
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights' and activations' dtype (Int4Weights is fast in bfloat16)")
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    ap.add_argument("--json", default="benchmarks/results/quality.json")
    args = ap.parse_args()
    model, tok = load(args.model)
    model = cast(model, getattr(torch, args.dtype))
    long_context = args.model != "default"  # SmolLM2: 8192 tokens; the default model: 1024
    settings = EvalSettings(
        passkey_lengths=(1024, 2048, 4096, 8192) if long_context else (256, 512, 1024),
        passkey_depths=(0.1, 0.5, 0.9) if long_context else EvalSettings.passkey_depths,
        passkey_trials=1 if long_context else 2)
    if args.quick:
        settings = EvalSettings(ppl_chunks=4, ppl_length=256, prompts=4,
                                passkey_lengths=settings.passkey_lengths[:1], passkey_trials=1)
    engines = {name: rewriter.optimize(model, passes=PIPELINES[name], tokenizer=tok)
               for name in args.pipelines}
    start = time.perf_counter()
    rows = evaluate(engines, tok, settings)
    header = describe()
    print(f"model {args.model}, {args.dtype}, {header['machine']}, {header['threads']} threads, "
          f"{header['date']}, {time.perf_counter() - start:.0f} s\n")
    print(format_table(rows))
    write_json(args.json, {**header, "model": args.model, "dtype": args.dtype,
                           "settings": settings_dict(settings), "rows": rows})


if __name__ == "__main__":
    main()
