"""How much quality a pass pipeline keeps, and what it costs, against the unoptimized model.

    from rewriter.api.eval import evaluate, EvalSettings, format_table
    rows = evaluate({"unoptimized": base, "LayerSkip(1.5)": skip}, tokenizer)
    print(format_table(rows))

Every pipeline sees the same inputs. Quality: perplexity on held-out code (the CPython
standard library files the default model never trained on, ``rewriter.models.corpus``) and on
English prose (the language reference's paragraphs that ship with CPython,
``corpus.prose_paragraphs``), computed through the KV-cache runtime: each chunk's first
half is prefilled and its second half scored one decode step per token, so a cache
policy's effect shows; its ratio to the reference. Greedy agreement with the reference's
continuation of the same prompts (chat questions through the chat template when the
tokenizer has one, held-out code otherwise): the fraction of positions equal, the mean
position of the first divergence, the fraction of prompts answered exactly alike.
Pass-key accuracy per context length. Cost: model forward passes and decoder-layer
evaluations per generated token (counted by the runtime), KV-cache bytes per token, and
wall time per token at batch 1 (the median of several runs after a warm-up, with the
spread).
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import torch

from rewriter.values import check_flag

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
    "Explain in one sentence what a compiler does.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
)


@dataclass
class EvalSettings:
    ppl_chunks: int = 16          # held-out chunks per corpus for perplexity
    ppl_length: int = 512         # tokens per chunk: the first half prefilled, the second scored
    corpora: tuple = ("code", "prose")
    prompts: int = 8              # greedy prompts (chat questions, or held-out code)
    prompt_length: int = 64       # tokens per code prompt
    new_tokens: int = 32          # greedy continuation per prompt
    passkey_lengths: tuple = (256, 512, 1024)
    passkey_depths: tuple = (0.1, 0.3, 0.5, 0.7, 0.9)
    passkey_trials: int = 2       # per length and depth (alternating sentence / code filler)
    timing_tokens: int = 64       # tokens generated at batch 1 for the wall-time column
    timing_runs: int = 3          # timed runs after one warm-up: median and spread
    seed: int = 0
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- inputs

@lru_cache(maxsize=4)
def _heldout_ids(tokenizer_json: str, corpus: str = "code") -> torch.Tensor:
    from tokenizers import Tokenizer
    from rewriter.models.corpus import load_corpus, prose_paragraphs
    tok = Tokenizer.from_str(tokenizer_json)
    if corpus == "code":
        texts = [text for _, text in load_corpus("heldout")]
    elif corpus == "prose":
        texts = ["\n\n".join(prose_paragraphs())]
    else:
        raise ValueError(f"unknown corpus {corpus!r}; available: code, prose")
    ids = []
    for text in texts:
        ids += tok.encode(text).ids[1:] if _adds_bos(tok) else tok.encode(text).ids
    return torch.tensor(ids)


def _adds_bos(tok) -> bool:
    return len(tok.encode("").ids) > 0


def _backend(tokenizer):
    """A ``tokenizers.Tokenizer`` from it or from a fast Hugging Face tokenizer."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def heldout_chunks(tokenizer, n: int, length: int, corpus: str = "code") -> torch.Tensor:
    """``[n, length]``: evenly spaced chunks of a held-out corpus (``code`` or ``prose``),
    each starting with BOS when the tokenizer adds one."""
    tok = _backend(tokenizer)
    stream = _heldout_ids(tok.to_str(), corpus)
    bos = tok.encode("").ids[:1] or []
    body = length - len(bos)
    starts = torch.linspace(0, len(stream) - body - 1, n).long().tolist()
    return torch.stack([torch.cat([torch.tensor(bos, dtype=torch.long), stream[s:s + body]])
                        for s in starts])


# ---------------------------------------------------------------------------- quality

