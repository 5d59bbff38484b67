"""Would Hydra++'s prefix layer pay here? Held-out accuracy of Hydra heads with and without
one extra decoder layer over the model's hidden states, trained the same way, offline.

    python benchmarks/hydra_prefix.py --work hydra2048.safetensors.work \
        --heads hydra2048.safetensors [--steps 400] [--json benchmarks/results/hydra_prefix.json]

``--work`` is the work directory ``rewriter train-heads smollm2 --arch hydra`` leaves
beside its output (``train.safetensors``, ``heldout.safetensors``: the model's own greedy
continuations and their hidden states); ``--heads`` the Hydra heads trained there, where
both runs start. Hydra++ (zankner/Hydra, ``--hydra_head_arch prefix-mlp``) runs one more
Llama decoder layer over the base model's hidden states, with its own KV cache, and
feeds its output to the heads. Here that layer is a copy of the model's last one with its
two output projections zeroed, so it starts as the identity and both runs start from the
same accuracies. Each step runs the layer causally over ``--rows`` whole rows, then trains
on ``--positions`` of their positions (cross-entropy on the model's own next tokens,
heads weighted 0.8^k as ``train_heads``); the heads-only run takes the same steps and
positions. Nothing is built into the IR or the runtime: this measures whether it would
be worth it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from rewriter import heads as heads_file
from rewriter.train_heads import DECAY, _ends, _eos_ids, _path, _step, _targets, heads_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="train-heads work directory")
    ap.add_argument("--heads", required=True, help="Hydra heads trained on it (the start)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/hydra_prefix.json")
    args = ap.parse_args()
    for split in ("train", "heldout"):
        if not (Path(args.work) / f"{split}.safetensors").is_file():
            ap.error(f"--work {args.work}: no {split}.safetensors (the work directory "
                     f"`rewriter train-heads ... --arch hydra` leaves beside its output)")
    for name in ("steps", "rows", "positions"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from quickstart import load
    model, tok = load(args.model)
    data = {s: _load(Path(args.work) / f"{s}.safetensors", _eos_ids(model, tok))
            for s in ("train", "heldout")}
    if heads_file.load(args.heads, "hydra").deep is not None:
        ap.error(f"--heads {args.heads}: heads of more than one block; this measures 1-block heads")
    results = []
    for mode in ("heads", "prefix"):
        torch.manual_seed(args.seed)
        run = Run(model, heads_file.load(args.heads, "hydra"), mode == "prefix")
        before = run.accuracy(data["heldout"])
        started = time.perf_counter()
        loss = run.train(data["train"], args)
        results.append({"run": mode, "steps": args.steps, "before": before,
                        "after": run.accuracy(data["heldout"]), "final_loss": round(loss, 4),
                        "seconds": round(time.perf_counter() - started, 1)})
        print(mode, results[-1], flush=True)
    print(tabulate([[r["run"], r["steps"], " / ".join(f"{a:.3f}" for a in r["before"]),
                     " / ".join(f"{a:.3f}" for a in r["after"]), r["seconds"]] for r in results],
                   headers=["run", "steps", "held-out top-1 before", "after", "train s"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def chat_split(ap, work: Path, model_name: str, heldout: int) -> tuple:
    """``(model, eos ids, chat rows to train on, {"chat": the last ``heldout`` chat rows,
    "code": heldout.safetensors})`` of a ``train-heads --arch hydra --data mixed
    --questions N`` work directory; ``ap.error`` where it is not one or has too few rows."""
    for name in ("train-magpie", "heldout"):
        if not (work / f"{name}.safetensors").is_file():
            ap.error(f"--work {work}: no {name}.safetensors (a `train-heads --arch hydra "
                     f"--data mixed --questions N` work directory)")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from quickstart import load
    model, tok = load(model_name)
    eos = _eos_ids(model, tok)
    chat = _load(work / "train-magpie.safetensors", eos)
    n = len(chat["tokens"])
    if heldout >= n:
        ap.error(f"--chat-heldout {heldout}: the work directory has {n} chat rows")
    cut = n - heldout
    return (model, eos, {k: v[:cut] for k, v in chat.items()},
            {"chat": {k: v[cut:] for k, v in chat.items()},
             "code": _load(work / "heldout.safetensors", eos)})


def _load(path: Path, eos: set) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), framework="pt") as f:
        settings = json.loads((f.metadata() or {})["settings"])
    data = load_file(str(path))
    data["end"] = _ends(data, settings["new_tokens"], eos)
    return data


class Run:
    """Hydra heads, optionally after a prefix layer, on cached hidden states."""

    def __init__(self, model, heads, prefix: bool):
        self.lm = model.lm_head.weight.detach().to(torch.bfloat16)  # [V, H] frozen
        self.embed = model.model.embed_tokens.weight.detach()
        self.w = [t.clone().float().requires_grad_(True) for t in heads.w]
        self.b = heads.b.clone().float().requires_grad_(True)
        self.k = heads.num_heads
        c = model.config
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = c.hidden_size // self.nh
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") \
            or getattr(c, "rope_theta", 10000.0)
        self.inv = 1.0 / theta ** (torch.arange(0, self.hd, 2).float() / self.hd)
        self.eps = c.rms_norm_eps
        self.p = None
        if prefix:  # the last layer, its output projections zeroed: the identity at first
            self.p = {n: t.detach().clone().float() for n, t in model.model.layers[-1].named_parameters()}
            self.p["self_attn.o_proj.weight"].zero_()
            self.p["mlp.down_proj.weight"].zero_()
            for t in self.p.values():
                t.requires_grad_(True)

    def params(self) -> list:
        return [*self.w, self.b, *(self.p.values() if self.p else [])]

    def prefix(self, h: torch.Tensor) -> torch.Tensor:
        """One Llama decoder layer, causal, over ``h`` ``[B, S, H]``."""
        if self.p is None:
            return h
        p, (b, s, _), nh, nkv, hd = self.p, h.shape, self.nh, self.nkv, self.hd
        x = F.rms_norm(h, (h.shape[-1],), p["input_layernorm.weight"], self.eps)
        q = (x @ p["self_attn.q_proj.weight"].t()).view(b, s, nh, hd).transpose(1, 2)  # [B, h, S, d]
        k = (x @ p["self_attn.k_proj.weight"].t()).view(b, s, nkv, hd).transpose(1, 2)
        v = (x @ p["self_attn.v_proj.weight"].t()).view(b, s, nkv, hd).transpose(1, 2)
        f = torch.arange(s)[:, None].float() * self.inv[None]  # [S, d/2]
        cos, sin = torch.cat([f.cos()] * 2, -1), torch.cat([f.sin()] * 2, -1)
        rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin  # noqa: E731
        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, nh * hd)
        h = h + a @ p["self_attn.o_proj.weight"].t()
        x = F.rms_norm(h, (h.shape[-1],), p["post_attention_layernorm.weight"], self.eps)
        return h + (F.silu(x @ p["mlp.gate_proj.weight"].t()) * (x @ p["mlp.up_proj.weight"].t())) \
            @ p["mlp.down_proj.weight"].t()

    def logits(self, data: dict, rows: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """``[P, K, V]`` the heads' logits at ``pairs`` (row, position) of ``rows``."""
        hs = self.prefix(data["hidden"][rows].float())  # [R, L, H]
        local = torch.searchsorted(rows, pairs[:, 0].contiguous())  # rows sorted: each pair's row in hs
        x = hs[local, pairs[:, 1]]
        r = heads_file.apply_hydra(x, self.embed[_path(data, pairs, self.k)].to(x.dtype), self.w, self.b)
        return r.to(torch.bfloat16) @ self.lm.t()

    def train(self, data: dict, args) -> float:
        opt = torch.optim.AdamW(self.params(), lr=args.lr, weight_decay=0.0)
        return train_rows(opt, data, args, self.logits, self.k, warmup=30)

    def accuracy(self, data: dict) -> list[float]:
        return top1(data, self.k, lambda rows, pairs: self.logits(data, rows, pairs))


