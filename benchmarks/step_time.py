"""Decode-step time after a long prompt: pipelines side by side, interleaved, one process.

    python benchmarks/step_time.py [--model smollm2] [--dtype float32] [--length 4096]
        [--batch 1] [--steps 30] [--rounds 2] [--pipeline NAME=SPEC[;SPEC...] ...]
        [--json benchmarks/results/step_time.json]

Each pipeline is ``rewriter.from_pretrained(model, passes=[from_spec(s) ...])`` (an empty
spec list is the dense model); a ``NAME=`` prefix names it in the table. Each round
prefills every pipeline with the same random prompt of ``length`` tokens (minus the steps)
and times ``steps`` decode steps one by one (``stream``): the figure is the median step
after the first two, and a pipeline's ratio is the first pipeline's median over its own
(> 1: faster), per round. Rounds interleave the pipelines (in reverse order on odd
rounds), so a machine that slows down slows all of them. On the CPU, the torch backend.
Without ``--pipeline`` (SmolLM2 only): dense against DuoAttention with SmolLM2's gates
at its threshold and at sparsity 0.5 (sinks 16, window 240).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.measure.machine import machine
from rewriter.passes import from_spec

DUO = "duo_attention:gates=smollm2,sinks=16,window=240"
DEFAULT = ["dense=", f"duo threshold={DUO}", f"duo sparsity 0.5={DUO},sparsity=0.5"]


def pipeline(text: str) -> tuple[str, list]:
    """``NAME=SPEC;SPEC`` -> (name, passes). The name is everything before the first ``=``
    that comes before any ``:`` (a spec's own ``key=value`` comes after its ``:``); without
    one the text names itself. Raises ValueError for a bad name or spec."""
    head, eq, rest = text.partition("=")
    named = bool(eq) and ":" not in head
    name = head.strip() if named else text.strip()
    if named and (not name or ";" in name):
        raise ValueError(f"pipeline {text!r}: the name before '=' is empty or holds ';'")
    if not named:
        rest = text
        if not rest.strip(" ;"):
            raise ValueError(f"pipeline {text!r}: no passes and no name (dense is 'dense=')")
    specs = [s for s in rest.split(";") if s.strip()]
    return name, [from_spec(s) for s in specs]


def pipelines(ap: argparse.ArgumentParser, args) -> dict[str, list]:
    """Every ``--pipeline`` parsed before any model loads: name -> passes."""
    texts = args.pipeline
    if not texts:
        if args.model != "smollm2":
            ap.error("--pipeline is needed for a model other than smollm2 (the default "
                     "pipelines use SmolLM2's DuoAttention gates)")
        texts = DEFAULT
    out = {}
    for text in texts:
        try:
            name, passes = pipeline(text)
        except ValueError as e:
            ap.error(str(e))
        if name in out:
            ap.error(f"two pipelines are named {name!r}")
        out[name] = passes
    return out


def step_times(engine, prompt: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps after prefilling ``prompt`` ``[B, S]``."""
    stream = engine.stream(prompt, max_new_tokens=steps + 1, eos_token_id=[])
    next(stream)  # the prefill and its first token
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        next(stream)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--length", type=int, default=4096, help="prompt + decoded tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pipeline", action="append", help="NAME=SPEC[;SPEC...] (repeatable)")
    ap.add_argument("--json", default="benchmarks/results/step_time.json")
    args = ap.parse_args()
    if args.steps < 3 or args.length <= args.steps + 1 or args.rounds < 1 or args.batch < 1:
        ap.error("--steps must be at least 3, --length longer than the steps, --rounds and "
                 "--batch at least 1")
    engines = {name: rewriter.from_pretrained(args.model, passes=passes, dtype=args.dtype)
               for name, passes in pipelines(ap, args).items()}
    vocab = next(iter(engines.values())).config["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(min(100, vocab - 1), vocab, (args.batch, args.length - args.steps - 1),
                           generator=generator)  # [B, S]
    medians = {name: [] for name in engines}
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
        for name in order:
            gc.collect()
            times = step_times(engines[name], prompt, args.steps)
            medians[name].append(statistics.median(times[2:]) * 1000)
            print(f"round {round_}: {name} {medians[name][-1]:.1f} ms a step", flush=True)
    first = next(iter(medians.values()))
    rows = [[name, " / ".join(f"{m:.1f}" for m in ms),
             " / ".join(f"{a / m:.2f}x" for a, m in zip(first, ms))] for name, ms in medians.items()]
    print(tabulate(rows, headers=["pipeline", "ms a step (per round)", "speed vs first"]))
    out = {"model": args.model, "dtype": args.dtype, "device": "cpu", "machine": machine(),
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "length": args.length, "batch": args.batch,
           "steps": args.steps, "rounds": args.rounds,
           "pipelines": args.pipeline or DEFAULT, "median_ms": medians}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
