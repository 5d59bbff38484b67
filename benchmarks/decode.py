"""Decode speed: ``generate`` of the torch-backend runtime against Hugging Face ``generate``.

    python benchmarks/decode.py [--model default|smollm2|PATH] [--dtype float32 bfloat16]
                                [--prompt 128] [--new 128] [--batch 1 8] [--compiled]
                                [--passes fuse_qkv ... int4_weights]
                                [--llama-cpp-python VENV/bin/python]
                                [--json benchmarks/results/decode.json]
    python benchmarks/decode.py --device cuda --model llama-1b --batch 1   # issue 4's GPU run

With ``--device cuda`` it also times Hugging Face with ``torch.compile(mode=
"reduce-overhead")`` and a static cache, and this project's Triton backend with the fusion
passes, beside the floor (weight bytes / measured copy bandwidth). ``llama-1b`` is a
TinyLlama-shaped config (1.1B parameters, bf16) with random weights.

Both generate greedily, the same number of tokens (no early stop), from the same held-out
prompts, in the same process. Each figure is the median of ``--repeat`` timed runs after a
warm-up, with the min and max. On the CPU also: Hugging Face with a static cache whose
decode step ``torch.compile`` compiles (``--compiled``: about a minute of compiling per
configuration), llama.cpp on the GGUF file's own quantized weights at batch 1
(``--llama-cpp-python``: the Python of the venv ``benchmarks/llama_cpp_env.sh`` makes, which
runs ``llama_cpp_decode.py`` on the same prompt, new tokens and threads; the project's
figures are also given as ratios of medians to it), and the floor: the model's
own weight-streaming matrix products alone at batch 1, timed on its shapes in this run
(``floor_ms``). Targets (issue 11, SmolLM2, batch 1): at least 2x Hugging Face
``generate`` and at least 60% of the floor, greedy tokens unchanged. Also: time to
``rewriter.load`` an artifact against time to ``optimize`` from scratch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.models.checkpoints import llama_1b, load_hf_model, load_tokenizer

from common import describe, median_of as timed, timed_all, write_json


def load(name: str, dtype: torch.dtype, device: str):
    """(model, tokenizers.Tokenizer or None, GGUF path or None) for a benchmark model."""
    from rewriter.models import gguf
    if name == "llama-1b":
        return llama_1b(device=device, dtype=dtype), None, None
    if gguf.is_gguf(name):
        path = gguf.resolve(name)
        tok = gguf.load_gguf_tokenizer(name).backend_tokenizer
        return gguf.load_gguf_model(name, dtype).to(device), tok, str(path)
    return load_hf_model(name, dtype).to(device), load_tokenizer(name), None


def prompts(tok, batch: int, length: int) -> torch.Tensor:
    """``batch`` held-out code chunks of ``length`` tokens (random ids without a tokenizer)."""
    if tok is None:
        return torch.randint(1, 1000, (batch, length), generator=torch.Generator().manual_seed(0))
    from rewriter.models.corpus import load_corpus
    ids = []
    for _, text in load_corpus("heldout"):
        ids += tok.encode(text, add_special_tokens=False).ids
        if len(ids) >= batch * length * 4:
            break
    stride = len(ids) // batch
    return torch.tensor([ids[b * stride:b * stride + length] for b in range(batch)])


def floor_ms(model, repeat: int = 10) -> float:
    """Milliseconds of one batch-1 token's weight-streaming matrix products alone: every
    linear layer of the model (the LM head included), in order, on its own weights, as one
    chain, so each weight is read from memory as in a real step (timing each shape alone
    keeps a small matrix in the cache and flatters the floor 3x). The faster of the two
    layouts: ``F.linear`` on ``[out, in]`` or ``x @ W_t`` on a transposed ``[in, out]`` copy."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    chain = lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights]  # noqa: E731
    plain = statistics.median(timed_all(chain, repeat)[1])
    transposed = [w.t().contiguous() for w in weights]  # [in, out]
    chain_t = lambda: [xs[wt.shape[0]] @ wt for wt in transposed]  # noqa: E731
    best = min(plain, statistics.median(timed_all(chain_t, repeat)[1]))
    return 1e3 * best


