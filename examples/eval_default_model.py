"""Quick standalone quality check of the default model, with plain transformers.

Reports (and with ``--json`` writes):
  * held-out perplexity of the model vs a unigram model (fit on the training
    split, add-one smoothing) on exactly the same held-out target tokens;
  * distinct-2 / distinct-3 of greedy continuations of a few code prompts;
  * pass-key accuracy (greedy, exact digits) per context length and depth.

    python examples/eval_default_model.py --json /tmp/eval.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["import os\n", "def ", "class ", "    def __init__(self", "for i in range(",
           "# ", "if __name__ == ", "    return "]


def load_corpus_module():
    """``rewriter.models.corpus``; loaded by file path if the package cannot be imported."""
    sys.path.insert(0, str(ROOT))
    try:
        from rewriter.models import corpus
        return corpus
    except Exception:
        spec = importlib.util.spec_from_file_location("rewriter_corpus", ROOT / "rewriter/models/corpus.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "rewriter/assets/default_model"))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=1024, help="held-out chunk length")
    p.add_argument("--max-chunks", type=int, default=0, help="0 = all held-out chunks")
    p.add_argument("--lengths", default="256,512,1024")
    p.add_argument("--depths", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9")
    p.add_argument("--trials", type=int, default=4, help="pass-key samples per length, depth, filler")
    p.add_argument("--fillers", default="sentences,code")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy sample length")
    return p.parse_args(argv)


def doc_ids(tok, docs):
    """Token ids of all documents, each followed by EOS (no BOS)."""
    out, limit = [], tok.model_max_length
    tok.model_max_length = 1 << 40  # whole documents; chunked later
    ids = tok([t for _, t in docs], add_special_tokens=False)["input_ids"]
    tok.model_max_length = limit
    for enc in ids:
        out.extend(enc)
        out.append(tok.eos_token_id)
    return out


def model_nll(model, tok, stream, T, max_chunks):
    """(total NLL, target ids) over BOS-prefixed chunks of T tokens of ``stream``."""
    import torch
    n = T - 1
    starts = list(range(0, len(stream) - 1, n))
    if max_chunks:
        starts = starts[:max_chunks]
    total, targets = 0.0, []
    for s in starts:
        chunk = stream[s:s + n]
        ids = torch.tensor([[tok.bos_token_id] + chunk])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        targets.extend(chunk)
    return total, targets


def unigram_nll(train_ids, targets, vocab):
    """Total NLL of ``targets`` under add-one unigram probabilities from ``train_ids``."""
    counts = Counter(train_ids)
    denom = len(train_ids) + vocab
    return -sum(math.log((counts[t] + 1) / denom) for t in targets)


def distinct_n(tokens, n):
    """Unique n-grams / n-grams in one token list (0 if too short)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def greedy(model, tok, prompt, new_tokens):
    """Greedy continuation ids (without the prompt)."""
    import torch
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def eval_samples(model, tok, new_tokens):
    """Greedy samples from PROMPTS with per-sample and mean distinct-2/3."""
    rows = []
    for prompt in PROMPTS:
        gen = greedy(model, tok, prompt, new_tokens)
        rows.append({"prompt": prompt, "text": tok.decode(gen, skip_special_tokens=False),
                     "tokens": len(gen), "distinct_2": distinct_n(gen, 2),
                     "distinct_3": distinct_n(gen, 3)})
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {"distinct_2": mean("distinct_2"), "distinct_3": mean("distinct_3"), "samples": rows}


def eval_passkey(model, tok, corpus, lines, lengths, depths, fillers, trials, seed):
    """Accuracy per (length, depth) over ``trials`` samples of each filler kind."""
    cells = []
    for L in lengths:
        for d in depths:
            rng = random.Random(f"passkey-eval-{seed}-{L}-{d}")
            res = {f: 0 for f in fillers}
            n_tok = []
            for f in fillers:
                for _ in range(trials):
                    s = corpus.passkey_sample(tok, L, d, rng, filler=f, lines=lines)
                    n_tok.append(s.n_tokens)
                    room = model.config.max_position_embeddings - s.n_tokens  # stay in context
                    gen = greedy(model, tok, s.prompt, min(len(s.key) + 2, room))
                    res[f] += s.check(tok.decode(gen, skip_special_tokens=True))
            acc = sum(res.values()) / (trials * len(fillers))
            cells.append({"length": L, "depth": d, "accuracy": acc, "max_prompt_tokens": max(n_tok),
                          **{f"acc_{f}": res[f] / trials for f in fillers}})
    return cells


def print_report(r):
    """Human-readable table of the results."""
    p = r["perplexity"]
    print(f"held-out tokens: {p['tokens']}  model ppl {p['model_ppl']:.2f}  "
          f"unigram ppl {p['unigram_ppl']:.2f}  (ratio {p['unigram_ppl'] / p['model_ppl']:.1f}x)")
    s = r["samples"]
    print(f"greedy samples: distinct-2 {s['distinct_2']:.3f}  distinct-3 {s['distinct_3']:.3f}")
    for row in s["samples"][:3]:
        print(f"  {row['prompt']!r} -> {row['text'][:120]!r}")
    lengths = sorted({c["length"] for c in r["passkey"]})
    depths = sorted({c["depth"] for c in r["passkey"]})
    print("pass-key accuracy (rows: context length, cols: depth)")
    print("length " + " ".join(f"{d:>5}" for d in depths) + "   mean")
    for L in lengths:
        accs = [c["accuracy"] for c in r["passkey"] if c["length"] == L]
        print(f"{L:>6} " + " ".join(f"{a:5.2f}" for a in accs) + f"  {sum(accs) / len(accs):5.2f}")


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(args.threads)
    t0 = time.time()
    corpus = load_corpus_module()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    train_docs, held_docs = corpus.load_corpus("train"), corpus.load_corpus("heldout")

    held = doc_ids(tok, held_docs)
    nll, targets = model_nll(model, tok, held, args.context, args.max_chunks)
    uni = unigram_nll(doc_ids(tok, train_docs), targets, len(tok))
    ppl = {"tokens": len(targets), "context": args.context, "model_nll": nll / len(targets),
           "model_ppl": math.exp(nll / len(targets)), "unigram_nll": uni / len(targets),
           "unigram_ppl": math.exp(uni / len(targets)),
           "unigram": "fit on the training split, add-one smoothing"}
    samples = eval_samples(model, tok, args.new_tokens)
    passkey = eval_passkey(model, tok, corpus, corpus.code_lines(held_docs),
                           [int(x) for x in args.lengths.split(",")],
                           [float(x) for x in args.depths.split(",")],
                           args.fillers.split(","), args.trials, args.seed)
    by_len = {}
    for c in passkey:
        by_len.setdefault(str(c["length"]), []).append(c["accuracy"])
    result = {"model": args.model, "parameters": sum(t.numel() for t in model.parameters()),
              "perplexity": ppl, "samples": samples, "passkey": passkey,
              "passkey_mean_by_length": {k: sum(v) / len(v) for k, v in by_len.items()},
              "passkey_trials_per_cell": args.trials * len(args.fillers.split(",")),
              "seed": args.seed, "wall_s": round(time.time() - t0, 1)}
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
