"""KV sharing across layers: how alike the layers' caches are, and what sharing them costs.

    python benchmarks/kv_sharing.py [--model default|smollm2|PATH] [--corpus code prose]
                                    [--chunks 2] [--length 256] [--no-similarity]
                                    [--share every=2 last=4 ...]
                                    [--pipeline "share_kv:every=2" --pipeline "share_kv:last=2 quest:budget=64" ...]
                                    [--greedy 4] [--greedy-new 32]
                                    [--passkey-lengths 1024 2048 4096] [--passkey-depths 0.1 0.5 0.9]
                                    [--passkey-trials 1] [--decode-lengths 4096 8192] [--decode-new 8]
                                    [--calibrate 30] [--calibrate-length 16] [--budget 15]
                                    [--rules kvsharer measured] [--threshold 0.95] [--lower-threshold 0.5]
                                    [--curve 0 1 2 3 4 6 8 10 12 15] [--json benchmarks/results/kv_sharing.json]

Prints, for each corpus, the per-token cosine between every pair of layers' cached keys
and values (``rewriter.measure.kv_similarity``), averaged over tokens, KV heads and
chunks, and the pairs most alike: 1 means a reader of the other layer's cache would
attend with its own directions (MiniCache merges directions and keeps magnitudes), near
0 means its keys would be unrelated to its queries' training.

Pipelines (``--pipeline``: pass specs as the CLI reads them, one shell word per pass, so
any stack can be measured; ``--share every=2`` is short for ``--pipeline share_kv:every=2``)
are measured against the plain model in the same run, through the KV-cache runtime: KV
bytes per token (``engine.kv_bytes_per_token``, and what the runtime's allocator takes
for one sequence), held-out perplexity (second half of each chunk scored one decode step
at a time) on each corpus and its ratio to plain, greedy agreement with plain's
continuations, pass-key accuracy by context length (lengths past the model's context are
left out, and said), and decode tokens/s at each KV length (``sparse.decode_rate``: the
median of ``--decode-new`` decode steps after one prefill; lengths are cut to the
context) with the ratio to plain. Each measurement is off with an empty list or 0.

``--calibrate N`` runs ``ShareKV(calibrate=..., budget, threshold, rule)`` once per rule
on N chunks of ``--calibrate-length`` tokens of the training split (one chunk from the
middle of each file in turn; the held-out text scores), timing the search, and records
the curve: the search keeps pairs greedily in a fixed order, so budget n's map is the
first n kept pairs of the full budget's, and each ``--curve`` prefix is measured (KV
bytes per token, perplexity). A rule that keeps fewer than ``--budget`` pairs at
``--threshold`` is searched again at ``--lower-threshold``. Each calibrated map (full
budget) is then a pipeline with every column.

The record is written after every row and curve point; a rerun with the same ``--json``
and model skips what it already holds with the same settings.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.api.eval import (EvalSettings, agreement, greedy_continuations, greedy_prompts,
                               heldout_chunks, passkey_accuracy, perplexity)
from rewriter.measure import kv_sharer
from rewriter.measure.kv_similarity import layer_kv, similarity
from rewriter.models.corpus import load_corpus
from rewriter.passes import ShareKV, from_spec, to_spec
from rewriter.runtime.kv_cache import KVCache, cache_table

from common import describe, load, write_json
from sparse import decode_rate


def matrix_table(m: torch.Tensor) -> str:
    """``[L, L]`` as a table with layer numbers on both sides, two decimals."""
    n = m.shape[0]
    rows = [[i, *(f"{float(m[i, j]):.2f}" for j in range(n))] for i in range(n)]
    return tabulate(rows, headers=["", *range(n)], tablefmt="plain")


def closest(m: torch.Tensor, most: int) -> list:
    """The ``most`` pairs ``(i, j)`` with ``i < j`` of the highest value."""
    n = m.shape[0]
    pairs = [(float(m[i, j]), i, j) for i in range(n) for j in range(i + 1, n)]
    return sorted(pairs, reverse=True)[:most]


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--corpus", nargs="+", default=["code", "prose"], choices=["code", "prose"])
    ap.add_argument("--chunks", type=int, default=2, help="held-out chunks per corpus")
    ap.add_argument("--length", type=int, default=256, help="tokens per chunk")
    ap.add_argument("--json", default="benchmarks/results/kv_sharing.json")
    ap.add_argument("--no-similarity", action="store_true", help="skip the similarity matrices")
    ap.add_argument("--share", nargs="*", default=[],
                    help="ShareKV settings measured against plain: every=K or last=N")
    ap.add_argument("--pipeline", action="append", default=[],
                    help="pass specs of one pipeline, space-separated (share_kv:last=2 quest:budget=64)")
    ap.add_argument("--greedy", type=int, default=4, help="greedy prompts (0: no agreement)")
    ap.add_argument("--greedy-new", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--passkey-lengths", type=int, nargs="*", default=[1024, 2048, 4096])
    ap.add_argument("--passkey-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--passkey-trials", type=int, default=1, help="per length and depth")
    ap.add_argument("--decode-lengths", type=int, nargs="*", default=[4096, 8192],
                    help="KV lengths of the decode tokens/s column (cut to the context)")
    ap.add_argument("--decode-new", type=int, default=8, help="decode steps timed (2 warm up)")
    ap.add_argument("--calibrate", type=int, default=0, help="calibration chunks (0: no search)")
    ap.add_argument("--calibrate-length", type=int, default=16)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--rules", nargs="+", default=["kvsharer", "measured"],
                    choices=["kvsharer", "measured"])
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--lower-threshold", type=float, default=0.5)
    ap.add_argument("--curve", type=int, nargs="*", default=[0, 1, 2, 3, 4, 6, 8, 10, 12, 15],
                    help="calibrated readers measured along the curve")
    args = ap.parse_args()
    check(ap, args)
    args.specs = {f"share_kv:{s}": [f"share_kv:{s}"] for s in args.share}
    args.specs.update({p: p.split() for p in args.pipeline})
    for name, specs in args.specs.items():  # a bad spec fails before the model loads
        try:
            [from_spec(s) for s in specs]
        except ValueError as e:
            ap.error(f"--pipeline {name!r}: {e}")
    return args


def check(ap, args) -> None:
    """The numbers and ``--share`` settings, refused by name before anything loads."""
    for setting in args.share:  # every=K or last=N, integers
        key, _, value = setting.partition("=")
        if key not in ("every", "last") or not value.isdigit():
            ap.error(f"--share {setting!r}: every=K or last=N (an integer)")
    if args.decode_lengths and args.decode_new < 3:
        ap.error(f"--decode-new {args.decode_new}: at least 3 steps (the first 2 warm up)")
    short = [n for n in args.decode_lengths if n <= args.decode_new + 1]
    if short:
        ap.error(f"--decode-lengths {short[0]}: no prompt left before {args.decode_new + 1} new tokens")
    for flag, value, least in (("--chunks", args.chunks, 1), ("--length", args.length, 4),
                               ("--greedy", args.greedy, 0), ("--greedy-new", args.greedy_new, 1),
                               ("--passkey-trials", args.passkey_trials, 1),
                               ("--calibrate", args.calibrate, 0), ("--budget", args.budget, 1),
                               ("--calibrate-length", args.calibrate_length, 2)):
        if value < least:
            ap.error(f"{flag} {value}: at least {least}")


def main():
    args = arguments()
    model, tok = load(args.model)
    traced = rewriter.trace(model, tokenizer=tok)
    results = resumed(args)
    if not args.no_similarity:
        print_similarity(rewriter.optimize(traced).ir, tok, args, results)
        write_json(args.json, results)
    bench = Bench(traced, tok, args, results)
    rank_once()
    bench.row("plain", [])
    for name, specs in args.specs.items():
        bench.row(name, [from_spec(s) for s in specs])
    for rule in args.rules if args.calibrate else []:
        bench.calibrated(rule)
    print_rows(results, args)
    print_curves(results, args)


def resumed(args) -> dict:
    """The record so far (same model) with this run's header, or a new one."""
    header = {**describe(), "model": args.model,
              "args": {k: v for k, v in vars(args).items() if k != "specs"}}
    path = Path(args.json)
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("model") != args.model:
        old = {}
    return {"similarity": old.get("similarity", {}), "rows": old.get("rows", {}),
            "searches": old.get("searches", {}), **header}


