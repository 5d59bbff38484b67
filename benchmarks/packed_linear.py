"""bfloat16 linears on a CPU: ``F.linear`` against weights packed once for oneDNN
(``runtime.packed_linear``), alone and inside a model's plain decode.

    python benchmarks/packed_linear.py [--model smollm2] [--batch 1 4] [--lengths 128 1024]
                                       [--steps 24] [--rounds 3] [--same 8]
                                       [--json benchmarks/results/packed_linear.json]

1. The products alone, at SmolLM2's shapes, for 1, 4 and 16 rows: ms of each (median of
   200 calls; the weight stays in cache, so this is the per-call cost, not a step's).
2. Plain greedy decode of ``--model`` (SmolLM2's GGUF, or the shipped default model;
   bfloat16, torch backend): two engines of the
   same model, lowered with ``REWRITER_PACKED_LINEAR=off`` and ``on``; each round prefills
   both to every length and times ``--steps`` decode steps of each, the two alternating
   in turn (the order reversed on odd rounds); tokens/s from the median step, the ratio
   per round, and the median of the rounds.
3. Whether the text changes: ``--same`` held-out code prompts of 128 tokens, 48 greedy
   tokens each, with each engine.
"""
from __future__ import annotations

import argparse
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
from rewriter.runtime import packed_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_attention import _median_ms  # noqa: E402  (benchmarks/ is not a package)
from speculative import load, spread_code_prompts  # noqa: E402
from step_time import machine  # noqa: E402

# SmolLM2's linears: q and o, k and v, gate and up, down, the LM head ([out, in])
SHAPES = {"q, o": (576, 576), "k, v": (192, 576), "gate, up": (1536, 576),
          "down": (576, 1536), "LM head": (49152, 576)}


def product_rows() -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, (out, inner) in SHAPES.items():
        w = torch.randn(out, inner, generator=g).to(torch.bfloat16)
        packed = packed_linear.pack(w)
        for m in (1, 4, 16):
            x = torch.randn(m, inner, generator=g).to(torch.bfloat16)
            n = 40 if out > 10000 else 200
            plain = _median_ms(lambda: F.linear(x, w), n)
            fast = _median_ms(lambda: packed_linear.linear_packed(x, packed), n)
            rows.append({"weight": name, "shape": [out, inner], "rows": m, "linear_ms": plain,
                         "packed_ms": fast, "speedup": plain / fast,
                         "equal": torch.equal(F.linear(x, w), packed_linear.linear_packed(x, packed))})
            print(rows[-1], flush=True)
    return rows


def engines(model, tok) -> dict:
    """The same model lowered both ways (the setting is read when programs are lowered)."""
    out = {}
    saved = os.environ.get(packed_linear.ENV)
    try:
        for setting in ("off", "on"):
            os.environ[packed_linear.ENV] = setting
            engine = rewriter.optimize(model, tokenizer=tok)
            engine._lowered()  # lowered now, under this setting
            out[setting] = engine
    finally:
        if saved is None:
            os.environ.pop(packed_linear.ENV, None)
        else:
            os.environ[packed_linear.ENV] = saved
    packed = any(n.target is packed_linear.linear_packed
                 for n in out["on"]._lowered()["decode"].graph.nodes)
    if not packed:
        raise SystemExit("this machine's torch or CPU has no oneDNN bfloat16 linear: nothing to compare")
    return out


def decode_rows(runs: dict, tok, lengths: list[int], batches: list[int], steps: int,
                rounds: int) -> list[dict]:
    text = spread_code_prompts(tok, max(batches), max(lengths))
    if min(map(len, text)) < max(lengths):
        raise SystemExit(f"the held-out text has no {max(batches)} prompts of {max(lengths)} tokens")
    rows = []
    for b in batches:
        for t in lengths:
            prompt = torch.tensor([ids[:t] for ids in text[:b]])  # [B, t]
            ratios, rates = [], {"off": [], "on": []}
            for r in range(rounds):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                streams = {s: runs[s].stream(prompt, max_new_tokens=steps + 2, eos_token_id=[])
                           for s in order}
                for s in order:
                    next(streams[s])  # the prefill
                    next(streams[s])  # a first step, not timed
                times = {s: [] for s in order}
                for _ in range(steps):
                    for s in order:
                        start = time.perf_counter()
                        next(streams[s])
                        times[s].append(time.perf_counter() - start)
                for s in order:
                    rates[s].append(b / statistics.median(times[s]))
                ratios.append(rates["on"][-1] / rates["off"][-1])
            rows.append({"batch": b, "context": t, "off_tok_s": statistics.median(rates["off"]),
                         "on_tok_s": statistics.median(rates["on"]), "speedup": statistics.median(ratios),
                         "speedups": ratios})
            print(rows[-1], flush=True)
    return rows


def same_rows(runs: dict, tok, n: int) -> dict:
    prompts = spread_code_prompts(tok, n, 128)
    texts = {s: [runs[s].generate([ids[:128]], max_new_tokens=48, eos_token_id=[])[0, 128:]
                 for ids in prompts] for s in ("off", "on")}
    first = [int(d[0]) if len(d := (a != b).nonzero()) else None for a, b in zip(texts["off"], texts["on"])]
    return {"prompts": n, "same": sum(f is None for f in first), "first_difference": first}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 or default (the shipped model)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--same", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/packed_linear.json")
    args = ap.parse_args()
    if min(args.batch) < 1 or min(args.lengths) < 1 or args.steps < 3 or args.rounds < 1 or args.same < 0:
        ap.error("--batch, --lengths and --rounds must be positive, --steps at least 3, --same not negative")
    if not packed_linear._machine_ok():
        raise SystemExit("this machine's torch or CPU has no oneDNN bfloat16 linear: nothing to compare")
    out = {"model": args.model, "machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d"), "probe_chooses_packing": packed_linear._measure()}
    with torch.inference_mode():
        out["products"] = product_rows()
        model, tok = load(args.model)
        runs = engines(cast(model, torch.bfloat16, "cpu"), tok)
        tok = runs["on"].tokenizer  # the tokenizer as the benchmarks' prompt helpers read it
        out["decode"] = decode_rows(runs, tok, args.lengths, args.batch, args.steps, args.rounds)
        out["same"] = same_rows(runs, tok, args.same) if args.same else None
    print(f"\n{out['machine']}, torch {out['torch']}, {out['threads']} threads; "
          f"the probe chooses packing here: {out['probe_chooses_packing']}\n")
    print(tabulate([[r["weight"], "x".join(map(str, r["shape"])), r["rows"], f"{r['linear_ms']:.3f}",
                     f"{r['packed_ms']:.3f}", f"{r['speedup']:.2f}x", r["equal"]] for r in out["products"]],
                   ["weight", "[out, in]", "rows", "F.linear ms", "packed ms", "packed faster", "equal"]))
    print()
    print(tabulate([[r["batch"], r["context"], f"{r['off_tok_s']:.1f}", f"{r['on_tok_s']:.1f}",
                     f"{r['speedup']:.2f}x", " ".join(f"{x:.2f}" for x in r["speedups"])]
                    for r in out["decode"]],
                   ["batch", "context", "F.linear tok/s", "packed tok/s", "speed-up", "per round"]))
    if out["same"]:
        print(f"\nsame greedy text: {out['same']['same']}/{out['same']['prompts']} "
              f"(first differences: {out['same']['first_difference']})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