def train_rows(opt, data: dict, args, logits_of, depth: int, warmup: int,
               clip: float | None = None, every: int = 0, device="cpu",
               seconds: float | None = None, checkpoint=None, targets=None) -> float:
    """``args.steps`` steps on ``args.positions`` positions of ``args.rows`` random whole
    rows each (``row_batch``, seeded by ``args.seed``); ``logits_of(data, rows, pairs)``
    ``[P, depth, V]`` on ``device`` under bfloat16 autocast, trained by ``train_step`` on
    the model's own tokens weighted ``DECAY ** k``. Prints the loss every ``every`` steps
    (0: never). ``seconds``: a time budget as well; the schedule's cosine follows whichever
    of steps and seconds runs out first, and training ends there. ``checkpoint(step)`` is
    called after every ``every``-th step. ``targets``: maps the model's tokens ``[P, K]``
    to the logits' columns (a trimmed draft vocabulary), -100 where none is. Returns the
    last step's loss (NaN when no step ran); ``args.steps_done`` is set to the steps taken."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"train_rows: seconds must be > 0 (or None), got {seconds!r}")
    if checkpoint is not None and not every:
        raise ValueError("train_rows: a checkpoint is called every `every` steps: give every >= 1")
    began = time.perf_counter()

    def done(s: int) -> float:  # the fraction of the budget spent after s steps
        return min(1.0, max(s / args.steps, (time.perf_counter() - began) / seconds))
    step = 0
    # without a budget, exactly warmup_cosine's rates (to the last bit, as before)
    sched = warmup_cosine(opt, args.steps, warmup) if seconds is None else \
        torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * done(s))))
    weight = torch.tensor([DECAY ** k for k in range(depth)], device=device)
    g = torch.Generator().manual_seed(args.seed)
    loss = torch.tensor(float("nan"))
    while (step < args.steps if seconds is None else done(step) < 1.0):
        rows, pairs = row_batch(data, args.rows, args.positions, g)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = logits_of(data, rows, pairs)  # [P, depth, V]
        y = _targets(data, pairs, depth)
        y = (y if targets is None else targets(y)).to(device)
        loss = train_step(opt, sched, logits, y, weight, clip=clip)
        step += 1
        if every and (step - 1) % every == 0:
            print(f"step {step - 1} loss {loss.detach().item():.3f} "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
        if checkpoint is not None and step % every == 0:
            checkpoint(step)
    args.steps_done = step
    return float(loss.detach())


def warmup_cosine(opt, steps: int, warmup: int):
    """The learning rate's schedule: linear warm-up over ``warmup`` steps, then a cosine to
    zero at ``steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def row_batch(data: dict, rows: int, positions: int, g: torch.Generator) -> tuple:
    """``(rows, pairs)``: ``rows`` rows drawn with replacement (sorted, without repeats),
    and up to ``positions`` of their (row, position) pairs, drawn without replacement."""
    chosen = torch.randint(0, len(data["tokens"]), (rows,), generator=g).unique()  # sorted
    pairs = _pairs(data, chosen)
    return chosen, pairs[torch.randperm(len(pairs), generator=g)[:positions]]


