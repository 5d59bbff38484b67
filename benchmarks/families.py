"""A real checkpoint of a model family through the runtime, against Hugging Face's model.

    python benchmarks/families.py [--model smollm2|gemma3-270m|PATH] [--dtypes float32 bfloat16]
                                  [--prompt 64] [--new 32] [--repeat 3] [--int4]
                                  [--ppl-chunks 4] [--ppl-length 256] [--json PATH]

One process, one model: the time to load the GGUF file and to ``optimize`` it with no
passes (trace, lift, lowering); perplexity through the KV-cache runtime (``Engine.score``,
as ``rewriter.api.eval`` computes it) against Hugging Face's on the same held-out code
chunks; decode tokens/s at batch 1 per dtype against Hugging Face ``generate`` in the same
run (greedy, the same new tokens, no early stop; the ratio of the medians of ``--repeat``
timed runs after a warm-up), with whether the tokens are the same; and KV-cache bytes per
token at the context length (``Engine.kv_bytes_per_token``) against a full cache in every
layer. ``--int4`` adds ``Int4Weights`` in bfloat16 (the CPU int4 kernel's dtype): its
largest weight change against the file's dequantized weights, perplexity and speed; and
``Int4Weights(exact=True)`` in float32: only the linears the file holds in 4 bits exactly
(Q4_0/Q4_1/Q4_K), the model's outputs unchanged.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import rewriter
from rewriter.api.eval import heldout_chunks, perplexity
from rewriter.models import gguf
from rewriter.models.checkpoints import cast

from common import describe, timed_all, write_json


def load(name: str):
    """(float32 model, tokenizer, seconds to load both)."""
    start = time.perf_counter()
    tok = gguf.load_gguf_tokenizer(name)
    model = gguf.load_gguf_model(name)
    return model, tok, time.perf_counter() - start


def hf_perplexity(model, chunks: torch.Tensor, batch: int = 1) -> float:
    """``rewriter.api.eval.perplexity``'s figure from Hugging Face's forward: the second
    half of each chunk ``[N, T]`` given everything before it (a chunk at a time: the
    logits of a 262k-token vocabulary are 1 MB a position)."""
    total, count = 0.0, 0
    prefix = chunks.shape[1] // 2
    with torch.no_grad():
        for i in range(0, len(chunks), batch):
            x = chunks[i:i + batch]
            logits = model(x).logits[:, prefix - 1:-1].float()  # [b, T - prefix, V]
            logp = logits.log_softmax(-1).gather(-1, x[:, prefix:, None])[..., 0]
            total, count = total - logp.sum().item(), count + logp.numel()
    return math.exp(total / count)


def full_cache_bytes(config, dtype: torch.dtype) -> int:
    """KV bytes per token with every layer caching every token: K and V, each KV head."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


def decode(model, engine, ids: torch.Tensor, new: int, repeat: int) -> dict:
    """Batch-1 decode tokens/s of ``engine`` and Hugging Face ``generate``, same run."""
    ours, t_ours = timed_all(lambda: engine.generate(ids, max_new_tokens=new, eos_token_id=[]),
                             repeat)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
              do_sample=False)
    with torch.inference_mode():
        ref, t_hf = timed_all(lambda: model.generate(ids, **kw), repeat)
    ours_s, hf_s = statistics.median(t_ours), statistics.median(t_hf)
    return {"rewriter_tok_s": new / ours_s, "hf_tok_s": new / hf_s, "speedup": hf_s / ours_s,
            "same_tokens": bool(torch.equal(ours, ref))}


def dtype_row(model, tok, dtype: torch.dtype, ids, chunks, args, passes=()) -> dict:
    """One dtype (and pipeline): optimize time, perplexity against HF's, decode, KV bytes."""
    model = cast(model, dtype)
    start = time.perf_counter()
    engine = rewriter.optimize(model, list(passes), tokenizer=tok)
    row = {"dtype": str(dtype).removeprefix("torch."), "passes": [repr(p) for p in passes],
           "optimize_s": time.perf_counter() - start}
    row.update(ppl=perplexity(engine, chunks), hf_ppl=hf_perplexity(model, chunks))
    row.update(decode(model, engine, ids, args.new, args.repeat))
    row.update(kv_bytes_per_token=engine.kv_bytes_per_token(),
               full_cache_bytes_per_token=full_cache_bytes(model.config, dtype),
               context=engine.max_len)
    if "int4" in engine.ir.info:
        row.update(int4_linears=engine.ir.info["int4"]["linears"],
                   int4_exact_linears=engine.ir.info["int4"].get("exact_linears"),
                   int4_max_abs_error=engine.ir.info["int4"]["max_abs_error"])
    return row


def show(rows: list[dict]) -> None:
    from tabulate import tabulate
    table = [[r["dtype"] + (" " + "+".join(r["passes"]) if r["passes"] else ""),
              f"{r['optimize_s']:.1f}", f"{r['ppl']:.4f}", f"{r['hf_ppl']:.4f}",
              f"{r['rewriter_tok_s']:.1f}", f"{r['hf_tok_s']:.1f}", f"{r['speedup']:.2f}x",
              r["same_tokens"], r["kv_bytes_per_token"], r["full_cache_bytes_per_token"]]
             for r in rows]
    print(tabulate(table, headers=["dtype", "optimize s", "ppl", "HF ppl", "tok/s", "HF tok/s",
                                   "speedup", "same tokens", "KV B/token", "full-cache B/token"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="'smollm2', 'gemma3-270m' or a .gguf path")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens for decode timing")
    ap.add_argument("--new", type=int, default=32, help="new tokens per timed generate")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs (median) after a warm-up")
    ap.add_argument("--ppl-chunks", type=int, default=4)
    ap.add_argument("--ppl-length", type=int, default=256)
    ap.add_argument("--int4", action="store_true",
                    help="also Int4Weights in bfloat16, and Int4Weights(exact=True) in float32")
    ap.add_argument("--json", default=None, help="default: benchmarks/results/families-MODEL.json")
    args = ap.parse_args()
    from rewriter.passes import Int4Weights
    model, tok, load_s = load(args.model)
    chunks = heldout_chunks(tok, args.ppl_chunks, args.ppl_length)  # [N, T]
    ids = heldout_chunks(tok, 1, args.prompt)  # [1, prompt]
    runs = [(getattr(torch, d), ()) for d in args.dtypes]
    # every linear in 4 bits (bfloat16, the CPU int4 kernel's dtype), and only those the
    # file holds in 4 bits exactly (float32: the model's outputs unchanged)
    runs += [(torch.bfloat16, (Int4Weights(),)),
             (torch.float32, (Int4Weights(exact=True),))] if args.int4 else []
    # float32 rows first: casting to bfloat16 rounds the model's weights in place
    runs.sort(key=lambda run: run[0] != torch.float32)
    rows = []
    for dtype, passes in runs:  # a row at a time: a model's run takes minutes
        rows.append(dtype_row(model, tok, dtype, ids, chunks, args, passes))
        print(rows[-1], flush=True)
    header = describe()
    print(f"model {args.model}, {header['machine']}, {header['threads']} threads, torch "
          f"{header['torch']}, {header['date']}; load {load_s:.1f} s\n")
    show(rows)
    name = str(args.model).replace("/", "_")
    write_json(args.json or f"benchmarks/results/families-{name}.json",
               {**header, "model": args.model, "load_s": load_s, "settings": vars(args),
                "rows": rows})


if __name__ == "__main__":
    main()
