"""Tensor parallelism: the collectives a decode step runs, its CPU latency on 1 and 2
ranks, and a model of the multi-GPU case.

    python benchmarks/tensor_parallel.py [--model default smollm2] [--batch 1 8]
        [--prompt 32] [--steps 16] [--warmup 4] [--threads 1 2] [--world 2]
        [--unfused "tensor_parallel:world_size=2"]
        [--fused "tensor_parallel:world_size=2 fuse_all_reduce_rms_norm"]
        [--two-shot "tensor_parallel:world_size=2 fuse_all_reduce_rms_norm:two_shot_tokens=1"]
        [--context 192] [--no-ranks] [--model-only] [--markdown]
        [--json benchmarks/results/tensor_parallel.json]

1. **Collectives per decode step**, unfused (``TensorParallel`` alone: one ``rw.all_reduce``
   after each row-parallel projection, two a layer) against fused (``--fused``, run only
   when its passes exist: ``rw.all_reduce_add_rms_norm``, one all-reduce a site in its
   reference form, a reduce-scatter and an all-gather in its two-shot form, which
   ``--two-shot`` forces from one token a rank). Counted
   from the IR (each site's op, the two-shot rule of ``runtime.collectives`` applied to
   the step's tokens) and checked against what one decode step on ``--world`` ranks
   runs: each rank wraps the functional collectives ``runtime.collectives`` calls with a
   counter (a probe of this script; the product is unchanged).
2. **CPU latency**: prefill (one ``--prompt``-token prompt) and decode ms/token (median and
   p90 of ``--steps`` steps after ``--warmup``), one process at each ``--threads``
   against ``--world`` ranks (gloo on 127.0.0.1, launched by ``torch.distributed.run``,
   one thread a rank), unfused and fused, float32; per rank, the time spent inside the
   collectives (waiting for the other rank included) against the rest of the step.
3. **A model of H100s with NVLink** (``predict``): the single-device step split into the
   part that divides by the ranks (the layers' weights and KV reads, streamed from HBM)
   and the part every rank repeats (LM head, this engine's per-layer floor of small
   kernels), plus ``sites x t(bytes)`` with ``t = alpha(n) + 2(n-1)/n * bytes / beta``
   (ring all-reduce; constants and sources in ``NCCL``), unfused, fused (the add +
   RMSNorm op after each sum gone) and two-shot, at 1, 2, 4 and 8 ranks, for SmolLM2
   and a Llama-3-8B shape (``SHAPES``). ``--model-only`` prints it alone.

On this 2-core CPU, two ranks are expected to be slower than one process: each rank
gets one core, and every all-reduce costs a gloo round trip (~0.7 ms) that the step
waits for, 2 a layer.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.passes import from_spec

from common import describe, load, write_json

TABLE_FORMAT = {"format": "simple"}  # --markdown: "github"
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")
RANK_TIMEOUT = 120  # seconds a rank waits for its peer in one collective


# ---------------------------------------------------------------- the probe
class Probe:
    """Stands in for ``torch.ops._c10d_functional`` inside ``runtime.collectives``: counts
    each collective, the bytes of the tensor it reduces or assembles (all-reduce and
    reduce-scatter: their input; all-gather: its output), and the seconds spent in the
    collectives and their waits."""

    def __init__(self, ops):
        self.ops = ops
        self.reset()

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = Counter(), Counter(), 0.0

    def __getattr__(self, name):
        op = getattr(self.ops, name)
        if name not in COLLECTIVES and name != "wait_tensor":
            return op

        def timed(*args):
            start = time.perf_counter()
            out = op(*args)
            self.seconds += time.perf_counter() - start
            if name in COLLECTIVES:
                t = out if name == "all_gather_into_tensor" else args[0]
                self.calls[name] += 1
                self.bytes[name] += t.numel() * t.element_size()
            return out
        return timed


def install_probe() -> Probe:
    from rewriter.runtime import collectives
    probe = Probe(collectives._C10D)
    collectives._C10D = probe
    return probe


# ---------------------------------------------------------------- counts from the IR
def ir_collectives(ir, batch: int, world: int, hidden: int, itemsize: int) -> dict:
    """What one decode step of ``batch`` sequences runs, read from the IR: per collective
    kind, calls and bytes (as ``Probe`` counts them)."""
    from rewriter.ops import op_arguments
    calls, nbytes = Counter(), Counter()
    size = batch * hidden * itemsize  # [B, 1, H]
    for node in ir.graph.nodes:
        if node.target is torch.ops.rw.all_reduce.default:
            calls["all_reduce"] += 1
            nbytes["all_reduce"] += size
        elif node.target is torch.ops.rw.all_reduce_add_rms_norm.default:
            a = op_arguments("all_reduce_add_rms_norm", node.args, node.kwargs)
            if two_shot(batch, world, a["two_shot_tokens"]):  # the rule the ranks apply
                padded = -(-batch // world) * world * hidden * itemsize
                calls.update(["reduce_scatter_tensor", "all_gather_into_tensor"])
                nbytes["reduce_scatter_tensor"] += padded
                nbytes["all_gather_into_tensor"] += 2 * padded  # [normed | residual]
            else:
                calls["all_reduce"] += 1
                nbytes["all_reduce"] += size
    return {"calls": dict(calls), "bytes": dict(nbytes)}


def two_shot(tokens: int, world: int, two_shot_tokens) -> bool:
    """``runtime.collectives.two_shot`` on the CPU (the device the ranks run on here)."""
    import inspect
    from rewriter.runtime.collectives import two_shot as rule
    device = ["cpu"] if len(inspect.signature(rule).parameters) > 3 else []
    return rule(tokens, world, two_shot_tokens, *device)


def sites(ir) -> dict:
    return {name: sum(n.target is getattr(torch.ops.rw, name).default for n in ir.graph.nodes)
            for name in ("all_reduce", "all_reduce_add_rms_norm")}


# ---------------------------------------------------------------- timing
def timed_run(engine, batch: int, args, probe: Probe | None) -> dict:
    """Prefill of one ``--prompt``-token prompt, then ``--warmup`` + ``--steps`` decode steps
    timed one by one; with ``probe``, each timed step's collectives."""
    vocab = engine.config["vocab_size"]
    prompt = torch.randint(min(100, vocab - 1), vocab, (batch, args.prompt),
                           generator=torch.Generator().manual_seed(0))  # [B, S]
    stream = engine.stream(prompt, max_new_tokens=args.warmup + args.steps + 1, eos_token_id=[])
    start = time.perf_counter()
    next(stream)  # the prefill and its token
    row = {"prefill_ms": (time.perf_counter() - start) * 1000, "step_ms": [], "coll_ms": [],
           "steps": []}
    for i in range(args.warmup + args.steps):
        if probe:
            probe.reset()
        start = time.perf_counter()
        next(stream)
        if i < args.warmup:
            continue
        row["step_ms"].append((time.perf_counter() - start) * 1000)
        if probe:
            row["coll_ms"].append(probe.seconds * 1000)
            row["steps"].append({"calls": dict(probe.calls), "bytes": dict(probe.bytes)})
    return summarized(row)


