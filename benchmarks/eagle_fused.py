"""Would EAGLE-3's fused features help the draft layer here? Held-out top-1 of the same
layer reading the model's last feature alone, and reading it beside two earlier layers'
hidden states, trained on the same rows from the same start, offline.

    python benchmarks/eagle_fused.py --work W [--steps 800] [--layers 3 15]

EAGLE-3 feeds its draft layer ``fc([h_low; h_mid; h_high])``: three of the model's
decoder layers' outputs instead of the LM head's input alone, so that the draft sees
what the model knew before it committed to the next token. Here the ``fused`` draft reads
``fuse([n(h_a); n(h_b); f])``: the outputs of decoder layers ``--layers`` (1-based, as
Hugging Face's ``hidden_states`` counts them), each RMS-normalised without a weight (the
residual stream's scale grows with depth; a plain norm puts them on ``f``'s scale), beside
the model's last feature ``f``. ``fuse`` ``[H, 3H]`` starts as ``[0 | 0 | I]``: at step 0 the fused
draft is the plain one (the other parameters are drawn the same), so any difference is
what the two earlier layers taught it (the zero columns still get gradients). The draft's own output
feature is fed back unfused, as EAGLE-3 feeds its own.

The earlier layers' states are computed once with the model (bfloat16, as the work
directory's were) and cached beside the work directory's files (``fused-L1-L2-*.
safetensors``, with a probe of the model's LM head); the recomputed last feature is checked
against the stored one first, and a cache of another model is refused, so nothing made
another way is silently mixed in.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eagle_draft import TRAIN_FILES, Draft, report  # noqa: E402
from hydra_prefix import _load, chat_split  # noqa: E402

from rewriter import eagle  # noqa: E402
from rewriter.heads import probe_of  # noqa: E402
from rewriter.train_heads import _merge  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="train-heads work directory (with chat rows)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", type=int, nargs=2, default=[3, 15],
                    help="the two earlier decoder layers read (1-based outputs)")
    ap.add_argument("--variants", nargs="+", default=["last", "fused"], choices=["last", "fused"])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--chat-heldout", type=int, default=256)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="benchmarks/results/eagle_fused.json")
    args = ap.parse_args()
    if min(args.steps, args.rows, args.positions, args.depth, args.chat_heldout) < 1:
        ap.error("--steps, --rows, --positions, --depth and --chat-heldout must be >= 1")
    work = Path(args.work)
    model, eos, chat, held = chat_split(ap, work, args.model, args.chat_heldout)
    n_layers = model.config.num_hidden_layers
    if not all(1 <= a <= n_layers for a in args.layers):
        ap.error(f"--layers {args.layers}: the model has decoder layers 1 .. {n_layers}")
    cut = len(chat["tokens"])
    parts = {"train-magpie": None, **{f.removesuffix(".safetensors"): None for f in TRAIN_FILES
                                      if (work / f).is_file()}, "heldout": None}
    for name in parts:
        parts[name] = earlier_states(model, work, name, args.layers)  # [N, L, 2H]
    chat["hidden"] = _fused(chat["hidden"], parts["train-magpie"][:cut])
    held["chat"]["hidden"] = _fused(held["chat"]["hidden"], parts["train-magpie"][cut:])
    held["code"]["hidden"] = _fused(held["code"]["hidden"], parts["heldout"])
    others = [_load(work / f, eos) for f in TRAIN_FILES if (work / f).is_file()]
    for f, p in zip([f for f in TRAIN_FILES if (work / f).is_file()], others):
        p["hidden"] = _fused(p["hidden"], parts[f.removesuffix(".safetensors")])
    train = _merge([chat, *others])
    print(f"{len(train['tokens'])} training rows of {train['tokens'].shape[1]} positions, "
          f"features {train['hidden'].shape[2]}", flush=True)
    results = []
    for variant in args.variants:
        torch.manual_seed(args.seed)
        draft = FusedDraft(model, args.depth, fused=variant == "fused")
        began = time.perf_counter()
        loss = draft.train(train, args)
        seconds = time.perf_counter() - began
        after = {k: draft.accuracy(v) for k, v in held.items()}
        results.append({"variant": variant, "steps": args.steps, "after": after,
                        "final_loss": round(loss, 4), "seconds": round(seconds, 1)})
        print(results[-1], flush=True)
    report(args, results, "variant", "draft reads")

def _fused(last: torch.Tensor, earlier: torch.Tensor) -> torch.Tensor:
    """``[N, L, 3H]``: the two earlier layers' states, then the last feature."""
    if earlier.shape[:2] != last.shape[:2]:
        raise SystemExit(f"eagle_fused: cached states {tuple(earlier.shape)} do not match the "
                         f"work directory's rows {tuple(last.shape)}")
    return torch.cat([earlier.to(last.dtype), last], -1)


