"""One-query attention on a CPU in bfloat16: ATen's SDPA kernel against ``rewriter.sdpa``'s
grouped float32 path, alone and inside SmolLM2's plain decode.

    python benchmarks/decode_attention.py [--lengths 128 1024 4096] [--batch 1 4]
                                          [--steps 24] [--same 4] [--calls-only]
                                          [--json benchmarks/results/decode_attention.json]

1. The call alone, at SmolLM2's shapes (9 query heads over 3 KV heads of 64): ms of each
   (median of 200 calls), the kernel's with two queries beside it, and each one's largest
   difference from float32 SDPA on the same bfloat16 inputs, for every batch and cache
   length. The path is timed on every machine; "path taken: no" where ``sdpa`` leaves
   the call to the kernel here: too small (``_SMALL``), or the path measured no faster on
   this machine (``sdpa.path_taken``, printed above the table).
2. Plain greedy decode of SmolLM2 (its GGUF, bfloat16, torch backend): one prefill to each
   length, then ``--steps`` decode steps that alternate between the two paths (kernel,
   path, kernel, ...: the same cache, one token longer each step, so a drift of the
   machine hits both alike); tokens/s from each one's median step.
3. Whether the text changes: ``--same`` held-out code prompts of 128 tokens, 48 greedy
   tokens each, generated with each path; how many agree, and where the first
   difference falls.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

import rewriter
from rewriter.checkpoints import cast
import rewriter.sdpa as sdpa_module
from rewriter.sdpa import kernel_only, sdpa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import code_prompts, load  # noqa: E402  (benchmarks/ is not a package)
from step_time import machine  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def call_rows(lengths: list[int], batches: list[int]) -> list[dict]:
    rows = []
    for b in batches:
        for t in lengths:
            g = torch.Generator().manual_seed(t + b)
            q, k, v = (torch.randn(b, h, n, HEAD_DIM, generator=g).to(torch.bfloat16)
                       for h, n in ((HEADS, 1), (KV_HEADS, t), (KV_HEADS, t)))
            exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
            row = {"batch": b, "keys": t, "path_taken": _taken(b, t)}
            for name, ctx in (("kernel", kernel_only), ("path", path_forced)):
                with ctx():
                    out = sdpa(q, k, v, enable_gqa=True)
                    row[f"{name}_ms"] = _median_ms(lambda: sdpa(q, k, v, enable_gqa=True))
                row[f"{name}_err"] = (out.float() - exact).abs().max().item()
            two = torch.cat([q, q], 2)  # [B, Hq, 2, D]: the kernel with a second query
            row["kernel_two_queries_ms"] = _median_ms(
                lambda: F.scaled_dot_product_attention(two, k, v, enable_gqa=True))
            rows.append(row)
    return rows


def _taken(batch: int, keys: int) -> bool:
    """Whether ``sdpa`` computes a one-query step of this size itself on this machine, as
    a user's decode does (where the path is measured faster: ``sdpa.path_taken``); both
    columns are timed whatever it says (``kernel_only``, ``path_forced``)."""
    return batch * HEADS * keys >= sdpa_module._SMALL and sdpa_module.path_taken(torch.bfloat16)


@contextlib.contextmanager
def path_forced():
    """``sdpa`` takes its path for every call big enough, whatever it measured here."""
    saved = os.environ.get(sdpa_module.ENV)
    os.environ[sdpa_module.ENV] = "on"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[sdpa_module.ENV]
        else:
            os.environ[sdpa_module.ENV] = saved


def _median_ms(fn, n: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_rows(engine, tok, lengths: list[int], batches: list[int], steps: int) -> list[dict]:
    rows = []
    text = code_prompts(tok, max(batches), max(lengths))
    if min(map(len, text)) < max(lengths):
        raise SystemExit(f"the held-out text has no {max(batches)} prompts of {max(lengths)} tokens")
    for b in batches:
        for t in lengths:
            prompt = torch.tensor([ids[:t] for ids in text[:b]])  # [B, t]
            stream = engine.stream(prompt, max_new_tokens=steps + 3, eos_token_id=[])
            next(stream)  # prefill
            with path_forced():
                next(stream)  # a first step of each path, not timed
            with kernel_only():
                next(stream)
            times = {"kernel": [], "path": []}
            for i in range(steps):
                name = ("kernel", "path")[i % 2]
                with kernel_only() if name == "kernel" else path_forced():
                    start = time.perf_counter()
                    next(stream)
                    times[name].append(time.perf_counter() - start)
            kernel, path = (b / statistics.median(times[n]) for n in ("kernel", "path"))
            rows.append({"batch": b, "context": t, "path_taken": _taken(b, t),
                         "kernel_tok_s": kernel, "path_tok_s": path, "speedup": path / kernel})
            print(rows[-1], flush=True)
    return rows


def same_rows(engine, exact, tok, n: int) -> dict:
    """Greedy text of ``n`` code prompts, 48 tokens after 128: the two paths against each
    other, and each against the float32 model's (``exact``), which both approximate."""
    prompts = code_prompts(tok, n, 128)
    runs = {"kernel": [], "path": [], "float32": []}
    for ids in prompts:
        with kernel_only():
            runs["kernel"].append(engine.generate([ids], max_new_tokens=48, eos_token_id=[])[0, 128:])
        with path_forced():
            runs["path"].append(engine.generate([ids], max_new_tokens=48, eos_token_id=[])[0, 128:])
        runs["float32"].append(exact.generate([ids], max_new_tokens=48, eos_token_id=[])[0, 128:])
    return {"prompts": n, **{f"{a}_vs_{b}": _agreement(runs[a], runs[b])
                             for a, b in (("path", "kernel"), ("kernel", "float32"),
                                          ("path", "float32"))}}


