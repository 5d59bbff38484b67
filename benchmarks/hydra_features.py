"""Would EAGLE's feature loss help the Hydra heads? Held-out accuracy of heads trained on
the model's tokens alone against heads that also regress the model's own hidden state,
trained the same way, offline.

    python benchmarks/hydra_features.py --work W [--weights 0 0.3 1] [--steps 1000]

EAGLE (SafeAILab/EAGLE) trains its draft on two losses: cross-entropy on the next token
through the frozen LM head, and a smooth-L1 regression of the draft's output feature on
the base model's own feature there (the LM head's input), weighted 1.0 against the
cross-entropy's 0.1. The feature is a far richer target than one token id (576 numbers
against one choice), which matters where heads are short of data, as here. For Hydra head
``k`` at position ``t`` the feature it should produce is the model's hidden state at
``t + k + 1``: the LM head turns exactly that into the token the head is trained on. The
cached hidden states of a ``train-heads`` work directory already hold it, so the extra
loss costs no model call.

Each run starts from zero heads (as ``train-heads`` does without ``--init``) with the same
seed, steps and positions, and differs only in the feature loss's weight (0: tokens
alone). ``--work`` is a ``train-heads --arch hydra --data mixed --questions N`` work
directory: every training file in it is trained on except the last ``--chat-heldout``
self-asked chat rows (the chat column); ``heldout.safetensors`` (code chunks and docstring
questions) is the other column. Nothing is built into ``train-heads``: this measures
whether it would be worth it.
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
from rewriter.train_heads import (DECAY, _merge, _path, _step, _targets,
                                  _teacher_positions, heads_loss)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hydra_prefix import _load, _pairs, chat_split, top1, warmup_cosine  # noqa: E402
from step_time import machine  # noqa: E402

TRAIN_FILES = ("train.safetensors", "train-corpus.safetensors", "train-magpie.safetensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="train-heads work directory (with chat rows)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.3, 1.0],
                    help="feature-loss weights to compare (0: tokens alone)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256, help="positions a step")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--chat-heldout", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/hydra_features.json")
    ap.add_argument("--save", default=None,
                    help="write the trained heads here (a Hydra heads file, with one --weights); it "
                         "holds top-1 accuracies only, so tree='auto' would choose a chain from "
                         "it: for draft_rounds.py or a dynamic or given tree")
    args = ap.parse_args()
    if args.save is not None and len(args.weights) != 1:
        ap.error("--save keeps one set of heads: give exactly one --weights")
    if min(args.weights) < 0 or min(args.steps, args.batch, args.chat_heldout, args.heads) < 1:
        ap.error("--weights must be >= 0; --steps, --batch, --heads and --chat-heldout >= 1")
    work = Path(args.work)
    model, eos, chat, held = chat_split(ap, work, args.model, args.chat_heldout)
    parts = [chat] + [_load(work / f, eos) for f in TRAIN_FILES[:2] if (work / f).is_file()]
    train = _merge(parts)
    rows = len(train["tokens"])
    pairs = torch.cat([_pairs(train, torch.arange(i, min(i + 256, rows))) for i in range(0, rows, 256)])
    scale = train["hidden"].float().pow(2).mean().sqrt().item()  # the features' RMS
    print(f"{rows} training rows, {len(pairs)} positions, feature RMS {scale:.3f}", flush=True)
    results = []
    for weight in args.weights:
        torch.manual_seed(args.seed)
        run = Features(model, args.heads)
        began = time.perf_counter()
        ce, reg = run.train(train, pairs, args, weight)
        seconds = time.perf_counter() - began
        after = {k: run.accuracy(v) for k, v in held.items()}
        results.append({"feature_weight": weight, "steps": args.steps, "after": after,
                        "final_ce": round(ce, 4), "final_feature_loss": round(reg, 4),
                        "seconds": round(seconds, 1)})
        print(results[-1], flush=True)
        if args.save is not None:  # rank accuracies: top-1 alone was measured
            lm = model.lm_head.weight.detach()
            heads_file.Heads([w.detach() for w in run.w], run.b.detach(), lm.shape[0],
                             heads_file.probe_of(lm), [[a] for a in after["chat"]],
                             {"steps": args.steps, "seconds": round(seconds, 1), "rows": rows,
                              "positions": len(pairs), "lr": args.lr, "seed": args.seed},
                             arch="hydra").save(args.save)
    fmt = lambda a: " / ".join(f"{x:.3f}" for x in a)  # noqa: E731
    print(tabulate([[r["feature_weight"], r["steps"], fmt(r["after"]["chat"]),
                     fmt(r["after"]["code"]), r["final_ce"], r["seconds"]] for r in results],
                   headers=["feature weight", "steps", "chat top-1", "code top-1",
                            "final CE", "train s"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "positions": len(pairs),
                                           "feature_rms": scale, "cpu": machine(),
                                           "torch": torch.__version__, "results": results},
                                          indent=1))


class Features:
    """One-block Hydra heads from zero, as ``train-heads`` starts them."""

    def __init__(self, model, k: int):
        self.lm = model.lm_head.weight.detach().to(torch.bfloat16)  # [V, H] frozen
        self.embed = model.model.embed_tokens.weight.detach()
        hidden = self.lm.shape[1]
        self.k = k
        self.w = [torch.zeros(hidden, hidden * (j + 2), requires_grad=True) for j in range(k)]
        self.b = torch.zeros(k, hidden, requires_grad=True)

    def features(self, data: dict, pairs: torch.Tensor) -> torch.Tensor:
        """``[P, K, H]`` every head's output before the LM head at ``pairs`` (row, position)."""
        x = data["hidden"][pairs[:, 0], pairs[:, 1]].float()  # [P, H]
        return heads_file.apply_hydra(x, self.embed[_path(data, pairs, self.k)].to(x.dtype),
                                      self.w, self.b)

    def train(self, data: dict, pairs: torch.Tensor, args, feature_weight: float):
        opt = torch.optim.AdamW([*self.w, self.b], lr=args.lr, weight_decay=0.0)
        steps = args.steps
        sched = warmup_cosine(opt, steps, 50)
        decay = torch.tensor([DECAY ** j for j in range(self.k)])
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(args.seed))
        hidden = data["hidden"]
        ce_loss = reg_loss = torch.tensor(float("nan"))
        for s in range(steps):
            batch = pairs[order[(s * args.batch) % len(order):][:args.batch]]
            y = _targets(data, batch, self.k)  # [P, K]
            valid = (y != -100).float()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                r = self.features(data, batch)  # [P, K, H]
                logits = r.to(torch.bfloat16) @ self.lm.t()  # [P, K, V]
            ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                                 reduction="none").view_as(y)
            ce_loss = heads_loss(ce, valid, decay)
            # the model's own feature where head k's token comes from: position t + k + 1
            at = _teacher_positions(batch, self.k).clamp(max=hidden.shape[1] - 1)  # [P, K]
            target = hidden[batch[:, :1].expand_as(at), at].float()  # [P, K, H]
            reg = F.smooth_l1_loss(r.float(), target, reduction="none").mean(-1)  # [P, K]
            reg_loss = heads_loss(reg, valid, decay)
            _step(opt, sched, ce_loss + feature_weight * reg_loss if feature_weight else ce_loss)
        return float(ce_loss.detach()), float(reg_loss.detach())

    def accuracy(self, data: dict) -> list[float]:
        def logits_of(rows, pairs):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.features(data, pairs).to(torch.bfloat16) @ self.lm.t()
        return top1(data, self.k, logits_of, rows=16)


if __name__ == "__main__":
    main()
