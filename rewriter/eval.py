"""How much quality a pass pipeline keeps, and what it costs, against the unoptimized model.

    from rewriter.eval import evaluate, EvalSettings, format_table
    rows = evaluate({"unoptimized": base, "LayerSkip(1.5)": skip}, tokenizer)
    print(format_table(rows))

Every pipeline sees the same inputs: held-out chunks of the corpus (``rewriter.corpus``,
the split the default model never trained on), the same greedy prompts, the same pass-key
prompts. Quality: perplexity (and its ratio to the reference), greedy agreement with the
reference's continuation and the mean position of the first divergence, pass-key accuracy
per context length. Cost: model forward passes and decoder-layer evaluations per generated
token (counted by the runtime), KV-cache bytes per token, and wall time per token.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch


@dataclass
class EvalSettings:
    ppl_chunks: int = 16          # held-out chunks for perplexity
    ppl_length: int = 512         # tokens per chunk
    prompts: int = 8              # greedy prompts (held-out code)
    prompt_length: int = 64
    new_tokens: int = 32          # greedy continuation per prompt
    passkey_lengths: tuple = (256, 512, 1024)
    passkey_depths: tuple = (0.1, 0.3, 0.5, 0.7, 0.9)
    passkey_trials: int = 2       # per length and depth (alternating sentence / code filler)
    timing_tokens: int = 64       # tokens generated at batch 1 for the wall-time column
    seed: int = 0
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- inputs

@lru_cache(maxsize=4)
def _heldout_ids(tokenizer_json: str) -> torch.Tensor:
    from tokenizers import Tokenizer
    from .corpus import load_corpus
    tok = Tokenizer.from_str(tokenizer_json)
    ids = []
    for _, text in load_corpus("heldout"):
        ids += tok.encode(text).ids[1:] if _adds_bos(tok) else tok.encode(text).ids
    return torch.tensor(ids)


def _adds_bos(tok) -> bool:
    return len(tok.encode("").ids) > 0


def _backend(tokenizer):
    """A ``tokenizers.Tokenizer`` from it or from a fast Hugging Face tokenizer."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def heldout_chunks(tokenizer, n: int, length: int) -> torch.Tensor:
    """``[n, length]``: evenly spaced held-out chunks, each starting with BOS."""
    tok = _backend(tokenizer)
    stream = _heldout_ids(tok.to_str())
    bos = tok.encode("").ids[:1] or []
    body = length - len(bos)
    starts = torch.linspace(0, len(stream) - body - 1, n).long().tolist()
    return torch.stack([torch.cat([torch.tensor(bos, dtype=torch.long), stream[s:s + body]])
                        for s in starts])


# ---------------------------------------------------------------------------- quality

def perplexity(engine, chunks: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) over ``chunks`` ``[N, T]`` (all positions but the first)."""
    total, count = 0.0, 0
    for i in range(0, len(chunks), batch):
        ids = chunks[i:i + batch]
        logits = engine(ids).float()  # [b, T, V]
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                reduction="sum")
        total, count = total + nll.item(), count + ids[:, 1:].numel()
    return math.exp(total / count)


def greedy_continuations(engine, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``[N, new_tokens]`` greedy continuations (no EOS stop)."""
    return engine.generate(prompts, max_new_tokens=new_tokens, eos_token_id=[])[:, prompts.shape[1]:]


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> dict:
    """Fraction of positions equal to the reference, and mean first divergence position
    (= the length when a row never diverges)."""
    same = tokens == reference  # [N, T]
    diverged = ~same
    first = torch.where(diverged.any(1), diverged.float().argmax(1),
                        torch.full((len(same),), same.shape[1])).float()
    return {"agreement": same.float().mean().item(), "first_divergence": first.mean().item()}


