"""Sampled decoding: what choosing a token costs, plain and in the draft heads' sampled tree
rounds, "before" (top-k and top-p over the whole sorted vocabulary, tokens drawn by
``torch.multinomial``) against "after" (top-k and top-p among the 256 largest logits first,
``runtime.sampling.CANDIDATES``, and draws by the inverse cumulative distribution,
``sampling.draw``).

    python benchmarks/sampled_decode.py [--model smollm2] [--dtype bfloat16] [--new 48]
                                        [--samples 8] [--runs 3]
                                        [--json benchmarks/results/sampled_decode.json]

1. ``warp`` and a draw from its softmax on the model's own logits (its answers to the eval's
   chat questions), per call of 1 and 16 rows, both ways, and whether the two keep the
   same tokens.
2. Whole generations of ``--new`` tokens for the eval's chat questions (code prompts for a
   model without a chat template; past the end of an
   answer: the same number of tokens both ways; sampled answers end at random), batch 1:
   plain decode and the Hydra heads as a user gets them (``HydraHeads(weights=MODEL,
   draft_vocab=4096)``: their auto tree and copied chains, sampled rounds lossless in
   distribution), each both ways, their runs interleaved; tokens a second are medians of
   ``--runs``, each run with its own seeds. The two ways draw differently, so their texts,
   and the heads' tokens a round, differ by chance: ms a round compares the heads' rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.checkpoints import cast
from rewriter.passes import HydraHeads
from rewriter.runtime import packed_linear, sampling
from rewriter.runtime.settings import GenerationSettings
from rewriter.sdpa import path_taken

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative import load, made_tokens, prompt_sets, strategy_engine  # noqa: E402
from step_time import machine  # noqa: E402

# (temperature, top_k, top_p): Hugging Face's defaults (top-k alone: no sort to save, only
# the draw), its default top-k with a common top-p, and top-p alone (top_k=0), which
# sorted the whole vocabulary for every row
SETTINGS = [(1.0, 50, 1.0), (0.7, 50, 0.9), (1.0, 0, 0.95)]
WHOLE = 1 << 62  # CANDIDATES past any vocabulary: the whole sort for every row
BEFORE, AFTER = (WHOLE, False), (sampling.CANDIDATES, True)  # (CANDIDATES, CDF_DRAWS)


def warp_times(logits: torch.Tensor, runs: int = 50) -> list:
    """Per setting and row count: ms a call both ways (medians), and whether they keep the
    same tokens."""
    rows = []
    for t, k, p in SETTINGS:
        s = GenerationSettings(do_sample=True, temperature=t, top_k=k, top_p=p)
        for n in (1, 16):
            x = logits[:n]
            ms, kept = {}, {}
            for name, way in (("before", BEFORE), ("after", AFTER)):
                with choosing(way):
                    kept[name] = sampling.warp(x, s).isfinite()
                    times = []
                    for _ in range(runs):
                        start = time.perf_counter()
                        sampling.draw(sampling.warp(x, s).softmax(-1), None)
                        times.append(time.perf_counter() - start)
                    ms[name] = statistics.median(times) * 1e3
            rows.append({"temperature": t, "top_k": k, "top_p": p, "rows": n, "ms_before": ms["before"],
                         "ms_after": ms["after"],
                         "same_kept": bool(torch.equal(kept["before"], kept["after"]))})
    return rows


class choosing:
    """A context in which tokens are chosen one way: ``BEFORE`` or ``AFTER``."""

    def __init__(self, way: tuple):
        self.way = way

    def __enter__(self):
        self.saved = sampling.CANDIDATES, sampling.CDF_DRAWS
        sampling.CANDIDATES, sampling.CDF_DRAWS = self.way

    def __exit__(self, *exc):
        sampling.CANDIDATES, sampling.CDF_DRAWS = self.saved


def answers_logits(model, tok, prompts, new: int) -> torch.Tensor:
    """The model's logits over its own greedy answers to ``prompts`` ``[N, V]`` (float32)."""
    engine = rewriter.optimize(model, tokenizer=tok)
    rows = []
    with torch.no_grad():
        for p in prompts:
            ids = engine.generate([p], max_new_tokens=new)[0]
            out = model(ids[None])
            logits = out.logits if hasattr(out, "logits") else out
            rows.append(logits[0, len(p) - 1:].float())
    return torch.cat(rows)