def print_similarity(ir, tok, args, results) -> None:
    for corpus in args.corpus:
        keys, values = similarity(layer_kv(ir, heldout_chunks(tok, args.chunks, args.length, corpus)))
        results["similarity"][corpus] = {"keys": keys.tolist(), "values": values.tolist()}
        for name, m in (("keys", keys), ("values", values)):
            print(f"\n{args.model}, {corpus}, {args.chunks} x {args.length} tokens: cosine of "
                  f"{name}, layer x layer ({results['machine']}, {results['date']})\n")
            print(matrix_table(m))
            print("most alike:", ", ".join(f"{i}-{j} {c:.2f}" for c, i, j in closest(m, 5)))


def calibration_prompts(tok, n: int, length: int) -> list[list[int]]:
    """``n`` chunks of ``length`` tokens from the middle of the training split's files, one
    per file (files of at least twice that): the search never sees the held-out text
    that scores its maps."""
    out = []
    for _, text in load_corpus("train"):
        # the first 20k characters: room for a middle chunk, cheap to tokenize
        ids = tok.encode(text[:20000], add_special_tokens=False)
        if len(ids) >= 2 * length:
            out.append(ids[len(ids) // 2 - length // 2:][:length])
        if len(out) == n:
            return out
    raise ValueError(f"the training split has fewer than {n} files of {2 * length} tokens")


def rank_once() -> None:
    """Makes the calibrated search rank its candidates once per rule and prompts: the
    ``measured`` rule's ranking (one forward pass per pair of layers, 435 on SmolLM2)
    does not depend on the threshold, and a rule searched again at the lower threshold
    would redo it."""
    ranked = {}
    rank = kv_sharer._candidates

    def candidates(ir, ids, layers, reference, rule):
        key = (rule, tuple(layers), ids.numpy().tobytes())  # ids [B, T]: the prompts
        if key not in ranked:
            ranked[key] = rank(ir, ids, layers, reference, rule)
        return ranked[key]
    kv_sharer._candidates = candidates


class Bench:
    """The measurements of one run: plain's references, one row per pipeline, the
    calibrated searches and their curves, each written to the record when done."""

    def __init__(self, traced, tok, args, results):
        self.traced, self.tok, self.args, self.results = traced, tok, args, results
        self.chunks = {c: heldout_chunks(tok, args.chunks, args.length, c) for c in args.corpus}
        self.prompts = None  # greedy prompts, made with plain's engine
        self.columns = bool(args.greedy or args.passkey_lengths or args.decode_lengths)

    def settings(self) -> dict:
        """What a row's figures depend on: a rerun keeps a row measured with these."""
        a = self.args
        return {k: getattr(a, k) for k in ("corpus", "chunks", "length", "greedy", "greedy_new",
                                           "passkey_lengths", "passkey_depths", "passkey_trials",
                                           "decode_lengths", "decode_new")}

    def row(self, name: str, passes: list) -> dict:
        """The row of ``name`` (measured now unless the record holds it)."""
        rows = self.results["rows"]
        if rows.get(name, {}).get("settings") == self.settings():
            print(f"{name}: from {self.args.json}", flush=True)
            return rows[name]
        start = time.perf_counter()
        engine = rewriter.optimize(self.traced, passes=passes)
        row = {"pipeline": name, "specs": self.specs(engine), "settings": self.settings(),
               **self.memory(engine), "perplexity": {c: perplexity(engine, x) for c, x in self.chunks.items()}}
        if self.columns:
            row.update(self.greedy(engine, name), **self.passkey(engine), **self.decode(engine))
        row["seconds"] = time.perf_counter() - start
        rows[name] = json.loads(json.dumps(row))  # as a rerun reads it: text keys
        write_json(self.args.json, self.results)
        print(f"{name}: {row['seconds']:.0f} s", flush=True)
        return row

    @staticmethod
    def specs(engine) -> list:
        return [to_spec(p) for p in engine.pass_specs]

    @staticmethod
    def memory(engine) -> dict:
        """KV bytes per token as counted, and as the runtime's allocator takes them for one
        sequence of 256 tokens (each shared cache allocated once; Quest's page bounds,
        made at the first write, and rounding of a 256-token side buffer aside)."""
        cache = KVCache(cache_table(engine.ir.gm), 1, 256, torch.float32, torch.device("cpu"))
        return {"kv_bytes_per_token": engine.kv_bytes_per_token(),
                "allocated_bytes_per_token": cache.nbytes // 256}

    def greedy(self, engine, name: str) -> dict:
        """Plain's greedy continuations (the reference, kept in the record), or this
        pipeline's agreement with them."""
        a = self.args
        if not a.greedy:
            return {}
        if self.prompts is None:
            self.prompts = greedy_prompts(engine, self.tok, EvalSettings(prompts=a.greedy))
        tokens = greedy_continuations(engine, self.prompts, a.greedy_new)
        if name == "plain":
            return {"greedy_tokens": tokens.tolist()}
        return agreement(tokens, torch.tensor(self.results["rows"]["plain"]["greedy_tokens"]))

    def passkey(self, engine) -> dict:
        a = self.args
        past = [n for n in a.passkey_lengths if n > engine.max_len]
        return {"passkey": passkey_accuracy(engine, self.tok, a.passkey_lengths, a.passkey_depths,
                                            a.passkey_trials),
                "passkey_past_context": past}

    def decode(self, engine) -> dict:
        """Decode tokens/s at batch 1 per KV length (cut to the context length)."""
        lengths = sorted({min(n, engine.max_len) for n in self.args.decode_lengths})
        return {"tok_s": {n: decode_rate(engine, 1, n, self.args.decode_new) for n in lengths}}

    def calibrated(self, rule: str) -> None:
        """The search at the threshold, again at the lower one when it keeps fewer than
        the budget; the curve of each; the full map as a pipeline with every column."""
        threshold = self.args.threshold
        while True:
            kept = self.search(rule, threshold)
            self.curve(rule, threshold, kept)
            if self.columns:  # else the curve's last point is the row
                self.row(f"calibrated {rule} threshold={threshold}", [ShareKV(sources=dict(kept))])
            if len(kept) >= self.args.budget or threshold == self.args.lower_threshold:
                return
            threshold = self.args.lower_threshold

    def search(self, rule: str, threshold: float) -> list:
        """The kept ``[reader, owner]`` pairs in the order the search kept them (timed)."""
        a = self.args
        key = f"{rule}@{threshold}"
        setting = {"calibrate": a.calibrate, "length": a.calibrate_length, "budget": a.budget}
        done = self.results["searches"].get(key)
        if done and done["setting"] == setting:
            return done["kept"]
        prompts = calibration_prompts(self.tok, a.calibrate, a.calibrate_length)
        p = ShareKV(calibrate=prompts, budget=a.budget, threshold=threshold, rule=rule)
        start = time.perf_counter()
        rewriter.optimize(self.traced, passes=[p])
        seconds = time.perf_counter() - start
        kept = [t["pair"] for t in p.report["tried"] if t["kept"]]
        self.results["searches"][key] = {"setting": setting, "seconds": seconds, "kept": kept,
                                         "report": p.report, "curve": {}}
        write_json(a.json, self.results)
        print(f"search {key}: {len(kept)} kept of {len(p.report['tried'])} tried, "
              f"{seconds:.0f} s", flush=True)
        return kept

    def curve(self, rule: str, threshold: float, kept: list) -> None:
        """KV bytes per token and perplexity of each prefix of the kept pairs."""
        search = self.results["searches"][f"{rule}@{threshold}"]
        cosines = [t["cosine"] for t in search["report"]["tried"] if t["kept"]]
        plain = self.results["rows"]["plain"]
        for n in sorted({min(n, len(kept)) for n in self.args.curve}):
            if str(n) in search["curve"]:
                continue
            point = {"sources": dict(kept[:n]), "hidden_cosine": cosines[n - 1] if n else 1.0}
            if n == 0:  # nothing shared: plain's figures
                point.update({k: plain[k] for k in ("kv_bytes_per_token", "allocated_bytes_per_token",
                                                    "perplexity")})
            else:
                engine = rewriter.optimize(self.traced, passes=[ShareKV(sources=point["sources"])])
                point.update(**self.memory(engine), perplexity={
                    c: perplexity(engine, x) for c, x in self.chunks.items()})
            search["curve"][str(n)] = point
            write_json(self.args.json, self.results)
            print(f"curve {rule}@{threshold}: {n} readers", flush=True)


def print_rows(results: dict, args) -> None:
    rows = list(results["rows"].values())
    plain = results["rows"]["plain"]
    table = []
    for r in rows:
        tok_s = r.get("tok_s", {})
        table.append([r["pipeline"], r["kv_bytes_per_token"], r["allocated_bytes_per_token"],
                      f"{plain['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f}x",
                      *ppl_cells(r, plain, args.corpus),
                      f"{r['agreement']:.2f}" if "agreement" in r else "-",
                      " ".join(f"{n}:{v:.2f}" for n, v in r.get("passkey", {}).items()) or "-",
                      " ".join(f"{n}:{v:.1f} ({v / plain['tok_s'][n]:.2f}x)"
                               for n, v in tok_s.items() if n in plain.get("tok_s", {})) or "-"])
    past = plain.get("passkey_past_context")
    print(f"\n{args.model} on {results['machine']}, {results['threads']} threads, torch "
          f"{results['torch']}, float32, {results['date']}; perplexity over {args.chunks} x "
          f"{args.length} tokens per corpus" + (f"; pass-key lengths past the context left "
                                                f"out: {past}" if past else "") + "\n")
    print(tabulate(table, headers=["pipeline", "KV B/token", "allocated B/token", "less KV",
                                   *(f"ppl {c} (ratio)" for c in args.corpus), "greedy agree",
                                   "passkey", "decode tok/s (ratio)"]))


def ppl_cells(r: dict, plain: dict, corpora) -> list:
    return [f"{r['perplexity'][c]:.2f} ({r['perplexity'][c] / plain['perplexity'][c]:.3f})"
            for c in corpora]


def print_curves(results: dict, args) -> None:
    plain = results["rows"]["plain"]
    for key, s in results["searches"].items():
        print(f"\ncalibrated {key}: {args.calibrate} x {args.calibrate_length} training tokens, "
              f"search {s['seconds']:.0f} s, {len(s['kept'])} kept of {len(s['report']['tried'])} tried\n")
        table = [[n, f"{p['hidden_cosine']:.3f}", p["kv_bytes_per_token"],
                  f"{plain['kv_bytes_per_token'] / p['kv_bytes_per_token']:.2f}x",
                  *ppl_cells(p, plain, args.corpus), p["sources"]]
                 for n, p in sorted(s["curve"].items(), key=lambda kv: int(kv[0]))]
        print(tabulate(table, headers=["readers", "hidden cos", "KV B/token", "less KV",
                                       *(f"ppl {c} (ratio)" for c in args.corpus), "map"]))


if __name__ == "__main__":
    main()