def perplexity(engine, chunks: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) of the second half of each chunk ``[N, T]`` given all before
    it, through the KV-cache runtime (``Engine.score``: prefill the first half, then one
    decode step per scored token)."""
    total, count = 0.0, 0
    prefix = chunks.shape[1] // 2
    for i in range(0, len(chunks), batch):
        logp = engine.score(chunks[i:i + batch], prefix)  # [b, T - prefix]
        total, count = total - logp.sum().item(), count + logp.numel()
    return math.exp(total / count)


def chat_prompts(tokenizer, text, n: int) -> list[list[int]]:
    """The first ``n`` of ``CHAT_PROMPTS`` laid out by the chat template, as token ids."""
    from rewriter.runtime.chat import chat_prompt
    return [chat_prompt(_backend(tokenizer), text, q) for q in CHAT_PROMPTS[:n]]


def greedy_continuations(engine, prompts, new_tokens: int) -> torch.Tensor:
    """``[N, new_tokens]`` greedy continuations (no EOS stop) of a ``[N, S]`` tensor or a
    list of id lists (left-padded together)."""
    width = prompts.shape[1] if isinstance(prompts, torch.Tensor) else max(map(len, prompts))
    return engine.generate(prompts, max_new_tokens=new_tokens, eos_token_id=[])[:, width:]


def agreement(tokens: torch.Tensor, reference: torch.Tensor) -> dict:
    """Fraction of positions equal to the reference, mean first divergence position (= the
    length when a row never diverges) and the fraction of rows equal throughout."""
    same = tokens == reference  # [N, T]
    diverged = ~same
    first = torch.where(diverged.any(1), diverged.float().argmax(1),
                        torch.full((len(same),), same.shape[1])).float()
    return {"agreement": same.float().mean().item(), "first_divergence": first.mean().item(),
            "exact_match": same.all(1).float().mean().item()}


def passkey_accuracy(engine, tokenizer, lengths, depths, trials: int, seed: int = 0) -> dict:
    """Exact-digit greedy accuracy per context length (every depth and trial batched)."""
    from rewriter.models.corpus import passkey_sample
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
    from rewriter.models.corpus import code_lines, load_corpus
    return tuple(code_lines(load_corpus("heldout")))


# ---------------------------------------------------------------------------- cost

def cost(engine, prompt, new_tokens: int, runs: int = 3) -> dict:
    """Forward passes and layer evaluations per generated token (from the runtime's
    counters), KV-cache bytes per token and bytes a decode step reads at the context
    length, and wall milliseconds per token at batch 1: the
    median of ``runs`` timed generations after a warm-up, and their min and max."""
    prompt = prompt[:1] if isinstance(prompt, torch.Tensor) else [list(prompt[0])]
    times = []
    # the pipeline's own decoding, never the speed guard's plain fallback (runtime.speed_guard)
    kept, engine.fallback = engine.fallback, False
    try:
        engine.generate(prompt, max_new_tokens=4, eos_token_id=[])  # warm-up
        engine.stats.clear()
        for _ in range(runs):
            start = time.perf_counter()
            engine.generate(prompt, max_new_tokens=new_tokens, eos_token_id=[])
            times.append(1e3 * (time.perf_counter() - start) / new_tokens)
    finally:
        engine.fallback = kept
    s = engine.stats
    return {"forward_per_token": s["forward_passes"] / s["tokens"],
            "layers_per_token": (s["layer_evals"] + s["draft_layer_evals"]) / s["tokens"],
            # speculative decoding (self-speculative, draft heads): drafts accepted per
            # verification of one row
            "accepted_per_round": s["accepted"] / s["row_rounds"] if s["row_rounds"] else None,
            "kv_bytes_per_token": engine.kv_bytes_per_token(),
            # at the context length; a speculative strategy's verify steps attend densely
            "kv_read_per_step": (None if engine.ir.info.get("decoding") is not None
                                 else engine.kv_read_bytes()),
            "ms_per_token": statistics.median(times), "ms_per_token_min": min(times),
            "ms_per_token_max": max(times)}


# ---------------------------------------------------------------------------- all together

def evaluate(pipelines: dict, tokenizer, settings: EvalSettings = EvalSettings(),
             reference: str | None = None, progress: bool = False) -> list[dict]:
    """One row per pipeline (name -> engine); ``reference`` (default: the first) is the
    unoptimized model every ratio and agreement is measured against. ``progress`` shows a
    bar (a step per pipeline and measurement) and the seconds each pipeline took."""
    check_flag("progress", progress)
    reference = reference or next(iter(pipelines))
    ref = pipelines[reference]
    bar = _Progress(progress, 1 + len(pipelines) * 4)
    bar.stage(reference, "reference")
    chunks = {c: heldout_chunks(tokenizer, settings.ppl_chunks, settings.ppl_length, c)
              for c in settings.corpora}
    prompts = greedy_prompts(ref, tokenizer, settings)
    ref_tokens = greedy_continuations(ref, prompts, settings.new_tokens)
    ref_ppl = {c: perplexity(ref, ids) for c, ids in chunks.items()}
    rows = []
    try:
        for name, engine in pipelines.items():
            start = time.perf_counter()
            bar.stage(name, "perplexity")
            ppl = ref_ppl if name == reference else {c: perplexity(engine, ids) for c, ids in chunks.items()}
            bar.stage(name, "greedy agreement")
            tokens = greedy_continuations(engine, prompts, settings.new_tokens)
            bar.stage(name, "pass-key")
            passkey = passkey_accuracy(engine, tokenizer, settings.passkey_lengths,
                                       settings.passkey_depths, settings.passkey_trials,
                                       settings.seed)
            bar.stage(name, "cost")
            rows.append({"pipeline": name, "layers": len(engine.ir.layers),
                         "params": engine.ir.num_params(), "perplexity": ppl,
                         "ppl_ratio": {c: ppl[c] / ref_ppl[c] for c in ppl},
                         **agreement(tokens, ref_tokens), "passkey": passkey,
                         **cost(engine, prompts, settings.timing_tokens, settings.timing_runs)})
            bar.done(f"{name}: evaluated in {time.perf_counter() - start:.1f} s")
    finally:
        bar.close()
    return rows


class _Progress:
    """``evaluate``'s bar: the pipeline and measurement under way, one step each (the
    measurement before it done), and a line per pipeline with its time; silent unless
    asked for."""

    def __init__(self, enabled: bool, total: int):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="step", disable=not enabled, leave=False)
        self.started = False

    def stage(self, name: str, what: str) -> None:
        if self.started:
            self.bar.update()
        self.started = True
        self.bar.set_description(f"evaluate {name}: {what}")

    def done(self, line: str) -> None:
        if not self.bar.disable:
            self.bar.write(line)

    def close(self) -> None:
        self.bar.update()
        self.bar.close()


def greedy_prompts(engine, tokenizer, settings: EvalSettings):
    """Chat questions through the chat template when the engine has one (an instruct
    model answers them), else held-out code chunks."""
    if engine.text.chat_template is not None:
        return chat_prompts(tokenizer, engine.text, settings.prompts)
    return heldout_chunks(tokenizer, settings.prompts + 1, settings.prompt_length)[1:]


LEGEND = """\
ppl <corpus>     perplexity of held-out text, through the KV-cache runtime (lower is better)
ratio            that perplexity / the unoptimized model's (1.000 = no loss; higher is worse)
greedy agree     fraction of greedy tokens equal to the unoptimized model's (higher is better)
1st diverge      mean position of the first differing greedy token (higher is better)
exact            fraction of prompts answered exactly as the unoptimized model does
passkey@N        pass-key retrieval accuracy with an N-token context (higher is better)
fwd/tok          full-model forward passes per generated token (lower is cheaper)
layers/tok       decoder layers evaluated per generated token, drafts included (lower is cheaper)
acc/round        speculative decoding (self-speculative, draft heads): drafted tokens accepted
                 per verification (higher is better)