def llama_cpp_run(python: str, path: str, ids: torch.Tensor, new: int, repeat: int) -> dict:
    """llama.cpp's greedy decode of ``ids[0]`` on the GGUF file, timed by
    ``llama_cpp_decode.py`` under ``python`` (the llama.cpp benchmark venv's): tokens/s as
    median and [min, max] of ``repeat`` runs, its version and its tokens."""
    request = {"model": path, "tokens": ids[0].tolist(), "new": new,
               "threads": torch.get_num_threads(), "repeat": repeat}
    script = Path(__file__).resolve().parent / "llama_cpp_decode.py"
    done = subprocess.run([python, str(script)], input=json.dumps(request), capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's run under {python} failed:\n{done.stderr.strip()}")
    answer = json.loads(done.stdout)
    return {"tok_s": rates(answer["seconds"], 1, new), "version": answer["version"],
            "tokens": answer["tokens"]}


def rates(times: list[float], batch: int, new: int) -> dict:
    """Tokens/s of the timed runs: the median run's, and the slowest and fastest."""
    return {"median": batch * new / statistics.median(times), "min": batch * new / max(times),
            "max": batch * new / min(times)}


def gpu_rows(model, ids, args) -> list[dict]:
    """HF + torch.compile, the Triton backend, and the bandwidth floor (CUDA only)."""
    from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU
    b, new = ids.shape[0], args.new
    rows = []
    # Hugging Face's own compiled path: with a static cache on CUDA, generate compiles the
    # decode step with torch.compile(mode="reduce-overhead") (CUDA graphs) itself.
    from transformers.generation.configuration_utils import CompileConfig
    t, hf_compiled = timed(lambda: model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
        do_sample=False, cache_implementation="static",
        compile_config=CompileConfig(mode="reduce-overhead", fullgraph=True)), args.repeat)
    rows.append({"name": "HF + torch.compile(reduce-overhead), static cache", "tok_s": b * new / t})
    tri = rewriter.optimize(model, passes=[FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()],
                            backend="triton")
    t, ours = timed(lambda: tri.generate(ids, max_new_tokens=new, eos_token_id=[]), args.repeat)
    # bf16 kernels differ from cuBLAS/SDPA in rounding, so tokens may part after a while:
    # the agreement is reported, not asserted.
    agree = (ours[:, -new:] == hf_compiled[:, -new:]).float().mean().item()
    rows.append({"name": "rewriter triton + fusions", "tok_s": b * new / t,
                 "token_agreement_with_hf": agree})
    x = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t, _ = timed(lambda: y.copy_(x), 5)
    bandwidth = 2 * x.numel() / t
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows.append({"name": "floor (weight bytes / copy bandwidth)", "tok_s": b * bandwidth / weight_bytes})
    return rows


