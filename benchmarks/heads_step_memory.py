"""A draft-heads training step's time with glibc's allocator settings and inside
``rewriter.malloc.reuse_freed_memory``, on synthetic data of SmolLM2's sizes.

    python benchmarks/heads_step_memory.py [--steps 8] [--rounds 2] [--json benchmarks/results/heads_step_memory.json]

The step makes what ``train_heads`` makes (4 heads' logits over a 49152-token vocabulary
for 256 positions, their float32 copy, the loss and the gradients: about 1 GB freed and
allocated again every step) without the model or any data. Columns: wall seconds a step,
seconds of it in the kernel, minor page faults a step. Only round 0's first row has
glibc's own defaults: a ``mallopt`` turns its adaptive mmap threshold off for good. Run it
alone: it times the CPU.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from rewriter.malloc import reuse_freed_memory

VOCAB, HIDDEN, POSITIONS, HEADS = 49152, 576, 256, 4  # SmolLM2's, train_heads' batch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="benchmarks/results/heads_step_memory.json")
    args = ap.parse_args()
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be at least 1")
    torch.manual_seed(0)
    lm_head = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16) * 0.02  # frozen, as the model's
    w = torch.zeros(HEADS, HIDDEN, HIDDEN, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-3)
    h = torch.randn(POSITIONS, HIDDEN)
    target = torch.randint(0, VOCAB, (POSITIONS, HEADS))

    def step():
        x = h[:, None] + F.silu(torch.einsum("bh,kgh->bkg", h, w))  # [B, K, H]: a ResBlock a head
        logits = (x.bfloat16() @ lm_head.T).float()  # [B, K, V]
        loss = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    def timed():
        step()  # the first step of a setting grows what it needs
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(args.steps):
            step()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        n = args.steps
        return [(time.perf_counter() - t) / n, (r1.ru_stime - r0.ru_stime) / n,
                (r1.ru_minflt - r0.ru_minflt) / n]

    rows = []
    for r in range(args.rounds):  # interleaved, so a drift in the machine hits both
        # after the first reuse_freed_memory, glibc's mmap threshold no longer adapts: the
        # later rounds' "defaults" keep a fixed 128 KiB threshold (rewriter.malloc)
        rows.append(["glibc's defaults" if r == 0 else "defaults, after one reuse", r, *timed()])
        with reuse_freed_memory():
            rows.append(["reuse_freed_memory", r, *timed()])
    print(tabulate(rows, headers=["allocator", "round", "s a step", "kernel s a step", "faults a step"],
                   floatfmt=".3f"))
    out = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
           "rows": [dict(zip(["allocator", "round", "seconds", "kernel_seconds", "faults"], r)) for r in rows]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
