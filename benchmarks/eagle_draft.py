"""Would an EAGLE draft beat the Hydra heads here? Held-out accuracy of one decoder layer
that drafts autoregressively over the model's features, trained on the same work
directory, offline.

    python benchmarks/eagle_draft.py --work W [--init random last] [--steps 800]
        [--reference smollm2]

EAGLE (SafeAILab/EAGLE) drafts with one decoder layer of its own. At position ``i`` it
reads ``fc([f_i; e(x_{i+1})])``: the model's feature there (the LM head's input) beside
the embedding of the next token, and attends over the same inputs at earlier positions
with a KV cache of its own. Its output is a feature: the frozen LM head turns it into the
token after ``x_{i+1}``. Deeper drafts feed the draft's own output feature back in place
of the model's. Hydra's heads read only ``f_t`` and the path's embeddings; the draft layer
also attends to the whole context, which is what heads lack on free text.

Training follows EAGLE-3's "training-time test": the draft is unrolled ``--depth`` steps
on its own features, and each step's cross-entropy (on the model's own greedy tokens,
weighted 0.8^k as ``train_heads``) is trained on; no feature regression (the Hydra heads
lost accuracy from it, ``hydra_features.py``). Step ``s``'s query at position ``i`` (a
chain started at ``t = i - s + 1``) sees step 1's keys at positions ``<= t`` (made from
the model's true features) and step ``m``'s key at ``t + m - 1`` for ``m = 2 .. s``: the
keys a draft holds at inference. So held-out top-1 of step ``s`` is comparable with Hydra
head ``s - 1``'s (both given the right path of tokens).

``--work`` is a ``train-heads --arch hydra --data mixed --questions N`` work directory,
split as ``hydra_features.py`` splits it (the last ``--chat-heldout`` chat rows held out;
``heldout.safetensors`` the code column). ``--init random`` starts the layer from ``N(0,
0.02)``; ``last`` from a copy of the model's last decoder layer (``fc`` the identity on the
feature). The draft's math is ``rewriter.eagle``; nothing is built into the IR or the
runtime: this measures whether it would be worth building.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

from rewriter import eagle, eagle_file
from rewriter.train_heads import _merge, produced

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hydra_prefix import _load, chat_split, top1, train_rows  # noqa: E402
from step_time import machine  # noqa: E402

TRAIN_FILES = ("train.safetensors", "train-corpus.safetensors")


def produced_counts(parts: list, vocab: int) -> torch.Tensor:
    """``[V]`` how often the model produced each token in the training data (the draft
    file's ``counts``: a trimmed draft vocabulary keeps the most frequent)."""
    return sum(produced(p, vocab) for p in parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="train-heads work directory (with chat rows)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--init", nargs="*", default=["random", "last"], choices=["random", "last"],
                    help="the drafts to train (none: only --reference is measured)")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--rows", type=int, default=8, help="whole rows the layer runs over a step")
    ap.add_argument("--positions", type=int, default=256, help="chain starts trained on a step")
    ap.add_argument("--depth", type=int, default=4, help="draft steps unrolled (Hydra: heads)")
    ap.add_argument("--chat-heldout", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", default=None,
                    help="a Hydra heads file (or 'smollm2': the shipped ones) measured on the "
                         "same held-out rows, for comparison")
    ap.add_argument("--json", default="benchmarks/results/eagle_draft.json")
    ap.add_argument("--save", default=None,
                    help="write the trained draft here (a draft file, rewriter.eagle_file); "
                         "with one --init")
    args = ap.parse_args()
    if min(args.steps, args.rows, args.positions, args.depth, args.chat_heldout) < 1:
        ap.error("--steps, --rows, --positions, --depth and --chat-heldout must be >= 1")
    if not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    if args.save is not None and len(args.init) != 1:
        ap.error("--save keeps one trained draft: give exactly one --init")
    if not args.init and args.reference is None:
        ap.error("nothing to measure: give --init, --reference, or both")
    work = Path(args.work)
    model, eos, chat, held = chat_split(ap, work, args.model, args.chat_heldout)
    parts = [chat] + [_load(work / f, eos) for f in TRAIN_FILES if (work / f).is_file()]
    train = _merge(parts)
    print(f"{len(train['tokens'])} training rows of {train['tokens'].shape[1]} positions", flush=True)
    results = []
    if args.reference is not None:
        from hydra_prefix import Run
        from rewriter import heads as heads_file
        from rewriter.errors import RewriterError
        try:
            heads = heads_file.load(args.reference, "hydra")
        except (OSError, ValueError, RewriterError) as e:
            ap.error(f"--reference {args.reference}: {e}")
        if heads.deep is not None:
            ap.error(f"--reference {args.reference}: heads of more than one block; this "
                     f"measures 1-block heads")
        ref = Run(model, heads, prefix=False)
        results.append({"init": f"Hydra heads {args.reference}", "steps": 0,
                        "after": {k: ref.accuracy(v) for k, v in held.items()}})
        print(results[-1], flush=True)
    for init in args.init:
        torch.manual_seed(args.seed)
        draft = Draft(model, init, args.depth)
        began = time.perf_counter()
        loss = draft.train(train, args)
        seconds = time.perf_counter() - began
        after = {k: draft.accuracy(v) for k, v in held.items()}
        results.append({"init": init, "steps": args.steps, "after": after,
                        "final_loss": round(loss, 4), "seconds": round(seconds, 1),
                        "parameters": sum(p.numel() for p in draft.p.values())})
        print(results[-1], flush=True)
        if args.save is not None:
            eagle_file.made({n: t.detach().cpu() for n, t in draft.p.items()}, draft.shape,
                            model.lm_head.weight.detach(), accuracy=after["chat"],
                            trained={"steps": args.steps, "seconds": round(seconds, 1),
                                     "rows": len(train["tokens"]), "lr": args.lr,
                                     "seed": args.seed, "depth": args.depth,
                                     "accuracy_on": "held-out self-asked chat rows"},
                            counts=produced_counts(parts, model.lm_head.weight.shape[0])
                            ).save(args.save)
    report(args, results, "init", "init")


def report(args, results: list, key: str, label: str) -> None:
    """Print the held-out table (one row per draft, named by ``result[key]``, the column
    headed ``label``) and write ``args.json``: the arguments, machine and results."""
    fmt = lambda a: " / ".join(f"{x:.3f}" for x in a)  # noqa: E731
    print(tabulate([[r[key], r["steps"], fmt(r["after"]["chat"]), fmt(r["after"]["code"]),
                     r.get("final_loss"), r.get("seconds")] for r in results],
                   headers=[label, "steps", "chat top-1 by step", "code top-1 by step",
                            "final loss", "train s"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "cpu": machine(),
                                           "torch": torch.__version__, "results": results},
                                          indent=1))


class Draft:
    """EAGLE's draft (``rewriter.eagle``) on the model's frozen embeddings and LM head."""

    def __init__(self, model, init: str, depth: int, device="cpu"):
        c = model.config
        self.device = torch.device(device)
        self.lm = model.lm_head.weight.detach().to(self.device, torch.bfloat16)  # [V, H] frozen
        self.vocab = None  # all of it; trim(): the ids of a trimmed draft vocabulary
        self.embed = model.model.embed_tokens.weight.detach().to(self.device, torch.float32)  # [V, H]
        self.depth = depth
        self.shape = eagle.Shape.of(c)
        hidden = c.hidden_size
        last = dict(model.model.layers[-1].named_parameters())
        self.p = {}
        for name in eagle.LAYER:  # drawn from the global generator, in this order
            t = last[name].detach().float().cpu().clone()  # drawn by the CPU's generator
            if init == "random":
                t = torch.ones_like(t) if name.endswith("layernorm.weight") else torch.randn_like(t) * 0.02
            self.p[name] = t
        fc = torch.randn(hidden, 2 * hidden) * 0.02  # [H, 2H]
        if init == "last":  # the feature through, the embedding not: the model's last layer
            fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        self.p["fc.weight"], self.p["fc.bias"] = fc, torch.zeros(hidden)
        self.p["norm.weight"] = model.model.norm.weight.detach().float().cpu().clone()
        # drawn on the CPU, as before, then moved: the same start on every device
        self.p = {n: t.to(self.device).requires_grad_(True) for n, t in self.p.items()}

    def trim(self, ids: torch.Tensor) -> None:
        """Train and measure on the draft vocabulary ``ids`` alone (sorted token ids, as
        ``eagle_file.draft_vocab`` gives them): the logits are the LM head's rows for
        them, ``[P, S, N]``, as ``EagleDraft(draft_vocab=N)`` drafts. A target outside
        them is no training target (the draft can never propose it) and always a miss in
        ``accuracy``, as it is in the runtime."""
        if self.vocab is not None:  # the LM head is trimmed already: its rows are not ids
            raise ValueError("Draft.trim: the draft vocabulary is chosen once")
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or not len(ids) \
                or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= self.lm.shape[0]:
            raise ValueError("Draft.trim: ids must be sorted distinct token ids of the model's vocabulary")
        ids = ids.to("cpu", torch.int64)
        self.lm = self.lm[ids.to(self.device)]  # [N, H]
        self.vocab = ids

    def targets(self, missing: int):
        """``y -> y'``: the model's tokens as indices into the draft vocabulary, a token
        outside it ``missing`` (None: the full vocabulary, nothing to map)."""
        if self.vocab is None:
            return None
        index = torch.full((int(self.vocab[-1]) + 1,), missing, dtype=torch.int64)
        index[self.vocab] = torch.arange(len(self.vocab))
        def remap(y: torch.Tensor) -> torch.Tensor:  # -100 (past a row's end) stays
            inside = (y >= 0) & (y < len(index))
            return torch.where(inside, index[y.clamp(0, len(index) - 1)], torch.where(y >= 0, missing, y))
        return remap

    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list:
        """``eagle.unroll`` over whole rows ``[B, L]``: the next token at the last position
        is padding, and no chain read there is trained on."""
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1).to(self.device)  # [B, L] x_{i+1}
        return eagle.unroll(self.p, self.shape, hidden.to(self.device, torch.float32),
                            self.embed[nxt], self.depth)

    def logits(self, data: dict, rows: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """``[P, S, V]`` every draft step's logits for chains started at ``pairs`` (row,
        position) of the sorted ``rows``."""
        outs = self.unroll(data["hidden"][rows], data["tokens"][rows])
        local = torch.searchsorted(rows, pairs[:, 0].contiguous()).to(self.device)
        at = pairs[:, 1].to(self.device)
        length = outs[0].shape[1]
        g = torch.stack([o[local, (at + s).clamp(max=length - 1)] for s, o in enumerate(outs)], 1)
        return g.to(torch.bfloat16) @ self.lm.t()  # [P, S, V]

    # -------------------------------------------------------------------- training
    def train(self, data: dict, args, seconds: float | None = None, checkpoint=None) -> float:
        """``args.steps`` steps (``seconds``: or until they are spent); ``checkpoint(step)``
        every 100 steps."""
        opt = torch.optim.AdamW(list(self.p.values()), lr=args.lr, weight_decay=0.0)
        # EAGLE clips at 0.5 too (by value; here by norm)
        return train_rows(opt, data, args, self.logits, self.depth, warmup=50, clip=0.5,
                          every=100, device=self.device, seconds=seconds, checkpoint=checkpoint,
                          targets=self.targets(missing=-100))

    def accuracy(self, data: dict) -> list[float]:
        def logits_of(rows, pairs):
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return self.logits(data, rows, pairs)
        return top1(data, self.depth, logits_of, rows=8, targets=self.targets(missing=-1))


if __name__ == "__main__":
    main()