def _agreement(a: list, b: list) -> dict:
    """How many texts are equal, and each one's first differing token (None: equal)."""
    first = [int(d[0]) if len(d := (x != y).nonzero()) else None for x, y in zip(a, b)]
    return {"same": sum(f is None for f in first), "first_difference": first}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed, half each path")
    ap.add_argument("--same", type=int, default=4, help="prompts whose greedy text is compared")
    ap.add_argument("--calls-only", action="store_true", help="the call alone (part 1), no model")
    ap.add_argument("--json", default="benchmarks/results/decode_attention.json")
    args = ap.parse_args()
    if min(args.lengths) < 1 or min(args.batch) < 1 or args.steps < 2 or args.same < 0:
        ap.error("--lengths and --batch must be positive, --steps at least 2, --same at least 0")
    results = {"machine": machine(), "path_pays": sdpa_module.path_taken(torch.bfloat16),
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d")}
    how = f"fixed by {sdpa_module.ENV}" if os.environ.get(sdpa_module.ENV, "auto").lower() != "auto" \
        else "as measured"
    print(f"{results['machine']}: one-query bfloat16 calls take sdpa's "
          f"{'path' if results['path_pays'] else 'kernel'} here ({how})")
    results["calls"] = call_rows(args.lengths, args.batch)
    print(tabulate([[r["batch"], r["keys"], _mark(r), f"{r['kernel_ms']:.3f}",
                     f"{r['kernel_two_queries_ms']:.3f}", f"{r['path_ms']:.3f}",
                     f"{r['kernel_ms'] / r['path_ms']:.2f}x", f"{r['kernel_err']:.1e}",
                     f"{r['path_err']:.1e}"] for r in results["calls"]],
                   ["batch", "keys", "path taken", "kernel ms", "kernel, 2 queries", "path ms",
                    "faster", "kernel err", "path err"]))
    if not args.calls_only:
        decode_part(args, results)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))


def _mark(row: dict) -> str:
    return "yes" if row["path_taken"] else "no: the kernel"


def decode_part(args, results: dict) -> None:
    """Parts 2 and 3: SmolLM2's decode, and its greedy text."""
    model, tok = load("smollm2")
    engine = rewriter.optimize(cast(model, torch.bfloat16, "cpu"), tokenizer=tok)
    tok = engine.tokenizer
    results["decode"] = decode_rows(engine, tok, args.lengths, args.batch, args.steps)
    print(tabulate([[r["batch"], r["context"], _mark(r), f"{r['kernel_tok_s']:.1f}",
                     f"{r['path_tok_s']:.1f}", f"{r['speedup']:.2f}x"] for r in results["decode"]],
                   ["batch", "context", "path taken", "kernel tok/s", "path tok/s", "speed-up"]))
    if args.same:
        exact = rewriter.optimize(load("smollm2")[0], tokenizer=tok)  # float32: cast changed model
        results["same"] = same_rows(engine, exact, tok, args.same)
        print("greedy text, 48 tokens after 128:", json.dumps(results["same"]))


if __name__ == "__main__":
    main()