def passkey_accuracy(engine, tokenizer, lengths, depths, trials: int, seed: int = 0) -> dict:
    """Exact-digit greedy accuracy per context length (every depth and trial batched)."""
    from .corpus import passkey_sample
    tok = _backend(tokenizer)
    lines = _code_lines()
    out = {}
    for length in lengths:
        if length > engine.max_len:
            continue
        rng = random.Random(f"passkey-eval-{seed}-{length}")
        samples = [passkey_sample(tok, length, d, rng, filler="sentences" if t % 2 == 0 else "code",
                                  lines=lines) for d in depths for t in range(trials)]
        prompts = [tok.encode(s.prompt).ids for s in samples]
        room = engine.max_len - max(map(len, prompts))
        new = min(max(len(s.key) for s in samples) + 2, room)
        gen = engine.generate(prompts, max_new_tokens=new, eos_token_id=[])
        width = max(map(len, prompts))
        hits = [s.check(tok.decode(gen[i, width:].tolist())) for i, s in enumerate(samples)]
        out[length] = sum(hits) / len(hits)
    return out


@lru_cache(maxsize=1)
def _code_lines():
    from .corpus import code_lines, load_corpus
    return tuple(code_lines(load_corpus("heldout")))


# ---------------------------------------------------------------------------- cost

def cost(engine, prompt: torch.Tensor, new_tokens: int) -> dict:
    """Forward passes and layer evaluations per generated token (from the runtime's
    counters), KV-cache bytes per token, and wall milliseconds per token at batch 1."""
    engine.generate(prompt[:1], max_new_tokens=4, eos_token_id=[])  # warm-up
    engine.stats.clear()
    start = time.perf_counter()
    engine.generate(prompt[:1], max_new_tokens=new_tokens, eos_token_id=[])
    seconds = time.perf_counter() - start
    s = engine.stats
    return {"forward_per_token": s["forward_passes"] / s["tokens"],
            "layers_per_token": s["layer_evals"] / s["tokens"],
            "kv_bytes_per_token": engine.kv_bytes_per_token(),
            "ms_per_token": 1e3 * seconds / s["tokens"]}


# ---------------------------------------------------------------------------- all together

def evaluate(pipelines: dict, tokenizer, settings: EvalSettings = EvalSettings(),
             reference: str | None = None) -> list[dict]:
    """One row per pipeline (name -> engine); ``reference`` (default: the first) is the
    unoptimized model every ratio and agreement is measured against."""
    reference = reference or next(iter(pipelines))
    chunks = heldout_chunks(tokenizer, settings.ppl_chunks, settings.ppl_length)
    prompts = heldout_chunks(tokenizer, settings.prompts + 1, settings.prompt_length)[1:]
    ref_tokens = greedy_continuations(pipelines[reference], prompts, settings.new_tokens)
    ref_ppl = perplexity(pipelines[reference], chunks)
    rows = []
    for name, engine in pipelines.items():
        ppl = ref_ppl if name == reference else perplexity(engine, chunks)
        tokens = greedy_continuations(engine, prompts, settings.new_tokens)
        row = {"pipeline": name, "layers": len(engine.ir.layers),
               "params": engine.ir.num_params(), "perplexity": ppl, "ppl_ratio": ppl / ref_ppl,
               **agreement(tokens, ref_tokens),
               "passkey": passkey_accuracy(engine, tokenizer, settings.passkey_lengths,
                                           settings.passkey_depths, settings.passkey_trials,
                                           settings.seed),
               **cost(engine, prompts, settings.timing_tokens)}
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    from tabulate import tabulate
    lengths = sorted({k for r in rows for k in r["passkey"]})
    head = ["pipeline", "layers", "ppl", "ppl ratio", "greedy agree", "1st diverge"]
    head += [f"passkey@{n}" for n in lengths]
    head += ["fwd/tok", "layers/tok", "KV B/tok", "ms/tok (CPU)"]
    body = [[r["pipeline"], r["layers"], f"{r['perplexity']:.1f}", f"{r['ppl_ratio']:.3f}",
             f"{r['agreement']:.3f}", f"{r['first_divergence']:.1f}",
             *[f"{r['passkey'].get(n, float('nan')):.2f}" for n in lengths],
             f"{r['forward_per_token']:.2f}", f"{r['layers_per_token']:.1f}",
             r["kv_bytes_per_token"], f"{r['ms_per_token']:.2f}"] for r in rows]
    return tabulate(body, headers=head)


def settings_dict(settings: EvalSettings) -> dict:
    return asdict(settings)