def generations(variants, prompts, new: int, settings: dict, runs: int) -> list:
    """Per variant ``(name, engine, way)``: (tok/s median, tokens a round or None, ms a
    round or None: every run's time over every run's rounds, prefill included), runs
    interleaved and each run starting with the next variant. Sampled texts differ between
    the ways (their draws differ), and so do the heads' tokens a round: ms a round is the
    figure that compares them."""
    for _, engine, m in variants:  # every prompt's shapes first
        with choosing(m):
            for p in prompts:
                engine.generate([p], max_new_tokens=4, seed=0, eos_token_id=[], **settings)
    times = [[] for _ in variants]
    outs, stats = [None] * len(variants), [Counter() for _ in variants]
    for run in range(runs):
        for j in range(len(variants)):
            i = (run + j) % len(variants)
            _, engine, m = variants[i]
            with choosing(m):
                engine.stats.clear()
                start = time.perf_counter()
                outs[i] = [engine.generate([p], max_new_tokens=new, seed=run * len(prompts) + s,
                                           eos_token_id=[], **settings)
                           for s, p in enumerate(prompts)]
                times[i].append(time.perf_counter() - start)
                stats[i].update(engine.stats)  # every run's rounds
    got = []
    for (_, engine, _), out, t, st in zip(variants, outs, times, stats):
        made = made_tokens(engine, [[p] for p in prompts], out, False)
        rounds = st.get("row_rounds", 0)  # batch 1: a row's rounds are the rounds
        per_round = 1 + st.get("accepted", 0) / rounds if rounds else None
        got.append((made / statistics.median(t), per_round, sum(t) / rounds * 1e3 if rounds else None))
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/sampled_decode.json")
    args = ap.parse_args()
    if args.samples < 1 or args.new < 2 or args.runs < 1:
        ap.error("--samples and --runs must be positive, --new at least 2")
    model, tok = load(args.model)
    model = cast(model, getattr(torch, args.dtype), "cpu")
    plain = rewriter.optimize(model, tokenizer=tok)
    tok = plain.tokenizer
    sets = prompt_sets(plain, tok, 1, args.samples)
    kind = "chat" if "chat" in sets else "code"  # a model without a chat template: code
    prompts = [b[0] for b in sets[kind]]
    heads = strategy_engine(model, tokenizer=tok, passes=[HydraHeads(weights=args.model, draft_vocab=4096)])
    out = {"machine": machine(), "torch": torch.__version__, "dtype": args.dtype,
           "date": time.strftime("%Y-%m-%d"), "candidates": sampling.CANDIDATES,
           "ways": {"before": "whole sort, torch.multinomial", "after": "candidates, inverse-CDF draws"},
           "sdpa_path": path_taken(getattr(torch, args.dtype)),
           "packed_linears": args.dtype == "bfloat16" and packed_linear._machine_ok() and packed_linear.pays(),
           "model": args.model, "prompts": len(prompts), "prompt_kind": kind, "new": args.new,
           "runs": args.runs}

    out["warp"] = warp_times(answers_logits(model, tok, prompts, args.new))
    print(tabulate([[r["temperature"], r["top_k"], r["top_p"], r["rows"], f"{r['ms_before']:.3f}",
                     f"{r['ms_after']:.3f}", f"{r['ms_before'] / r['ms_after']:.1f}x", r["same_kept"]]
                    for r in out["warp"]],
                   ["temperature", "top_k", "top_p", "rows", "before ms", "after ms", "faster",
                    "same kept"]))
    out["generations"] = []
    table = []
    for t, k, p in SETTINGS:
        settings = dict(do_sample=True, temperature=t, top_k=k, top_p=p)
        variants = [("plain", plain, BEFORE), ("plain", plain, AFTER),
                    ("hydra", heads, BEFORE), ("hydra", heads, AFTER)]
        got = generations(variants, prompts, args.new, settings, args.runs)
        (pw, _, _), (pc, _, _), (hw, hw_round, hw_ms), (hc, hc_round, hc_ms) = got
        row = {"temperature": t, "top_k": k, "top_p": p,
               "plain_before_tok_s": pw, "plain_after_tok_s": pc,
               "hydra_before_tok_s": hw, "hydra_after_tok_s": hc,
               "hydra_tokens_a_round_before": hw_round, "hydra_tokens_a_round_after": hc_round,
               "hydra_ms_a_round_before": hw_ms, "hydra_ms_a_round_after": hc_ms}
        out["generations"].append(row)
        table.append([t, k, p, f"{pw:.1f}", f"{pc:.1f}", f"{pc / pw:.2f}x", f"{hw:.1f}", f"{hc:.1f}",
                      f"{hw_round:.2f} / {hc_round:.2f}", f"{hw_ms:.1f} / {hc_ms:.1f}",
                      f"{hw_ms / hc_ms:.2f}x", f"{hw / pw:.2f}x", f"{hc / pc:.2f}x"])
        print(f"temperature {t}, top_k {k}, top_p {p} done", flush=True)
    print(tabulate(table, ["T", "top_k", "top_p", "plain tok/s before", "after", "faster",
                           "hydra tok/s before", "after", "tokens a round", "ms a round",
                           "a round faster", "hydra/plain before", "after"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