def int4_floor_ms(model, passes, repeat: int = 10) -> float | None:
    """``floor_ms`` for a pipeline with ``Int4Weights``: its int4 products on the CPU
    kernel (the LM head dense unless ``lm_head=True``), as one chain; None without one."""
    from rewriter.maths.int4 import quantize
    from rewriter.passes import Int4Weights
    from rewriter.runtime.kernels import int4_cpu_ok, int4_cpu_tables, linear_int4_cpu
    p = next((p for p in passes if isinstance(p, Int4Weights)), None)
    if p is None:
        return None
    head = model.get_output_embeddings()
    calls = []
    for m in model.modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        w = m.weight.detach()
        x = torch.randn(1, w.shape[1], dtype=w.dtype)
        tables = quantize(w, p.group_size)
        if (m is not head or p.lm_head) and int4_cpu_ok(tables[0], tables[1], p.group_size):
            packed, sz = int4_cpu_tables(*tables)
            calls.append(lambda x=x, packed=packed, sz=sz: linear_int4_cpu(x, packed, sz, p.group_size))
        else:
            calls.append(lambda x=x, w=w: torch.nn.functional.linear(x, w))
    return 1e3 * statistics.median(timed_all(lambda: [c() for c in calls], repeat)[1])


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the first generated position where ``a`` and ``b`` differ
    (the length when they agree throughout)."""
    differ = (a != b).int()
    first = torch.where(differ.any(1), differ.argmax(1), torch.tensor(a.shape[1]))
    return first.float().mean().item()


def measure(model, opt, ids, args, floor, gguf_path, piped=None, pipe_floor=None) -> dict:
    """One configuration: ours, Hugging Face (dynamic cache; static + compiled), llama.cpp,
    the floor; tokens/s as median and [min, max] of the timed runs."""
    b, new = ids.shape[0], args.new
    rate = lambda times: rates(times, b, new)  # noqa: E731
    ours, t = timed_all(lambda: opt.generate(ids, max_new_tokens=new, eos_token_id=[]), args.repeat)
    run = {"rewriter_tok_s": rate(t)}
    hf_kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                 do_sample=False)
    with torch.inference_mode():
        hf, t = timed_all(lambda: model.generate(ids, **hf_kw), args.repeat)
    run.update(hf_tok_s=rate(t), same_tokens=bool(torch.equal(ours, hf)))
    run["speedup"] = run["rewriter_tok_s"]["median"] / run["hf_tok_s"]["median"]
    if piped is not None:
        out, t = timed_all(lambda: piped.generate(ids, max_new_tokens=new, eos_token_id=[]),
                           args.repeat)
        run.update(passes_tok_s=rate(t), passes_same_tokens=bool(torch.equal(out, hf)),
                   passes_first_divergence=first_divergence(out[:, ids.shape[1]:], hf[:, ids.shape[1]:]),
                   passes_speedup=rate(t)["median"] / run["hf_tok_s"]["median"])
        if pipe_floor is not None:
            run.update(passes_floor_ms=pipe_floor,
                       passes_of_floor=run["passes_tok_s"]["median"] / (1e3 / pipe_floor))
    if args.compiled and args.device == "cpu":
        from transformers.generation.configuration_utils import CompileConfig
        config = CompileConfig(fullgraph=False)
        config._compile_all_devices = True  # generate compiles only on CUDA unless told
        start = time.perf_counter()
        with torch.inference_mode():
            compiled, t = timed_all(lambda: model.generate(
                ids, **hf_kw, cache_implementation="static", compile_config=config), args.repeat)
        run.update(hf_compiled_tok_s=rate(t), hf_compiled_same_tokens=bool(torch.equal(ours, compiled)),
                   hf_compile_and_runs_s=time.perf_counter() - start)
    if gguf_path is not None and args.llama_cpp_python:
        llama = llama_cpp_run(args.llama_cpp_python, gguf_path, ids, new, args.repeat)
        run.update(llama_cpp_tok_s=llama["tok_s"], llama_cpp_version=llama["version"],
                   llama_cpp_first_divergence=first_divergence(
                       torch.tensor([llama["tokens"]]), ours[:1, ids.shape[1]:]))
        for key in ("rewriter", "passes"):
            if f"{key}_tok_s" in run:
                run[f"{key}_vs_llama_cpp"] = run[f"{key}_tok_s"]["median"] / llama["tok_s"]["median"]
    if floor is not None:
        run.update(floor_ms=floor, floor_tok_s=1e3 / floor,
                   of_floor=run["rewriter_tok_s"]["median"] / (1e3 / floor))
    if args.device == "cuda":
        run["gpu"] = gpu_rows(model, ids, args)
    return run


def spread(r: dict | None) -> str:
    """Tokens/s as "median [min-max]", "-" when not measured."""
    return f"{r['median']:.1f} [{r['min']:.1f}-{r['max']:.1f}]" if r else "-"


def ratio(run: dict, key: str) -> str:
    return f"{run[key]:.2f}x" if run.get(key) else "-"


def table_row(run: dict) -> list:
    return [run["dtype"], run["batch"], spread(run["hf_tok_s"]), spread(run.get("hf_compiled_tok_s")),
            spread(run.get("llama_cpp_tok_s")), spread(run["rewriter_tok_s"]), ratio(run, "speedup"),
            ratio(run, "rewriter_vs_llama_cpp"),
            f"{run['floor_tok_s']:.1f}" if run.get("floor_tok_s") else "-",
            f"{100 * run['of_floor']:.0f}%" if run.get("of_floor") else "-", run["same_tokens"]]


def passes_row(run: dict) -> list:
    return [run["dtype"], run["batch"], spread(run["passes_tok_s"]), ratio(run, "passes_speedup"),
            ratio(run, "passes_vs_llama_cpp"),
            f"{1e3 / run['passes_floor_ms']:.1f}" if run.get("passes_floor_ms") else "-",
            f"{100 * run['passes_of_floor']:.0f}%" if run.get("passes_of_floor") else "-",
            run["passes_same_tokens"], f"{run['passes_first_divergence']:.0f}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="checkpoint directory, .gguf, 'smollm2' or 'default'")
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--compiled", action="store_true",
                    help="also Hugging Face with a static cache compiled by torch.compile (slow)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--passes", nargs="*", default=None,
                    help="also time rewriter with these passes (specs: fuse_qkv int4_weights ...)")
    ap.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                    help="also time llama.cpp at batch 1 (GGUF models): the Python of the venv "
                         "benchmarks/llama_cpp_env.sh makes")
    ap.add_argument("--json", default="benchmarks/results/decode.json")
    args = ap.parse_args()
    if args.llama_cpp_python and not Path(args.llama_cpp_python).is_file():
        ap.error(f"--llama-cpp-python: no such file {args.llama_cpp_python!r} "
                 "(make the venv with benchmarks/llama_cpp_env.sh)")
    from rewriter.passes import from_spec
    pipeline = [from_spec(s) for s in args.passes] if args.passes is not None else None
    if args.threads:
        torch.set_num_threads(args.threads)

    results = {**describe(args.device), "model": args.model, "prompt": args.prompt,
               "new_tokens": args.new, "passes": args.passes, "runs": []}
    rows, piped_rows = [], []
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        if args.model == "llama-1b" and args.device == "cuda":
            dtype = torch.bfloat16
        model, tok, gguf_path = load(args.model, dtype, args.device)
        opt = rewriter.optimize(model)
        results["parameters"] = opt.ir.num_params()
        piped = rewriter.optimize(model, pipeline) if pipeline is not None else None
        floor = floor_ms(model) if args.device == "cpu" else None
        pipe_floor = None
        if pipeline is not None and args.device == "cpu":
            pipe_floor = int4_floor_ms(model, pipeline) or floor
        for b in args.batch:
            one = b == 1
            run = measure(model, opt, prompts(tok, b, args.prompt).to(args.device), args,
                          floor if one else None, gguf_path if one else None, piped,
                          pipe_floor if one else None)
            run.update(batch=b, dtype=dtype_name)
            results["runs"].append(run)
            rows.append(table_row(run))
            if piped is not None:
                piped_rows.append(passes_row(run))
    print_tables(results, rows, piped_rows, args)

    t = time.perf_counter()
    fresh = rewriter.optimize(model)
    optimize_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        fresh.save(Path(d) / "a")
        t = time.perf_counter()
        rewriter.load(Path(d) / "a")
        load_s = time.perf_counter() - t
    results.update(optimize_s=optimize_s, load_s=load_s)

    print(f"\nrewriter.load of the artifact: {load_s:.2f} s; optimize from the checkpoint: "
          f"{optimize_s:.2f} s ({optimize_s / load_s:.1f}x longer)")
    write_json(args.json, results)


def print_tables(results: dict, rows: list, piped_rows: list, args) -> None:
    llama = next((r["llama_cpp_version"] for r in results["runs"] if r.get("llama_cpp_version")), None)
    print(f"model {args.model}: {results['parameters'] / 1e6:.2f}M params, prompt {args.prompt}, "
          f"{args.new} new tokens, {results['threads']} threads, {results['machine']}, "
          f"{results['date']}" + (f", llama-cpp-python {llama}" if llama else "") + "\n")
    print(tabulate(rows, headers=["dtype", "batch", "HF generate tok/s", "HF static+compile tok/s",
                                  "llama.cpp tok/s", "rewriter tok/s", "vs HF", "vs llama.cpp",
                                  "floor tok/s", "% of floor", "same greedy tokens"]))
    if piped_rows:
        print(f"\nrewriter with passes {' '.join(args.passes)} (the same Hugging Face and "
              "llama.cpp runs as above):\n")
        print(tabulate(piped_rows, headers=["dtype", "batch", "rewriter+passes tok/s", "vs HF",
                                            "vs llama.cpp", "its floor tok/s", "% of its floor",
                                            "same greedy tokens as HF", "first divergence"]))
    for run in results["runs"]:
        for row in run.get("gpu", []):
            print(f"batch {run['batch']}: {row['name']}: {row['tok_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
