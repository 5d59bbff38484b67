"""Kernel benchmark: each Triton template and a generated pointwise kernel against torch.

    python benchmarks/kernels.py [--json benchmarks/results/kernels.json]

On a CUDA GPU: time (``triton.testing.do_bench``), achieved bandwidth against the device's
measured copy bandwidth, and time against torch eager and ``torch.compile`` of the same
operator, in the same run. Targets (issue 4): memory-bound kernels at >= 85% of copy
bandwidth at large sizes, none slower than torch.compile's kernel. On a CPU the kernels
run under ``TRITON_INTERPRET=1`` and this script checks correctness only (small sizes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tabulate import tabulate  # noqa: E402

from rewriter.codegen import norm, rope, swiglu  # noqa: E402
from rewriter.codegen.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from rewriter.codegen.prefill_attention import prefill_attention  # noqa: E402
from rewriter.ops import REFERENCE  # noqa: E402


def cases(large: bool, dtype, dev):
    """(name, triton fn, torch fn, bytes moved) for each kernel."""
    t = lambda *s: torch.randn(*s, dtype=dtype, device=dev)  # noqa: E731
    rows, hid, ffn = (8192, 4096, 11008) if large else (37, 200, 300)
    b, hq, hkv, d, ctx = (8, 32, 8, 128, 8192) if large else (2, 8, 2, 16, 77)
    x, r, w, gu = t(rows, hid), t(rows, hid), t(hid), t(rows, 2 * ffn)
    q1, kc, vc = t(b, hq, d), t(b, hkv, ctx, d), t(b, hkv, ctx, d)
    s = 1024 if large else 29
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
        ("prefill_attention", lambda: prefill_attention(qp, kp, vp, hq, d ** -0.5),
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/kernels.json")
    args = ap.parse_args()
    dev = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    results = {"device": torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
               "mode": "timing" if CUDA else "correctness only (TRITON_INTERPRET=1)", "kernels": []}
    peak = copy_bandwidth(dev) if CUDA else None
    rows = []
    for name, tri, ref, nbytes in cases(CUDA, dtype, dev):
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
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
