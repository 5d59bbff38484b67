"""Decode speed: ``generate`` of the torch-backend runtime against Hugging Face ``generate``.

    python benchmarks/decode.py [--model default] [--prompt 128] [--new 128] [--batch 1 8]
                                [--json benchmarks/results/decode.json]

Both generate greedily, the same number of tokens (no early stop), from the same held-out
prompts, in the same process. Each figure is the median of ``--repeat`` timed runs after a
warm-up. Target (issue 3): at least 1.5x Hugging Face's tokens/s at batch 1 on the CPU.
Also: time to ``rewriter.load`` an artifact against time to ``optimize`` from scratch.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.checkpoints import load_hf_model, load_tokenizer


def prompts(path: str, batch: int, length: int) -> torch.Tensor:
    """``batch`` held-out code chunks of ``length`` tokens (random ids without a tokenizer)."""
    tok = load_tokenizer(path)
    if tok is None:
        return torch.randint(1, 1000, (batch, length), generator=torch.Generator().manual_seed(0))
    from rewriter.corpus import load_corpus
    ids = []
    for _, text in load_corpus("heldout"):
        ids += tok.encode(text).ids[1:]  # no BOS in the middle of the stream
        if len(ids) >= batch * length * 4:
            break
    stride = len(ids) // batch
    return torch.tensor([ids[b * stride:b * stride + length] for b in range(batch)])


def timed(fn, repeat: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (allocates the cache, fills allocator pools)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="checkpoint directory or 'default'")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default="benchmarks/results/decode.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_hf_model(args.model)
    opt = rewriter.from_pretrained(args.model)
    rows, results = [], {"machine": platform.processor() or platform.machine(),
                         "threads": torch.get_num_threads(), "torch": torch.__version__,
                         "model": args.model, "parameters": opt.ir.num_params(),
                         "prompt": args.prompt, "new_tokens": args.new, "runs": []}
    for b in args.batch:
        ids = prompts(args.model, b, args.prompt)
        ours_s, ours = timed(lambda: opt.generate(ids, max_new_tokens=args.new, eos_token_id=[]),
                             args.repeat)
        with torch.inference_mode():
            hf_s, hf = timed(lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                min_new_tokens=args.new, do_sample=False), args.repeat)
        run = {"batch": b, "rewriter_tok_s": b * args.new / ours_s, "hf_tok_s": b * args.new / hf_s,
               "speedup": hf_s / ours_s, "same_tokens": bool(torch.equal(ours, hf))}
        results["runs"].append(run)
        rows.append([b, f"{run['hf_tok_s']:.0f}", f"{run['rewriter_tok_s']:.0f}",
                     f"{run['speedup']:.2f}x", run["same_tokens"]])

    t = time.perf_counter()
    fresh = rewriter.from_pretrained(args.model)
    optimize_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        fresh.save(Path(d) / "a")
        t = time.perf_counter()
        rewriter.load(Path(d) / "a")
        load_s = time.perf_counter() - t
    results.update(optimize_s=optimize_s, load_s=load_s)

    print(f"model {args.model}: {opt.ir.num_params() / 1e6:.2f}M params, prompt {args.prompt}, "
          f"{args.new} new tokens, {torch.get_num_threads()} threads\n")
    print(tabulate(rows, headers=["batch", "HF generate tok/s", "rewriter tok/s", "speedup",
                                  "same greedy tokens"]))
    print(f"\nrewriter.load of the artifact: {load_s:.2f} s; optimize from the checkpoint: "
          f"{optimize_s:.2f} s ({optimize_s / load_s:.1f}x longer)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
