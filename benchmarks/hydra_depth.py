"""Would deeper Hydra heads pay here? Held-out accuracy of Hydra heads with one residual
block against heads with more blocks, trained the same way, offline.

    python benchmarks/hydra_depth.py --work smollm2-hydra.safetensors.work \
        --heads OLD.safetensors [--blocks 1 2 4] [--steps 800] [--chat-heldout 1024]

Hydra++ (zankner/Hydra, ``--hydra_num_layers 4``) gives each head four MLP layers; the
heads here have one residual block, ``h + SiLU(W [h; e_1 .. e_k] + b)``. The extra blocks
measured here are ``x + SiLU(W x + b)`` after it, zero-initialised, so every run starts
from ``--heads``'s accuracies and all runs take the same steps over the same positions
(cross-entropy on the model's own next tokens, heads weighted 0.8^k as ``train_heads``).

``--work`` is a ``train-heads --data mixed --questions N`` work directory: the self-asked
chat rows (``train-magpie.safetensors``) are split, the last ``--chat-heldout`` rows
held out (the chat column), the rest trained on; ``heldout.safetensors`` (code chunks and
docstring questions) is the other column. ``--heads`` must not have been trained on that
directory's chat rows. This measured whether ``train-heads --blocks`` was worth building
(it was built after it); the training here is its own, offline.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from rewriter import heads as heads_file
from rewriter.train_heads import DECAY, _path, _targets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hydra_prefix import _pairs, chat_split, top1, train_step, warmup_cosine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="train-heads work directory (with chat rows)")
    ap.add_argument("--heads", required=True, help="Hydra heads to start from")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=256, help="positions a step")
    ap.add_argument("--chat-heldout", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/hydra_depth.json")
    args = ap.parse_args()
    if min(args.blocks) < 1 or min(args.steps, args.batch, args.chat_heldout) < 1:
        ap.error("--blocks, --steps, --batch and --chat-heldout must be >= 1")
    model, _, train, held = chat_split(ap, Path(args.work), args.model, args.chat_heldout)
    cut = len(train["tokens"])
    pairs = torch.cat([_pairs(train, torch.arange(i, min(i + 256, cut))) for i in range(0, cut, 256)])
    results = []
    start = heads_file.load(args.heads, "hydra")
    if start.deep is not None:
        ap.error(f"--heads {args.heads}: heads of {start.blocks} blocks; this compares runs "
                 f"from 1-block heads")
    for blocks in args.blocks:
        torch.manual_seed(args.seed)
        run = Deep(model, start, blocks)
        before = {k: run.accuracy(v) for k, v in held.items()}
        began = time.perf_counter()
        loss = run.train(train, pairs, args)
        seconds = time.perf_counter() - began
        after = {k: run.accuracy(v) for k, v in held.items()}
        results.append({"blocks": blocks, "steps": args.steps, "before": before, "after": after,
                        "final_loss": round(loss, 4), "seconds": round(seconds, 1)})
        print(results[-1], flush=True)
    fmt = lambda a: " / ".join(f"{x:.3f}" for x in a)  # noqa: E731
    print(tabulate([[r["blocks"], r["steps"], fmt(r["before"]["chat"]), fmt(r["after"]["chat"]),
                     fmt(r["after"]["code"]), r["seconds"]] for r in results],
                   headers=["blocks", "steps", "chat top-1 before", "chat after", "code after",
                            "train s"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "positions": len(pairs),
                                           "results": results}, indent=1))


class Deep:
    """Hydra heads with ``blocks - 1`` zero-initialised residual blocks after the first."""

    def __init__(self, model, heads, blocks: int):
        self.lm = model.lm_head.weight.detach().to(torch.bfloat16)  # [V, H] frozen
        self.embed = model.model.embed_tokens.weight.detach()
        self.w = [t.clone().float().requires_grad_(True) for t in heads.w]
        self.b = heads.b.clone().float().requires_grad_(True)
        self.k, hidden = heads.num_heads, heads.b.shape[1]
        self.xw = torch.zeros(blocks - 1, self.k, hidden, hidden, requires_grad=True)  # [L, K, H, H]
        self.xb = torch.zeros(blocks - 1, self.k, hidden, requires_grad=True)

    def logits(self, data: dict, pairs: torch.Tensor) -> torch.Tensor:
        """``[P, K, V]`` the heads' logits at ``pairs`` (row, position)."""
        x = data["hidden"][pairs[:, 0], pairs[:, 1]].float()  # [P, H]
        r = heads_file.apply_hydra(x, self.embed[_path(data, pairs, self.k)].to(x.dtype),
                                   self.w, self.b)  # [P, K, H]
        for w, b in zip(self.xw, self.xb):
            r = r + F.silu(torch.einsum("pkh,koh->pko", r, w) + b)
        return r.to(torch.bfloat16) @ self.lm.t()

    def train(self, data: dict, pairs: torch.Tensor, args) -> float:
        opt = torch.optim.AdamW([*self.w, self.b, self.xw, self.xb], lr=args.lr, weight_decay=0.0)
        steps = args.steps
        sched = warmup_cosine(opt, steps, 50)
        weight = torch.tensor([DECAY ** k for k in range(self.k)])
        g = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(len(pairs), generator=g)
        loss = torch.tensor(float("nan"))
        for s in range(steps):
            at = order[(s * args.batch) % len(order):][:args.batch]
            batch = pairs[at]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = self.logits(data, batch)  # [P, K, V]
            loss = train_step(opt, sched, logits, _targets(data, batch, self.k), weight)
        return float(loss.detach())

    def accuracy(self, data: dict) -> list[float]:
        return top1(data, self.k, lambda rows, pairs: self.logits(data, pairs), rows=16)


if __name__ == "__main__":
    main()