def summarized(row: dict) -> dict:
    ms = sorted(row["step_ms"])
    row.update(median_ms=statistics.median(ms), p90_ms=ms[min(len(ms) - 1, int(0.9 * len(ms)))])
    if row["coll_ms"]:
        row["coll_median_ms"] = statistics.median(row["coll_ms"])
        first = row["steps"][0]
        row["same_every_step"] = all(s == first for s in row["steps"])
        row["runtime"] = first
    del row["steps"]
    return row


def pipelines(args) -> dict:
    """Name -> pass specs of the split pipelines; the fused ones only when their passes
    exist."""
    out = {"unfused": args.unfused.split()}
    for name, text in (("fused", args.fused), ("fused two-shot", args.two_shot)):
        try:
            [from_spec(s) for s in text.split()]
            out[name] = text.split()
        except ValueError as e:
            print(f"{name} left out: {e}", flush=True)
    return out


# ---------------------------------------------------------------- one process
def single_process(model_name: str, traced, args, record: dict) -> None:
    engine = rewriter.optimize(traced)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            row = timed_run(engine, batch, args, None)
            record["single"][f"{threads}|{batch}"] = row
            print(f"{model_name}: 1 process, {threads} thread(s), batch {batch}: "
                  f"{row['median_ms']:.1f} ms/step", flush=True)


