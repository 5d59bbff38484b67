"""Where a speculative round's time goes: verification, drafting, acceptance, in plain steps.

    python benchmarks/round_phases.py [--model smollm2] [--dtype bfloat16]
                                      [--strategy hydra|eagle] [--nodes 16] [--prompts chat|code]
                                      [--samples 8] [--new 48] [--runs 2]
                                      [--json benchmarks/results/round_phases.json]

The draft as a user gets it (``hydra``: ``HydraHeads(weights=MODEL, draft_vocab=4096)``,
its auto tree and copied chains; ``eagle``: ``EagleDraft(weights=MODEL, draft_vocab=4096,
nodes=N)``), batch 1, generating to the end of each answer, and plain decode on the same
prompts just before it. The rounds' methods are wrapped with a clock
(``tree_decoding._TreeRounds.step``, ``draft_from``, ``accept``, ... and ``EagleRows``'
``call``, ``_level`` and ``catch_up``), so each phase's time a round can be set against
a plain step: what a round costs beyond verifying, and the speed-up the accepted tokens
would give were verification a round's only cost (accepted / verification's steps: no
drafting, acceptance or prefill; JSON key ``free_drafting_speedup``, its name before). A plain step is the
median of plain decode's steps on the same prompts (prefill excluded); tok/s and the
speed-up count whole generations, prefill included, as ``speculative.py`` does. Nested phases are
included in their callers' (``eagle call`` inside ``draft_from``, ``eagle level`` inside
``eagle call``); the EAGLE catch-up is a phase of its own, beside drafting. "the rest" is
the round less its top phases. Only time inside rounds counts (not the first token's
drafting or the catch-up over the prompt). The clocks add a few microseconds a call.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.checkpoints import cast
from rewriter.passes import EagleDraft, HydraHeads
from rewriter.runtime import eagle_rows, packed_linear, tree_decoding
from rewriter.sdpa import path_taken

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import load, made_tokens, prompt_sets, strategy_engine  # noqa: E402
from step_time import machine  # noqa: E402

PHASES = [(tree_decoding._TreeRounds, "round", "round"),
          (tree_decoding._TreeRounds, "step", "verification"),
          (tree_decoding._TreeRounds, "draft_from", "drafting"),
          (eagle_rows.EagleRows, "call", "eagle call"),
          (eagle_rows.EagleRows, "_level", "eagle level"),
          (eagle_rows.EagleRows, "catch_up", "eagle catch-up"),
          (tree_decoding._TreeRounds, "accept", "acceptance"),
          (tree_decoding._TreeRounds, "compact", "K/V moves"),
          (tree_decoding._TreeRounds, "_adapt", "adaptive tree")]


@contextlib.contextmanager
def clocked(seconds: dict, calls: Counter):
    """Every phase's method wrapped with a clock while inside (put back after). A phase is
    counted only inside a round: the first token's drafting and the draft's catch-up over
    each prompt (``_TreeRounds.first``) are a generation's, not a round's."""
    saved, inside = [], [0]
    try:
        for cls, name, label in PHASES:
            original = cls.__dict__.get(name, getattr(cls, name))
            saved.append((cls, name, cls.__dict__.get(name)))

            def timed(*a, _f=original, _label=label, **kw):
                outer = _label == "round"
                inside[0] += outer
                start = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    inside[0] -= outer
                    if outer or inside[0]:
                        seconds[_label] += time.perf_counter() - start
                        calls[_label] += 1
            setattr(cls, name, functools.wraps(original)(timed))
        yield
    finally:
        for cls, name, had in reversed(saved):
            if had is None:
                delattr(cls, name)
            else:
                setattr(cls, name, had)


def generated(engine, prompts, new: int, eos: bool) -> tuple[float, int]:
    """(seconds, tokens) of generating every prompt in turn (batch 1); with ``eos`` up to the
    model's end of sequence, counted to it (as ``speculative.timed`` counts a chat answer)."""
    stop = {} if eos else {"eos_token_id": []}
    start = time.perf_counter()
    outs = [engine.generate(p, max_new_tokens=new, **stop) for p in prompts]
    return time.perf_counter() - start, made_tokens(engine, prompts, outs, eos)


