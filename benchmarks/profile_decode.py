"""Where a decode step's time goes: torch.profiler over batch-1 decode steps of the runtime.

    python benchmarks/profile_decode.py [--model smollm2] [--passes fuse_qkv ...] [--tokens 64]
                                        [--dtype float32|bfloat16]
                                        [--json benchmarks/results/profile_decode.json]

Prints the ATen ops by self CPU time (summed over the profiled tokens, divided per token),
grouped into matrix products, attention, norms, RoPE, elementwise and copies, and the rest
of the wall time (Python, fx program dispatch, sampling): what a faster step must cut.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

import rewriter
from rewriter.checkpoints import cast
from rewriter.passes import from_spec

GROUPS = {  # first match wins
    "matrix products": ("addmm", "mm", "matmul", "linear", "bmm", "_weight_int4pack_mm"),
    "attention": ("scaled_dot_product", "_flash", "_efficient_attention", "softmax"),
    "norms": ("rms_norm", "layer_norm", "rsqrt", "pow", "mean"),
    "RoPE": ("cat", "neg", "chunk", "slice"),
    "copies and views": ("copy_", "index", "view", "transpose", "reshape", "contiguous",
                         "expand", "as_strided", "select", "unsqueeze", "_to_copy", "to", "fill"),
    "elementwise": ("mul", "add", "silu", "sub", "div", "where", "masked"),
}


def group_of(name: str) -> str:
    short = name.removeprefix("aten::")
    for group, keys in GROUPS.items():
        if any(short == k or short.startswith(k) for k in keys):
            return group
    return "other ops"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--passes", nargs="*", default=[], help="pass specs, e.g. fuse_qkv")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default="benchmarks/results/profile_decode.json")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from quickstart import load
    model, tok = load(args.model)
    model = cast(model, getattr(torch, args.dtype))
    opt = rewriter.optimize(model, [from_spec(s) for s in args.passes], tokenizer=tok)
    ids = [opt.tokenizer.encode("Once upon a time, in a small village by the sea,").ids]
    opt.generate(ids, max_new_tokens=8, eos_token_id=[])  # warm-up: lowering, allocations
    start = time.perf_counter()
    opt.generate(ids, max_new_tokens=args.tokens, eos_token_id=[])
    wall_ms = 1e3 * (time.perf_counter() - start) / args.tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.generate(ids, max_new_tokens=args.tokens, eos_token_id=[])
    groups, ops = defaultdict(float), []
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        ms = e.self_cpu_time_total / 1e3 / args.tokens
        groups[group_of(e.key)] += ms
        ops.append((e.key, e.count / args.tokens, ms))
    total_ops = sum(groups.values())
    rows = [[g, f"{ms:.2f}", f"{100 * ms / wall_ms:.0f}%"] for g, ms in
            sorted(groups.items(), key=lambda kv: -kv[1])]
    rows.append(["(not in ATen ops: Python, fx dispatch, sampling)",
                 f"{wall_ms - total_ops:.2f}", f"{100 * (wall_ms - total_ops) / wall_ms:.0f}%"])
    print(f"{args.model}, {args.dtype}, passes {args.passes or 'none'}, batch 1, {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads: {wall_ms:.2f} ms per token (unprofiled run)\n")
    print(tabulate(rows, headers=["group", "ms / token", "share"]))
    top = sorted(ops, key=lambda o: -o[2])[:15]
    print("\n" + tabulate([[k, f"{c:.0f}", f"{ms:.3f}"] for k, c, ms in top],
                          headers=["ATen op", "calls / token", "self ms / token"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "model": args.model, "dtype": args.dtype, "passes": args.passes, "tokens": args.tokens,
        "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
        "wall_ms_per_token": wall_ms, "groups_ms_per_token": dict(groups),
        "top_ops": [{"op": k, "calls_per_token": c, "self_ms_per_token": ms} for k, c, ms in top]},
        indent=1))


if __name__ == "__main__":
    main()
