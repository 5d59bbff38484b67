"""Kernel benchmark: each Triton template and a generated pointwise kernel against torch.

    python benchmarks/triton_kernels.py [--json benchmarks/results/kernels.json]
    python benchmarks/triton_kernels.py --aot 90      # no GPU needed: compile for sm_90 (H100)

On a CUDA GPU: time (``triton.testing.do_bench``), achieved bandwidth against the device's
measured copy bandwidth, and time against torch eager and ``torch.compile`` of the same
operator, in the same run. Targets (issue 4): memory-bound kernels at >= 85% of copy
bandwidth at large sizes, none slower than torch.compile's kernel. On a CPU the kernels
run under ``TRITON_INTERPRET=1`` and this script checks correctness only (small sizes).

``--aot ARCH`` (CPU): runs the large cases' per-program shapes (GPU feature sizes, a small
grid) and a 2-layer ``llama_1b`` through ``backend="triton"`` in bf16 under the interpreter,
records every kernel specialization launched, and compiles each for ``sm_ARCH`` with
Triton and ptxas (``rewriter.codegen.aot``): what fails to compile for that GPU fails here,
and the table shows each kernel's registers, spilled (stack) bytes and shared memory.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tabulate import tabulate  # noqa: E402

from rewriter.codegen import norm, rope, swiglu  # noqa: E402
from rewriter.codegen.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from rewriter.codegen.prefill_attention import prefill_attention  # noqa: E402
from rewriter.ops import REFERENCE  # noqa: E402

from common import describe, machine, write_json  # noqa: E402


def cases(size: str, dtype, dev):
    """(name, triton fn, torch fn, bytes moved) for each kernel. ``size``: "small" (the
    interpreter check), "large" (GPU timing) or "aot" (large per-program shapes, small grid)."""
    t = lambda *s: torch.randn(*s, dtype=dtype, device=dev)  # noqa: E731
    large = size != "small"
    rows, hid, ffn = (8192 if size == "large" else 3, 4096, 11008) if large else (37, 200, 300)
    b, hq, hkv, d, ctx = (8 if size == "large" else 1, 32, 8, 128, 8192) if large else (2, 8, 2, 16, 77)
    x, r, w, gu = t(rows, hid), t(rows, hid), t(hid), t(rows, 2 * ffn)
    q1, kc, vc = t(b, hq, d), t(b, hkv, ctx, d), t(b, hkv, ctx, d)
    s = {"large": 1024, "aot": 64, "small": 29}[size]
    qp, cs, sn = t(1, s, hq * d), t(1, s, d), t(1, s, d)
    kp, vp = t(1, hkv, s, d), t(1, hkv, s, d)
    size = x.element_size()

    def torch_prefill():
        k = kp.transpose(1, 2).reshape(1, s, hkv * d)
        v = vp.transpose(1, 2).reshape(1, s, hkv * d)
        return REFERENCE["attention"](qp, k, v, 0, hq, hkv, d, d ** -0.5, True, None)
    return [
        ("rms_norm", lambda: norm.rms_norm(x, w, 1e-6), lambda: REFERENCE["rms_norm"](x, w, 1e-6),
         2 * x.numel() * size),
        ("add_rms_norm", lambda: norm.add_rms_norm(x, r, w, 1e-6)[0],
         lambda: REFERENCE["add_rms_norm"](x, r, w, 1e-6)[0], 4 * x.numel() * size),
        ("swiglu", lambda: swiglu.swiglu(gu), lambda: REFERENCE["swiglu"](gu), 1.5 * gu.numel() * size),
        ("rope", lambda: rope.rope(qp, cs, sn, d), lambda: REFERENCE["rope"](qp, cs, sn, d),
         2 * qp.numel() * size),
        ("decode_attention", lambda: decode_attention(q1, kc, vc, ctx, d ** -0.5),
         lambda: decode_attention_reference(q1, kc, vc, ctx, d ** -0.5), 2 * kc.numel() * size),
        ("prefill_attention", lambda: prefill_attention(qp, kp, vp, hq, d ** -0.5,
                                                        block=64 if large else None),
         torch_prefill, 4 * qp.numel() * size),
    ]


def timed(fn, cuda: bool) -> float:
    if cuda:
        import triton.testing
        return triton.testing.do_bench(fn) * 1e-3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_bandwidth(dev) -> float:
    x = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), CUDA)


def aot(arch: int, json_path: str) -> None:
    """Compile every kernel the GPU runs would launch for ``sm_<arch>``; print resources."""
    from rewriter.models.checkpoints import llama_1b
    from rewriter.codegen.aot import compile_for, record_launches
    from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU
    import rewriter

    model = llama_1b(num_hidden_layers=2, dtype=torch.bfloat16)
    tri = rewriter.optimize(model, passes=[FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()],
                            backend="triton", check=False)
    ids = torch.randint(0, 32000, (1, 20))
    with record_launches(arch) as launches:
        for _name, tri_fn, _ref, _bytes in cases("aot", torch.bfloat16, "cpu"):
            tri_fn()
        kc = torch.randn(1, 4, 80, 64, dtype=torch.bfloat16)  # llama_1b's prefill, GPU tile
        cs = torch.randn(1, 80, 64, dtype=torch.bfloat16)  # FuseRoPE: q rotated in the kernel
        prefill_attention(torch.randn(1, 80, 32 * 64, dtype=torch.bfloat16), kc, kc, 32, 0.125,
                          block=64, cos=cs, sin=cs)
        tri.generate(ids, max_new_tokens=3, eos_token_id=[])
        tri.static_decode = True  # the CUDA-graph step's kernels read positions from memory
        tri.generate(ids, max_new_tokens=3, eos_token_id=[])
    reports = compile_for(launches, arch)
    rows = [[r.name, _short(r.constexprs), r.ok, r.registers, r.stack_bytes,
             None if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}", r.num_warps]
            for r in reports]
    print(f"{len(reports)} kernel specializations compiled for sm_{arch} (bf16)")
    print(tabulate(rows, headers=["kernel", "constexprs", "ok", "regs", "stack B", "shared KiB", "warps"]))
    for r in reports:
        if not r.ok:
            print(f"\n{r.name} ({r.file}):\n{r.error}")
    write_json(json_path, {**describe(), "arch": arch, "dtype": "bfloat16",
                           "kernels": [vars(r) for r in reports]})
    if not all(r.ok for r in reports):
        raise SystemExit(1)


def _short(constexprs: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in constexprs.items() if k.isupper())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="default: benchmarks/results/kernels[_aot_smARCH].json")
    ap.add_argument("--aot", type=int, metavar="ARCH", help="compile for sm_ARCH instead (CPU only)")
    args = ap.parse_args()
    if args.aot:
        if CUDA:
            raise SystemExit("--aot is the CPU check; on a GPU run without it")
        return aot(args.aot, args.json or f"benchmarks/results/kernels_aot_sm{args.aot}.json")
    args.json = args.json or "benchmarks/results/kernels.json"
    dev = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    results = {**describe(dev), "device": machine(dev),
               "mode": "timing" if CUDA else "correctness only (TRITON_INTERPRET=1)", "kernels": []}
    peak = copy_bandwidth(dev) if CUDA else None
    rows = []
    for name, tri, ref, nbytes in cases("large" if CUDA else "small", dtype, dev):
        got, want = tri(), ref()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        ok = torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
        row = {"kernel": name, "correct": bool(ok)}
        if CUDA:
            compiled = torch.compile(ref)
            compiled()
            t_tri, t_eager, t_comp = timed(tri, True), timed(ref, True), timed(compiled, True)
            row.update(triton_us=t_tri * 1e6, eager_us=t_eager * 1e6, compile_us=t_comp * 1e6,
                       bandwidth_frac=nbytes / t_tri / peak)
            rows.append([name, ok, f"{t_tri * 1e6:.1f}", f"{t_eager * 1e6:.1f}", f"{t_comp * 1e6:.1f}",
                         f"{row['bandwidth_frac']:.0%}"])
        else:
            rows.append([name, ok])
        results["kernels"].append(row)
    head = ["kernel", "correct"] + (["triton us", "eager us", "compile us", "of copy BW"] if CUDA else [])
    print(f"{results['device']}: {results['mode']}" + (f", copy bandwidth {peak / 1e9:.0f} GB/s" if CUDA else ""))
    print(tabulate(rows, headers=head))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