def plain_step(plain, prompts, new: int) -> float:
    """Seconds of a plain decode step: the median over every prompt's steps after its prefill."""
    times = []
    for p in prompts:
        stream = plain.stream(p, max_new_tokens=new, eos_token_id=[])
        next(stream)  # the prefill
        while True:
            start = time.perf_counter()
            if next(stream, None) is None:
                break
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--strategy", default="hydra", choices=["hydra", "eagle"])
    ap.add_argument("--nodes", type=int, default=16, help="the EAGLE tree's tokens")
    ap.add_argument("--prompts", default="chat", choices=["chat", "code"])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/round_phases.json")
    args = ap.parse_args()
    if args.samples < 1 or args.new < 2 or args.runs < 1 or not 2 <= args.nodes <= 32:
        ap.error("--samples and --runs must be positive, --new at least 2, --nodes in [2, 32]")
    model, tok = load(args.model)
    model = cast(model, getattr(torch, args.dtype), "cpu")
    plain = rewriter.optimize(model, tokenizer=tok)
    tok = plain.tokenizer
    draft = HydraHeads(weights=args.model, draft_vocab=4096) if args.strategy == "hydra" else \
        EagleDraft(weights=args.model, draft_vocab=4096, nodes=args.nodes)
    engine = strategy_engine(model, tokenizer=tok, passes=[draft])
    prompts = prompt_sets(plain, tok, 1, args.samples)[args.prompts]
    out = {"machine": machine(), "torch": torch.__version__, "dtype": args.dtype,
           "sdpa_path": path_taken(getattr(torch, args.dtype)),
           "packed_linears": args.dtype == "bfloat16" and packed_linear._machine_ok() and packed_linear.pays(),
           "strategy": args.strategy, "nodes": args.nodes if args.strategy == "eagle" else None,
           "prompts": args.prompts, "samples": len(prompts), "date": time.strftime("%Y-%m-%d"),
           "runs": []}
    for run in range(args.runs):
        seconds, calls = defaultdict(float), Counter()
        for e in (plain, engine):  # every prompt's shapes, before any is timed
            generated(e, prompts, 4, False)
        t, made = generated(plain, prompts, args.new, args.prompts == "chat")
        plain_rate = made / t
        engine.stats.clear()
        with clocked(seconds, calls):
            t, made = generated(engine, prompts, args.new, args.prompts == "chat")
        rate, stats = made / t, engine.stats
        rounds = calls["round"]
        step = plain_step(plain, prompts, args.new)
        accepted = 1 + stats.get("accepted", 0) / stats["row_rounds"]
        phases = {k: seconds[k] / rounds / step for k in seconds}
        top = ("verification", "drafting", "eagle catch-up", "acceptance", "K/V moves", "adaptive tree")
        phases["the rest"] = phases["round"] - sum(phases.get(k, 0.0) for k in top)
        out["runs"].append({"plain_tok_s": plain_rate, "plain_step_ms": step * 1e3, "tok_s": rate, "speedup": rate / plain_rate,
                            "accepted": accepted, "rounds": rounds,
                            "phases_in_plain_steps": phases,
                            "ms_a_round": {k: v * step * 1e3 for k, v in phases.items()},
                            "free_drafting_speedup": accepted / phases["verification"]})
        r = out["runs"][-1]
        print(f"run {run + 1}: plain {plain_rate:.1f} tok/s (a step {step * 1e3:.1f} ms), {args.strategy} {rate:.1f} tok/s, "
              f"{r['speedup']:.2f}x, {accepted:.2f} tokens a round; verification alone: "
              f"{r['free_drafting_speedup']:.2f}x")
        print(tabulate([[k, f"{r['ms_a_round'][k]:.2f}", f"{v:.3f}"] for k, v in
                        sorted(phases.items(), key=lambda kv: -kv[1])],
                       ["phase", "ms a round", "plain steps a round"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
