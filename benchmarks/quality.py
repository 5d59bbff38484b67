"""Quality kept against cost saved, for pass pipelines on the default model.

    python benchmarks/quality.py [--model default] [--quick] [--json benchmarks/results/quality.json]

Rows: pipelines; columns: perplexity (and ratio to the unoptimized model), greedy agreement
with the unoptimized model and mean first-divergence position, pass-key accuracy per
context length, forward passes and decoder layers per generated token, KV-cache bytes per
token, and CPU milliseconds per token at batch 1. See ``rewriter.eval``.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import rewriter
from rewriter.checkpoints import load_hf_model, load_tokenizer
from rewriter.eval import EvalSettings, evaluate, format_table, settings_dict
from rewriter.passes import LayerSkip

PIPELINES = {
    "unoptimized": [],
    "LayerSkip(speedup=1.33)": [LayerSkip(speedup=1.33)],
    "LayerSkip(speedup=1.6)": [LayerSkip(speedup=1.6)],
    "LayerSkip(speedup=2.0)": [LayerSkip(speedup=2.0)],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="checkpoint directory or 'default'")
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    ap.add_argument("--json", default="benchmarks/results/quality.json")
    args = ap.parse_args()

    model, tok = load_hf_model(args.model), load_tokenizer(args.model)
    if tok is None:
        raise SystemExit(f"{args.model}: the harness needs the checkpoint's tokenizer.json")
    settings = EvalSettings(ppl_chunks=4, prompts=4, passkey_trials=1) if args.quick else EvalSettings()
    engines = {name: rewriter.optimize(model, passes=passes) for name, passes in PIPELINES.items()}
    start = time.perf_counter()
    rows = evaluate(engines, tok, settings)
    print(f"model {args.model}, {torch.get_num_threads()} CPU threads, "
          f"{time.perf_counter() - start:.0f} s\n")
    print(format_table(rows))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "model": args.model, "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
        "settings": settings_dict(settings), "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