def ir_counts(traced, hidden: int, args, record: dict) -> None:
    """Sites and per-step collectives of each split pipeline, from its IR (no ranks)."""
    for name, specs in pipelines(args).items():
        engine = rewriter.optimize(traced, passes=[from_spec(s) for s in specs])
        record["ir"][name] = {"specs": specs, "sites": sites(engine.ir), "steps": {
            str(b): ir_collectives(engine.ir, b, args.world, hidden, 4) for b in args.batch}}


# ---------------------------------------------------------------- the ranks
def launch_ranks(args, out: str) -> None:
    """This script on ``--world`` ranks (``--rank-worker``), bounded; raises on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.world}", "--max-restarts=0", "--monitor-interval=0.1",
           os.path.abspath(__file__), *sys.argv[1:], "--rank-worker", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.rank_timeout)
    if done.returncode:
        raise SystemExit(f"the ranks failed ({done.returncode}):\n{done.stderr[-4000:]}")


def rank_worker(args) -> None:
    """One rank: every model and split pipeline, timed with the probe; writes
    ``OUT/rank<r>.json``."""
    import torch.distributed as dist
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RANK_TIMEOUT))
    probe = install_probe()
    out = {}
    for model_name in args.model:
        model, tok = load(model_name)
        traced = rewriter.trace(model, tokenizer=tok)
        for name, specs in pipelines(args).items():
            engine = rewriter.optimize(traced, passes=[from_spec(s) for s in specs])
            for batch in args.batch:
                out[f"{model_name}|{name}|{batch}"] = timed_run(engine, batch, args, probe)
    Path(args.rank_worker, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def ranks(args, results: dict) -> None:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        launch_ranks(args, out)
        print(f"{args.world} ranks: {time.perf_counter() - start:.0f} s", flush=True)
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]
    for key in per_rank[0]:
        model_name, name, batch = key.split("|")
        results["models"][model_name]["ranks"][f"{name}|{batch}"] = [p[key] for p in per_rank]


# ---------------------------------------------------------------- the model of H100s
# t(bytes) = alpha(n) + 2(n-1)/n * bytes / beta: a ring all-reduce (each rank sends and
# receives 2(n-1)/n of the bytes). Constants and where they come from:
NCCL = {
    # NCCL's own latency model for a ring all-reduce with the LL protocol over NVLink
    # (src/graph/tuning.cc, quoted in NVIDIA/nccl#1334): a base of 6.6 us plus 0.6 us a
    # step, 2(n-1) steps -> 7.8 / 10.2 / 15.0 us at 2 / 4 / 8 ranks; a reduce-scatter or
    # an all-gather takes n-1 steps and its own base. Measured bounds: 2 H100s (HGX, NCCL
    # 2.20.5, nccl-tests with CUDA graphs) 5.6-6.0 us for 128-512 B (NVIDIA/nccl#1259);
    # 8 H100s from PyTorch ~20-25 us for 4 B-1 MiB (marin-community/marin#6736).
    "alpha_base_us": 6.6, "alpha_step_us": 0.6,
    # ring bus bandwidth of all_reduce_perf on 8x H100 SXM, 2 to 8 GPUs, large messages:
    # 365-370 GB/s (NVIDIA/nccl#1455; NVIDIA/nccl-tests#212: ~370 GB/s effective NVLink)
    "beta_GBps": 370.0,
    "hbm_TBps": 3.35,  # H100 SXM HBM3 bandwidth (NVIDIA's datasheet)
}
# Published figures of the same fusion, for comparison with the model's saving (one op's
# floor a site): 2 H100s, hidden 8192, 32 tokens, bfloat16: all-reduce + compiled RMSNorm
# 10 us, FlashInfer's fused one-shot 10 us (1.02x), its two-shot 79 us
# (vllm-project/vllm#22086); a B200: 13.5 -> 8.7 us a call (sgl-project/sglang#7621)
PUBLISHED_FUSED_US = {"h100_tp2_32_tokens": {"unfused": 10, "one_shot": 10, "two_shot": 79},
                      "b200": {"unfused": 13.5, "fused": 8.7}}

# single-device figures this project measured on one H100 (docs/benchmarks.md, GPU):
# SmolLM2 bfloat16, torch backend replayed as a CUDA graph, 264.9 tok/s at batch 1
# (128-token prompt and 128 new: KV 192 tokens on average, 2026-11-22); dense at 8k
# tokens, 1995 tok/s at batch 8 (2026-11-24)
H100_MEASURED_MS = {"smollm2": {1: 1000 / 264.9, 8: 8000 / 1995}}
H100_MEASURED_CONTEXT = {1: 192, 8: 8192}
OPS_PER_LAYER = 16  # SmolLM2's torch-backend decode program: 486 ops / 30 layers

SHAPES = {
    "smollm2": dict(layers=30, hidden=576, heads=9, kv_heads=3, mlp=1536, vocab=49152),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=128256),
}


def split_step(shape: dict, batch: int, context: int, itemsize: int = 2) -> dict:
    """Bytes of one decode step that divide by the ranks (the layers' weights, KV reads)
    and that every rank repeats (the LM head; embeddings and norms are negligible)."""
    h, head = shape["hidden"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head
    layer = h * (h + 2 * kv) + h * h + 3 * h * shape["mlp"]  # q k v, o, gate up down
    weights = shape["layers"] * layer * itemsize
    kv_reads = batch * context * shape["layers"] * 2 * kv * itemsize
    return {"divisible": weights + kv_reads, "repeated": shape["vocab"] * h * itemsize}


def collective_us(nbytes: float, n: int, steps: int, share: float) -> float:
    """One ring collective of ``steps`` steps that moves ``share`` of ``nbytes`` per rank."""
    return (NCCL["alpha_base_us"] + steps * NCCL["alpha_step_us"]
            + share * nbytes / (NCCL["beta_GBps"] * 1e3))


def site_us(nbytes: float, n: int, op_floor_us: float) -> dict:
    """What one summation site adds to the single-device step (which holds its add +
    RMSNorm op already: one op of floor, reading x and the residual, writing both):
    unfused, the all-reduce; fused one-shot, the same all-reduce with the add + RMSNorm
    op and one pass over the activations gone; two-shot (as ``runtime.collectives`` runs
    it), a reduce-scatter, the add + RMSNorm op on 1/n of the tokens, and an all-gather
    of [normed | residual]."""
    hbm = NCCL["hbm_TBps"] * 1e6  # bytes per us
    norm_us = op_floor_us + 4 * nbytes / hbm
    all_reduce = collective_us(nbytes, n, 2 * (n - 1), 2 * (n - 1) / n)
    scatter_gather = (collective_us(nbytes, n, n - 1, (n - 1) / n)
                      + collective_us(2 * nbytes, n, n - 1, (n - 1) / n))
    return {"unfused": all_reduce, "fused": all_reduce + 2 * nbytes / hbm - norm_us,
            "two_shot": scatter_gather + op_floor_us + 4 * nbytes / n / hbm - norm_us}


def predict(model: str, batch: int, context: int, floor_ms_per_layer: float) -> dict:
    """ms of a decode step at 1, 2, 4, 8 ranks on H100s: the part that divides over the
    ranks, the part each repeats, and 2 sites a layer (``site_us``). The single-device
    step is SmolLM2's measured time where there is one (its part past the HBM bound
    repeats on every rank: launches and small kernels), else the HBM bound plus
    ``floor_ms_per_layer`` a layer. One op's floor is the layer's over ``OPS_PER_LAYER``."""
    shape = SHAPES[model]
    part = split_step(shape, batch, context)
    hbm = NCCL["hbm_TBps"] * 1e9  # bytes per ms
    divisible = part["divisible"] / hbm
    measured = H100_MEASURED_MS.get(model, {}).get(batch)
    if measured is not None:
        repeated, source = measured - divisible, "measured H100 step"
        floor_ms_per_layer = (repeated - part["repeated"] / hbm) / shape["layers"]
    else:
        repeated = part["repeated"] / hbm + floor_ms_per_layer * shape["layers"]
        source = "HBM bound" + (f" + {floor_ms_per_layer:.3f} ms/layer floor"
                                if floor_ms_per_layer else " (no floor)")
    op_floor_us = floor_ms_per_layer * 1000 / OPS_PER_LAYER
    row = {"source": source, "divisible_ms": divisible, "repeated_ms": repeated,
           "op_floor_us": op_floor_us, "ms": {1: {"unfused": repeated + divisible}}}
    nbytes = batch * shape["hidden"] * 2  # [B, 1, H] bfloat16
    n_sites = 2 * shape["layers"]
    for n in (2, 4, 8):
        base = repeated + divisible / n
        site = site_us(nbytes, n, op_floor_us)
        # FuseAllReduceRMSNorm leaves the last sum (before the final norm) unfused
        row["ms"][n] = {k: base + ((n_sites - 1) * v + site["unfused"]) / 1000
                        for k, v in site.items()}
        row["ms"][n]["comm"] = n_sites * collective_us(nbytes, n, 2 * (n - 1), 2 * (n - 1) / n) / 1000
    return row


def model_record(args) -> dict:
    return {"predictions": predictions(args), "nccl": NCCL,
            "published_fused_us": PUBLISHED_FUSED_US}


def predictions(args) -> dict:
    """SmolLM2 from its measured H100 step; Llama-3-8B at the HBM bound, and with the
    per-layer floor SmolLM2's measured step implies (its time past the bound a layer)."""
    out = {}
    for batch in args.batch:
        context = H100_MEASURED_CONTEXT.get(batch, args.context)
        smol = predict("smollm2", batch, context, 0.0)
        out[f"smollm2|{batch}"] = smol
        out[f"llama3-8b|{batch}"] = predict("llama3-8b", batch, args.context, 0.0)
        floor = smol["op_floor_us"] * OPS_PER_LAYER / 1000
        out[f"llama3-8b+floor|{batch}"] = predict("llama3-8b", batch, args.context, floor)
    return out