def earlier_states(model, work: Path, name: str, layers: list, batch: int = 8) -> torch.Tensor:
    """``[N, L, 2H]`` bfloat16: decoder layers ``layers``' outputs at every position of the
    file's rows, RMS-normalised without a weight; computed once, then read from the cache."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    cache = work / f"fused-{layers[0]}-{layers[1]}-{name}.safetensors"
    probe = json.dumps(probe_of(model.lm_head.weight.detach()))
    if cache.is_file():
        with safe_open(str(cache), "pt") as f:
            if (f.metadata() or {}).get("probe") != probe:
                raise SystemExit(f"eagle_fused: {cache} was made with another model: delete it")
        return load_file(str(cache))["states"]
    rows = load_file(str(work / f"{name}.safetensors"))
    tokens, stored = rows["tokens"], rows["hidden"]  # [N, L], [N, L, H]
    m = copy.deepcopy(model).to(torch.bfloat16).eval()  # the drafts keep the model's own dtype
    out, began = [], time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(tokens), batch):
            hs = m.model(tokens[i:i + batch], output_hidden_states=True).hidden_states
            if i == 0:  # the same rows, the same model: the stored feature comes back (to
                # bfloat16's noise: the median position within a few percent)
                last, want = hs[-1].float(), stored[:batch].float()  # hs[-1]: the LM head's input
                err = ((last - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).median().item()
                if err > 0.05:
                    raise SystemExit(f"eagle_fused: {name}: the recomputed last feature differs "
                                     f"from the stored one by {err:.1%} at the median position: "
                                     f"not the rows this model made")
            out.append(torch.cat([F.rms_norm(hs[a].float(), (hs[a].shape[-1],)) for a in layers],
                                 -1).to(torch.bfloat16))  # [b, L, 2H]
    states = torch.cat(out)
    print(f"{name}: {tuple(states.shape)} earlier states in {time.perf_counter() - began:.0f} s",
          flush=True)
    save_file({"states": states.contiguous()}, str(cache), metadata={"probe": probe})
    return states


class FusedDraft(Draft):
    """``Draft`` (random start) reading ``[n(h_a); n(h_b); f]`` ``[B, L, 3H]``: through
    ``fuse`` where ``fused``, else ``f`` alone (the plain draft, on the same data)."""

    def __init__(self, model, depth: int, fused: bool):
        super().__init__(model, "random", depth)
        self.fused = fused
        h = self.shape.hidden
        if fused:  # both variants start from the same layer, and the same function
            w = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], 1)  # [H, 3H]: f through
            self.p["fuse.weight"] = w.to(self.device).requires_grad_(True)

    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list:
        h = self.shape.hidden
        x = hidden.to(self.device, torch.float32)  # [B, L, 3H]
        x = x @ self.p["fuse.weight"].t() if self.fused else x[..., 2 * h:]  # [B, L, H]
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1).to(self.device)
        return eagle.unroll(self.p, self.shape, x, self.embed[nxt], self.depth)


if __name__ == "__main__":
    main()