KV B/tok         KV-cache bytes per token of one sequence (lower is cheaper)
KV read KiB      KV-cache KiB one decode step of one sequence reads at the full context
                 (lower is cheaper; token selection lowers it, not the memory; "-" for
                 speculative rounds, whose verify steps read the whole cache)
ms/tok           CPU milliseconds per generated token, batch 1: median [min-max] of the runs"""


def format_table(rows: list[dict], legend: bool = True) -> str:
    from tabulate import tabulate
    lengths = sorted({k for r in rows for k in r["passkey"]})
    corpora = list(rows[0]["perplexity"]) if rows else []
    head = ["pipeline", "layers"]
    for c in corpora:
        head += [f"ppl {c}", "ratio"]
    head += ["greedy agree", "1st diverge", "exact", *[f"passkey@{n}" for n in lengths],
             "fwd/tok", "layers/tok", "acc/round", "KV B/tok", "KV read KiB", "ms/tok"]
    body = []
    for r in rows:
        ppl = [x for c in corpora for x in (f"{r['perplexity'][c]:.2f}", f"{r['ppl_ratio'][c]:.3f}")]
        body.append([r["pipeline"], r["layers"], *ppl, f"{r['agreement']:.3f}",
                     f"{r['first_divergence']:.1f}", f"{r['exact_match']:.2f}",
                     *[f"{r['passkey'].get(n, float('nan')):.2f}" for n in lengths],
                     f"{r['forward_per_token']:.2f}", f"{r['layers_per_token']:.1f}",
                     "-" if r.get("accepted_per_round") is None else f"{r['accepted_per_round']:.2f}",
                     r["kv_bytes_per_token"],
                     "-" if r.get("kv_read_per_step") is None else f"{r['kv_read_per_step'] / 2**10:.0f}",
                     f"{r['ms_per_token']:.1f} [{r['ms_per_token_min']:.1f}-{r['ms_per_token_max']:.1f}]"])
    table = tabulate(body, headers=head)
    return table + ("\n\n" + LEGEND if legend else "")


def format_settings(settings: EvalSettings) -> str:
    """What the table's figures were measured on, in words, for the lines under its legend."""
    ppl = (f"{settings.ppl_chunks} chunks of {settings.ppl_length} tokens per corpus "
           f"({', '.join(settings.corpora)}), the second half of each scored")
    lengths = ", ".join(map(str, settings.passkey_lengths))
    return (f"measured on: perplexity, {ppl}; greedy agreement, {settings.prompts} prompts "
            f"x {settings.new_tokens} new tokens; pass-key, {len(settings.passkey_depths)} "
            f"depths x {settings.passkey_trials} trials at {lengths} tokens; ms/tok, "
            f"{settings.timing_runs} runs of {settings.timing_tokens} tokens after a warm-up")


def settings_dict(settings: EvalSettings) -> dict:
    return asdict(settings)