# ---------------------------------------------------------------- tables
def fmt_calls(c: dict) -> str:
    short = {"all_reduce": "AR", "reduce_scatter_tensor": "RS", "all_gather_into_tensor": "AG"}
    return " + ".join(f"{v} {short[k]}" for k, v in sorted(c.get("calls", {}).items())) or "0"


def fmt_bytes(c: dict) -> str:
    return f"{sum(c.get('bytes', {}).values()) / 1024:.1f}"


def print_counts(results: dict, args) -> None:
    rows = []
    for model_name, m in results["models"].items():
        for name, ir in m["ir"].items():
            for batch in args.batch:
                want = ir["steps"][str(batch)]
                ran = [r["runtime"] for r in m["ranks"].get(f"{name}|{batch}", []) if "runtime" in r]
                same = all(r == want for r in ran) if ran else None
                rows.append([model_name, name, batch, ir["sites"]["all_reduce"],
                             ir["sites"]["all_reduce_add_rms_norm"], fmt_calls(want),
                             fmt_bytes(want), {True: "yes", False: "NO", None: "-"}[same]])
    print(f"\nCollectives per decode step, {args.world} ranks, float32\n")
    print(tabulate(rows, headers=["model", "pipeline", "batch", "AR sites", "fused sites",
                                  "collectives (IR)", "KiB per rank (IR)", "runtime = IR"],
                   tablefmt=TABLE_FORMAT["format"]))