def train_step(opt, sched, logits: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
               clip: float = None) -> torch.Tensor:
    """One step on the heads' logits ``[P, K, V]`` against the model's tokens ``y`` ``[P, K]``
    (-100: past a row's end), heads weighted as ``train_heads``; ``clip``: the gradients'
    largest norm, if any."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100,
                         reduction="none").view_as(y)
    loss = heads_loss(ce, (y != -100).float(), weight)
    if clip is None:
        _step(opt, sched, loss)
        return loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([t for group in opt.param_groups for t in group["params"]], clip)
    opt.step()
    sched.step()
    return loss


def top1(data: dict, k: int, logits_of, rows: int = 8, targets=None) -> list[float]:
    """Top-1 of each of ``k`` heads on every generated position (given the right path);
    ``logits_of(rows, pairs)``: the heads' logits ``[P, K, V]`` at ``pairs`` of ``rows``;
    ``targets``: the model's tokens to the logits' columns (a token with none: -1, a miss)."""
    hits, count = torch.zeros(k), torch.zeros(k)
    with torch.inference_mode():
        for i in range(0, len(data["tokens"]), rows):
            chunk = torch.arange(i, min(i + rows, len(data["tokens"])))
            pairs = _pairs(data, chunk)
            y = _targets(data, pairs, k)
            ok = y != -100
            y = y if targets is None else targets(y)
            hits += ((logits_of(chunk, pairs).argmax(-1).cpu() == y) & ok).sum(0).float()
            count += ok.sum(0).float()
    return [round(a, 4) for a in (hits / count.clamp_min(1)).tolist()]


def _pairs(data: dict, rows: torch.Tensor) -> torch.Tensor:
    """``[P, 2]`` (row, position) whose head-0 target is generated text (as ``train_heads``)."""
    out = [(r, t) for r in rows.tolist()
           for t in range(int(data["start"][r]) - 1, int(data["end"][r]) - 2)]
    return torch.tensor(out, dtype=torch.int64).view(-1, 2)


if __name__ == "__main__":
    main()
