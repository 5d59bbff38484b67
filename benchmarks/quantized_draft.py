"""Would a draft made of the model's own 4-bit weights pay for self-speculative decoding?

    python benchmarks/quantized_draft.py [--chunks 4] [--tokens 256] [--new 48]
                                         [--json benchmarks/results/quantized_draft.json]

Layer skipping cannot give SmolLM2-135M a draft that is both cheap and mostly right
(``docs/benchmarks.md``, issue 12). Another draft made of the same weights is the model
with ``Int4Weights``: SmolLM2's GGUF file is Q4_1, so its 4-bit codes are the file's own,
and torch multiplies them without dequantizing in bfloat16 on the CPU. This measures what
the cost model of ``rewriter.calibrate`` needs to predict such a draft, without building it:

- the draft's agreement: its argmax against the dense model's at every position of
  ``--chunks`` held-out code chunks of ``--tokens`` tokens (teacher-forced, one forward each);
- its cost: decode tokens/s of the dense model, of ``Int4Weights()`` and of
  ``Int4Weights(lm_head=True)``, batch 1, bfloat16, greedy, medians of 3 runs of ``--new``
  tokens after a warm-up, all in this process; float32 dense beside them (on a CPU without
  AMX it is the faster plain decode);
- the verification's cost: ``calibrate.verify_cost`` of the dense bfloat16 model;
- the predicted speed-up over dense bfloat16 decoding, ``E / C`` at the best draft length.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tabulate import tabulate

import rewriter
from rewriter.calibrate import best_k, verify_cost
from rewriter.corpus import load_corpus
from rewriter.passes import Int4Weights

MAX_DRAFT = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--json", default="benchmarks/results/quantized_draft.json")
    args = ap.parse_args()
    if min(args.chunks, args.tokens, args.new) < 1:
        ap.error("--chunks, --tokens and --new must be >= 1")
    dense = rewriter.from_pretrained("smollm2", dtype="bfloat16")
    drafts = {"Int4Weights()": rewriter.from_pretrained("smollm2", dtype="bfloat16",
                                                        passes=[Int4Weights()]),
              "Int4Weights(lm_head=True)": rewriter.from_pretrained(
                  "smollm2", dtype="bfloat16", passes=[Int4Weights(lm_head=True)])}
    ids = chunks(dense.tokenizer, args.chunks, args.tokens)  # [N, T]
    verify = verify_cost(dense.ir, MAX_DRAFT + 1)
    plain = tokens_per_s(dense, ids, args.new)
    f32 = tokens_per_s(rewriter.from_pretrained("smollm2", dtype="float32"), ids, args.new)
    rows, out = [], []
    with torch.inference_mode():
        target = dense(ids).argmax(-1)  # [N, T]
    for name, draft in drafts.items():
        with torch.inference_mode():
            agree = (draft(ids).argmax(-1) == target).float().mean().item()
        speed = tokens_per_s(draft, ids, args.new)
        predicted, k = best_k(agree, plain / speed, verify, MAX_DRAFT)
        out.append({"draft": name, "agreement": agree, "tokens_per_s": speed,
                    "draft_cost": plain / speed, "best_k": k, "predicted_speedup": predicted,
                    "predicted_vs_float32": predicted * plain / f32})
        rows.append([name, f"{agree:.3f}", f"{speed:.1f}", f"{plain / speed:.3f}", k,
                     f"{predicted:.2f}x", f"{predicted * plain / f32:.2f}x"])
    print(f"dense bfloat16 {plain:.1f} tok/s, dense float32 {f32:.1f} tok/s; verifying S "
          f"tokens costs {', '.join(f'{c:.2f}' for c in verify[2:])} steps (S = 2..{MAX_DRAFT + 1})")
    print(tabulate(rows, headers=["draft", "agreement", "tok/s", "cost a step", "best k",
                                  "predicted vs bf16 plain", "vs float32 plain"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "args": vars(args), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dense_bf16_tokens_per_s": plain, "dense_f32_tokens_per_s": f32,
        "verify_cost": verify, "drafts": out}, indent=1))


def chunks(tok, n: int, length: int) -> torch.Tensor:
    """``[n, length]`` token ids: the first held-out source files long enough, one chunk each."""
    out = []
    for _, text in load_corpus("heldout"):
        row = tok.encode(text).ids
        if len(row) >= length:
            out.append(row[:length])
        if len(out) == n:
            return torch.tensor(out)
    raise SystemExit(f"only {len(out)} held-out files have {length} tokens")


def tokens_per_s(model, ids: torch.Tensor, new: int) -> float:
    prompt = ids[:1, :128]
    model.generate(prompt, max_new_tokens=8)  # warm-up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        model.generate(prompt, max_new_tokens=new)
        times.append(time.perf_counter() - t)
    return new / statistics.median(times)


if __name__ == "__main__":
    main()