def print_latency(results: dict, args) -> None:
    rows = []
    for model_name, m in results["models"].items():
        for batch in args.batch:
            for threads in args.threads:
                r = m["single"][f"{threads}|{batch}"]
                rows.append([model_name, batch, f"1 process, {threads} thread(s)", f"{r['prefill_ms']:.0f}",
                             f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}", "-", "-", "-"])
            for name in m["ir"]:
                per_rank = m["ranks"].get(f"{name}|{batch}")
                if not per_rank:
                    continue
                r = per_rank[0]
                calls = sum(r["runtime"]["calls"].values())
                rows.append([model_name, batch, f"{args.world} ranks, {name}", f"{r['prefill_ms']:.0f}",
                             f"{r['median_ms']:.1f}", f"{r['p90_ms']:.1f}",
                             " / ".join(f"{p['coll_median_ms']:.1f}" for p in per_rank),
                             f"{r['coll_median_ms'] / max(calls, 1):.2f}",
                             f"{r['median_ms'] - r['coll_median_ms']:.1f}"])
    print(f"\nCPU latency, float32, prompt {args.prompt}, {args.steps} steps after {args.warmup} "
          f"({results['machine']}, torch {results['torch']}, {results['date']}, load {results['load']})\n")
    print(tabulate(rows, headers=["model", "batch", "run", "prefill ms", "decode ms median",
                                  "p90", "in collectives ms (per rank)", "ms a collective",
                                  "rest ms (rank 0)"], tablefmt=TABLE_FORMAT["format"]))


def print_predictions(results: dict) -> None:
    rows = []
    for key, p in results["predictions"].items():
        model, batch = key.split("|")
        ms = p["ms"]
        rows.append([model, batch, p["source"], f"{p['divisible_ms']:.3f}", f"{p['repeated_ms']:.3f}",
                     f"{p['op_floor_us']:.1f}", f"{ms[1]['unfused']:.2f}",
                     *(f"{ms[n]['unfused']:.2f} / {ms[n]['fused']:.2f} / {ms[n]['two_shot']:.2f}"
                       f" ({ms[n]['comm']:.2f})" for n in (2, 4, 8))])
    print(f"\nModel: H100 NVLink decode ms a step, bfloat16, unfused / fused / fused two-shot "
          f"(all-reduces ms); constants {results['nccl']}\n")
    print(tabulate(rows, headers=["model", "batch", "single device", "divides ms", "repeats ms",
                                  "op floor us", "TP1", "TP2", "TP4", "TP8"],
                   tablefmt=TABLE_FORMAT["format"]))


# ---------------------------------------------------------------- main
def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["default", "smollm2"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=32, help="prefill tokens")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before the timed ones")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="one process's threads")
    ap.add_argument("--world", type=int, default=2, help="ranks")
    ap.add_argument("--unfused", default="tensor_parallel:world_size=2")
    ap.add_argument("--fused", default="tensor_parallel:world_size=2 fuse_all_reduce_rms_norm")
    ap.add_argument("--two-shot", default="tensor_parallel:world_size=2 "
                    "fuse_all_reduce_rms_norm:two_shot_tokens=1",
                    help="the fused pipeline forced to its two-shot form (from 1 token a rank)")
    ap.add_argument("--context", type=int, default=192,
                    help="KV length of the model's Llama-3-8B step (tokens)")
    ap.add_argument("--no-ranks", action="store_true", help="skip the multi-rank run")
    ap.add_argument("--model-only", action="store_true", help="print the H100 model only")
    ap.add_argument("--markdown", action="store_true", help="tables as Markdown")
    ap.add_argument("--rank-timeout", type=int, default=1800, help="seconds for the whole rank run")
    ap.add_argument("--json", default="benchmarks/results/tensor_parallel.json")
    ap.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for flag, value, least in (("--prompt", args.prompt, 1), ("--steps", args.steps, 1),
                               ("--warmup", args.warmup, 0), ("--world", args.world, 2),
                               ("--rank-timeout", args.rank_timeout, 10)):
        if value < least:
            ap.error(f"{flag} {value}: at least {least}")
    if min(args.batch) < 1 or min(args.threads) < 1:
        ap.error("--batch and --threads: at least 1")
    try:
        passes = [from_spec(s) for s in args.unfused.split()]
    except ValueError as e:
        ap.error(f"--unfused: {e}")
    worlds = {getattr(p, "world_size", None) for p in passes} - {None}
    if worlds != {args.world}:  # the ranks would refuse a model split for another count
        ap.error(f"--unfused must split for --world {args.world} ranks, got {sorted(worlds)}")
    return args


def main() -> None:
    args = arguments()
    TABLE_FORMAT["format"] = "github" if args.markdown else "simple"
    if args.rank_worker:
        return rank_worker(args)
    if args.model_only:
        return print_predictions(model_record(args))
    results = {**describe(), "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
               "args": vars(args), "models": {}}
    for model_name in args.model:
        model, tok = load(model_name)
        traced = rewriter.trace(model, tokenizer=tok)
        m = results["models"][model_name] = {"ir": {}, "single": {}, "ranks": {}}
        ir_counts(traced, model.config.hidden_size, args, m)
        single_process(model_name, traced, args, m)
    if not args.no_ranks:
        ranks(args, results)
    results.update(model_record(args))
    write_json(args.json, results)
    print_counts(results, args)
    print_latency(results, args)
    print_predictions(results)


if __name__ == "__main__":
    main()
