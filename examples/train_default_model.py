"""Train the project's small default model (a Llama-architecture causal LM).

Corpus: the CPython standard library source (``rewriter.models.corpus``), plus synthetic
pass-key retrieval samples so the model can find a key hidden in 1024 tokens.

    nice -n 10 python examples/train_default_model.py            # CPU, 1 thread
    python examples/train_default_model.py --preset gpu --device cuda

The shipped default model is two CPU runs (71 + 43 minutes on one thread):

    python examples/train_default_model.py --out stage1                     # LM, 1500 steps
    python examples/train_default_model.py --preset retrieval --init stage1 \
        --ckpt .train_ckpt_retrieval                                        # 900 steps

Stage 1 learns the language but not copying (pass-key accuracy 0). Stage 2 continues it
with retrieval-heavy batches that start at 128 tokens and grow to 1024: the copy circuit
forms within ~300 steps at short context (answer loss 1.6 -> 0.02) and then stretches to
the full context (pass-key accuracy 0.99 at 1024 tokens).

Steps: (1) train a byte-level BPE tokenizer on the training split (digits split
into single-digit tokens), (2) train ``LlamaForCausalLM`` with AdamW, linear
warm-up + cosine decay, a short-to-long context curriculum and a mix of code
chunks, pass-key samples and repeated code segments (the repeats reward the
copy circuit that retrieval needs), (3) save config + safetensors + tokenizer +
``training.json`` to ``--out``. Every batch is a pure function of (seed, step),
and a checkpoint is written every few minutes to ``--ckpt``; rerunning the same
command resumes from it.
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
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"


def load_corpus_module():
    """``rewriter.models.corpus``; loaded by file path if the package cannot be imported."""
    sys.path.insert(0, str(ROOT))
    try:
        from rewriter.models import corpus
        return corpus
    except Exception:  # package __init__ mid-edit or missing: load the one file
        spec = importlib.util.spec_from_file_location("rewriter_corpus", ROOT / "rewriter/models/corpus.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


# --------------------------------------------------------------------------- config

@dataclass
class Preset:
    """Model and schedule sizes; see ``PRESETS``."""
    hidden: int = 256
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 640
    vocab: int = 4096
    max_pos: int = 1024
    steps: int = 1500
    batch_tokens: int = 8192        # tokens per optimizer step, at every context length
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    passkey_frac: float = 0.3       # fraction of rows that start with a pass-key sample
    copy_frac: float = 0.15         # fraction of rows with a repeated code segment
    answer_weight: float = 1.0      # weight of the pass-key answer loss term
    copy_weight: float = 0.25       # weight of the repeated-segment loss term
    curriculum: tuple = ((0.0, 256), (0.3, 512), (0.6, 1024))  # (from fraction, context)


PRESETS = {
    "cpu": Preset(),
    "tiny": Preset(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=1024, steps=30,
                   batch_tokens=1024, warmup=5, curriculum=((0.0, 192), (0.5, 256))),
    # Continue the shipped CPU model (--init) with retrieval-heavy batches that
    # start short: copying is learned first where the key is near, then stretched.
    "retrieval": Preset(steps=900, lr=1e-3, warmup=30, passkey_frac=0.6, copy_frac=0.25,
                        answer_weight=2.0, copy_weight=1.0,
                        curriculum=((0.0, 128), (0.25, 256), (0.5, 512), (0.75, 1024))),
    "gpu": Preset(hidden=512, layers=12, heads=8, kv_heads=2, ffn=1408, vocab=8192, max_pos=2048,
                  steps=6000, batch_tokens=65536, lr=1e-3, warmup=300,
                  curriculum=((0.0, 512), (0.2, 1024), (0.5, 2048))),
}


def parse_args(argv=None):
    """Command-line options; unset model/schedule options come from ``--preset``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "rewriter/assets/default_model"))
    p.add_argument("--ckpt", default=str(ROOT / ".train_ckpt"))
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (preset default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=100.0,
                   help="wall-clock budget (summed over resumes); stops early and saves")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="autocast dtype")
    p.add_argument("--ckpt-minutes", type=float, default=3.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--init", default=None,
                   help="start from this saved model dir (its weights and tokenizer) instead "
                        "of random weights, e.g. to train the default model further")
    p.add_argument("--save-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="weights on disk: auto = fp32 if under 26 MB else bf16")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, vocab: int):
    """Byte-level BPE; digits are always single tokens; encodings start with EOT (BOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, tok.token_to_id(EOT))])
    return tok


def hf_tokenizer(tok, max_len: int):
    """Wrap a ``tokenizers.Tokenizer`` as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT,
                                   pad_token=EOT, model_max_length=max_len)


def token_stream(tok, docs):
    """All documents' ids, each followed by EOT, as one int32 tensor."""
    import torch
    eot = tok.token_to_id(EOT)
    ids = []
    for enc in tok.encode_batch([t for _, t in docs], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------- data

class Batcher:
    """Makes batch ``step`` deterministically from (seed, step)."""

    def __init__(self, corpus, tok, stream, lines, preset: Preset, seed: int, steps: int):
        self.corpus, self.tok, self.stream, self.lines = corpus, tok, stream, lines
        self.p, self.seed, self.steps = preset, seed, steps
        self.eot = tok.token_to_id(EOT)

    def context(self, step: int) -> int:
        """Sequence length of the curriculum at this step."""
        frac, T = step / max(1, self.steps), self.p.curriculum[0][1]
        for start, length in self.p.curriculum:
            if frac >= start:
                T = length
        return T

    def passkey_row(self, rng: random.Random, T: int):
        """(ids, lm weights, answer weights, copy weights) of one pass-key sample, <= T tokens."""
        lo = min(T, 128)
        n_digits = rng.choice((4, 5, 5, 5, 6, 7))
        filler = rng.choice(("sentences", "code"))
        s = self.corpus.passkey_sample(self.tok, rng.randint(lo, T), rng.random(), rng,
                                       n_digits=n_digits, filler=filler, lines=self.lines)
        enc = self.tok.encode(s.prompt + s.target)  # BOS + prompt + " " + digits
        n = len(enc.ids)
        lm = [1.0] * n
        start = s.key_char_offset + len("The pass key is ")
        for i, (a, b) in enumerate(enc.offsets):  # the first key copy is unpredictable
            if i > 0 and start <= a < start + len(s.key):
                lm[i] = 0.0
        n_ans = n - s.n_tokens
        ans = [0.0] * (n - n_ans) + [1.0] * n_ans
        lm[-n_ans:] = [0.0] * n_ans
        return enc.ids, lm, ans, [0.0] * n

    def copy_row(self, rng: random.Random, T: int):
        """A code segment, other code, then the same segment again, <= T-1 tokens
        (weights as ``passkey_row``; the repeat is weighted as "copy").

        The repeat is predictable by copying, the induction circuit that
        pass-key retrieval relies on; the rest is ordinary language-model data."""
        a = rng.randint(32, 128)
        gap = rng.randint(0, max(0, T - 2 * a - 2))
        seg, mid = self.code_ids(rng, a), self.code_ids(rng, gap) if gap else []
        ids = [self.eot] + seg + mid + seg
        head = 1 + a + gap
        lm = [1.0] * (head + 1) + [0.0] * (a - 1)
        cp = [0.0] * (head + 1) + [1.0] * (a - 1)
        return ids[:T - 1], lm[:T - 1], [0.0] * len(ids[:T - 1]), cp[:T - 1]

    def code_ids(self, rng: random.Random, n: int):
        """``n`` consecutive ids from a random offset of the training stream."""
        off = rng.randrange(0, len(self.stream) - n)
        return self.stream[off:off + n].tolist()

    def batch(self, step: int):
        """(input_ids [B,T], weights [3,B,T]): lm / answer / copy weights of the
        *prediction of* token t (so position 0, BOS, is never a target)."""
        import torch
        T = self.context(step)
        B = max(1, self.p.batch_tokens // T)
        rng = random.Random(f"batch-{self.seed}-{step}")
        ids, ws = [], []
        for _ in range(B):
            u = rng.random()
            if u < self.p.passkey_frac:
                i, *w = self.passkey_row(rng, T)
            elif u < self.p.passkey_frac + self.p.copy_frac:
                i, *w = self.copy_row(rng, T)
            else:
                i, w = [], [[], [], []]
            i, w = i + [self.eot], [w[0] + [float(bool(i))], w[1] + [0.0], w[2] + [0.0]]
            rest = T - len(i)
            if rest > 0:
                i = i + self.code_ids(rng, rest)
                w = [w[0] + [1.0] * rest, w[1] + [0.0] * rest, w[2] + [0.0] * rest]
            ids.append(i[:T])
            ws.append([x[:T] for x in w])
        return torch.tensor(ids, dtype=torch.long), torch.tensor(ws).transpose(0, 1).contiguous()


# --------------------------------------------------------------------------- model

def build_model(p: Preset, tok):
    """A freshly initialised ``LlamaForCausalLM`` (tied embeddings, GQA, SDPA)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    eot = tok.token_to_id(EOT)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=p.hidden,
                      intermediate_size=p.ffn, num_hidden_layers=p.layers,
                      num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                      max_position_embeddings=p.max_pos, tie_word_embeddings=True,
                      bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def make_optimizer(model, p: Preset):
    """AdamW; no weight decay on norms (1-d parameters)."""
    import torch
    decay = [t for t in model.parameters() if t.dim() >= 2]
    other = [t for t in model.parameters() if t.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": p.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=p.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, p: Preset, steps: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_frac * lr``."""
    if step < p.warmup:
        return p.lr * (step + 1) / p.warmup
    t = (step - p.warmup) / max(1, steps - p.warmup)
    return p.lr * (p.min_lr_frac + (1 - p.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def losses(model, ids, w, autocast):
    """Weighted mean token NLL for each weight row of ``w`` [K,B,T] (0 where a row is empty)."""
    import torch
    with autocast():
        logits = model(input_ids=ids).logits
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
        reduction="none").view(ids.shape[0], -1)
    w = w[:, :, 1:]
    return (nll * w).sum((1, 2)) / w.sum((1, 2)).clamp_min(1)


# --------------------------------------------------------------------------- eval

def heldout_loss(model, stream, T, n_chunks, autocast, eot):
    """Mean NLL over ``n_chunks`` evenly spaced held-out chunks of length T."""
    import torch
    dev = next(model.parameters()).device
    starts = torch.linspace(0, len(stream) - T, n_chunks).long().tolist()
    total = 0.0
    for b in range(0, n_chunks, 8):
        ids = torch.stack([torch.cat([torch.tensor([eot]), stream[s:s + T - 1].long()])
                           for s in starts[b:b + 8]]).to(dev)
        with torch.no_grad():
            lm = losses(model, ids, torch.ones(1, *ids.shape, device=dev), autocast)[0]
        total += lm.item() * ids.shape[0]
    return total / n_chunks


def passkey_accuracy(model, corpus, tok, lines, length, n, seed, autocast, device):
    """Fraction of ``n`` pass-key samples answered exactly by greedy decoding."""
    import torch
    rng, ok = random.Random(f"pk-eval-{seed}-{length}"), 0
    for i in range(n):
        s = corpus.passkey_sample(tok, length, (i + 0.5) / n, rng,
                                  filler="sentences" if i % 2 == 0 else "code", lines=lines)
        ids = torch.tensor([tok.encode(s.prompt).ids], device=device)
        with torch.no_grad(), autocast():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(s.key) + 1, do_sample=False,
                                 pad_token_id=tok.token_to_id(EOT))
        ok += s.check(tok.decode(out[0, ids.shape[1]:].tolist()))
    return ok / n


# --------------------------------------------------------------------------- main

def _nanmean(xs):
    """Mean of the non-NaN values (NaN if none)."""
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")


def atomic_save(obj, path: Path):
    """``torch.save`` to a temporary file, then rename over ``path``."""
    import torch
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_final(model, tok, out: Path, info: dict, save_dtype: str):
    """HF-format model + tokenizer + training.json in ``out``."""
    import torch
    out.mkdir(parents=True, exist_ok=True)
    n_params = sum(t.numel() for t in model.parameters())
    if save_dtype == "auto":
        save_dtype = "fp32" if n_params * 4 < 26e6 else "bf16"
    model = model.to("cpu")
    if save_dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    hf_tokenizer(tok, model.config.max_position_embeddings).save_pretrained(out)
    info["saved_dtype"] = save_dtype
    info["files"] = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()}
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import contextlib
    import dataclasses
    import torch
    torch.set_num_threads(args.threads)
    corpus = load_corpus_module()
    p = dataclasses.replace(PRESETS[args.preset])
    steps = args.steps or p.steps
    dev = torch.device(args.device)
    ckdir = Path(args.ckpt)
    ckdir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    train_docs, held_docs = corpus.load_corpus("train"), corpus.load_corpus("heldout")
    tok_path = ckdir / f"tokenizer-{p.vocab}.json"
    from tokenizers import Tokenizer
    if args.init:
        tok = Tokenizer.from_file(str(Path(args.init) / "tokenizer.json"))
    elif tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer((t for _, t in train_docs), p.vocab)
        tok.save(str(tok_path))
    stream, held = token_stream(tok, train_docs), token_stream(tok, held_docs)
    lines = corpus.code_lines(train_docs)
    print(f"corpus: {len(train_docs)} train files, {len(stream)} tokens; "
          f"{len(held_docs)} held-out files, {len(held)} tokens", flush=True)

    torch.manual_seed(args.seed)
    model = build_model(p, tok)
    if args.init:
        from safetensors.torch import load_file
        sd = load_file(str(Path(args.init) / "model.safetensors"))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            sys.exit(f"--init {args.init} does not match preset {args.preset}: {missing} {unexpected}")
    model = model.to(dev)
    opt = make_optimizer(model, p)
    n_params = sum(t.numel() for t in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, preset {args.preset}, {steps} steps", flush=True)

    state = {"step": 0, "elapsed": 0.0, "tokens": 0, "log": [], "evals": []}
    meta = {"preset": asdict(p), "steps": steps, "seed": args.seed}
    if args.init:
        meta["init"] = str(Path(args.init).resolve())
    ck = ckdir / "ckpt.pt"
    if ck.exists():
        saved = torch.load(ck, map_location=dev, weights_only=False)
        if saved["meta"] != meta:
            sys.exit(f"{ck} was made with other settings: {saved['meta']}; remove it to restart")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed from {ck} at step {state['step']}", flush=True)

    if args.dtype == "bf16":
        autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    batcher = Batcher(corpus, tok, stream, lines, p, args.seed, steps)
    eot = tok.token_to_id(EOT)

    def checkpoint():
        atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                     "meta": meta}, ck)

    session_t0, last_ck, stopped_early = time.time(), time.time(), False
    base_elapsed = state["elapsed"]
    win_tok, win_t0, win = 0, time.time(), []
    model.train()
    while state["step"] < steps:
        step = state["step"]
        if base_elapsed + time.time() - session_t0 > args.minutes * 60:
            stopped_early = True
            print(f"time budget of {args.minutes} min reached at step {step}", flush=True)
            break
        ids, w = (t.to(dev) for t in batcher.batch(step))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, p, steps)
        lm, ans, cp = losses(model, ids, w, autocast)
        (lm + p.answer_weight * ans + p.copy_weight * cp).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens"] += ids.numel()
        state["elapsed"] = base_elapsed + time.time() - session_t0
        win_tok += ids.numel()
        has = (w[:, :, 1:].sum((1, 2)) > 0).tolist()
        win.append([x.item() if h else float("nan") for x, h in zip((lm, ans, cp), has)])
        if state["step"] % args.log_every == 0 or state["step"] == steps:
            tps = win_tok / (time.time() - win_t0)
            lm_m, ans_m, cp_m = (_nanmean([r[k] for r in win]) for k in range(3))
            eta = (steps - state["step"]) * ids.numel() / tps / 60
            rec = {"step": state["step"], "T": ids.shape[1], "lr": float(f"{lr_at(step, p, steps):.3g}"),
                   "lm_loss": round(lm_m, 4), "answer_loss": round(ans_m, 4),
                   "copy_loss": round(cp_m, 4),
                   "grad_norm": round(gnorm, 3), "tok_per_s": round(tps),
                   "elapsed_min": round(state["elapsed"] / 60, 2)}
            state["log"].append(rec)
            print(" ".join(f"{k}={v}" for k, v in rec.items()) + f" eta_min~{eta:.0f}", flush=True)
            win_tok, win_t0, win = 0, time.time(), []
        if state["step"] % args.eval_every == 0 or state["step"] == steps:
            model.eval()
            hl = heldout_loss(model, held, 512, 8, autocast, eot)
            model.train()
            state["evals"].append({"step": state["step"], "heldout_loss_512": round(hl, 4)})
            print(f"eval step={state['step']} heldout_loss_512={hl:.4f}", flush=True)
        if time.time() - last_ck > args.ckpt_minutes * 60:
            checkpoint()
            last_ck = time.time()
            print(f"checkpoint saved at step {state['step']}", flush=True)
    checkpoint()

    model.eval()
    final = {"heldout_loss_1024": heldout_loss(model, held, min(1024, p.max_pos), 32, autocast, eot)}
    final["heldout_ppl_1024"] = math.exp(final["heldout_loss_1024"])
    for L in sorted({256, 512, min(1024, p.max_pos)}):
        final[f"passkey_acc_{L}"] = passkey_accuracy(model, corpus, tok, corpus.code_lines(held_docs),
                                                     L, 20, args.seed, autocast, dev)
    print("final:", json.dumps(final), flush=True)
    info = {
        "model": "LlamaForCausalLM", "parameters": n_params, "preset": args.preset,
        "init": meta.get("init"),
        "hyperparameters": asdict(p) | {"steps": steps, "seed": args.seed, "device": args.device,
                                        "threads": args.threads, "autocast": args.dtype,
                                        "optimizer": "AdamW(betas=(0.9,0.95), eps=1e-8)",
                                        "schedule": "linear warm-up, cosine to min_lr_frac*lr",
                                        "grad_clip": 1.0},
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "special_tokens": [EOT], "digits": "always single tokens",
                      "bos": "EOT prepended by the post-processor"},
        "corpus": corpus.corpus_description(),
        "token_counts": {"train_stream": len(stream), "heldout_stream": len(held),
                         "seen_in_training": state["tokens"]},
        "passkey_format": {"intro": corpus.PASSKEY_INTRO, "key_line": corpus.PASSKEY_LINE,
                           "question": corpus.PASSKEY_QUESTION},
        "steps_done": state["step"], "stopped_early": stopped_early,
        "train_wall_minutes": round(state["elapsed"] / 60, 2),
        "this_session_wall_minutes": round((time.time() - t_start) / 60, 2),
        "final_train_log": state["log"][-5:], "evals": state["evals"], "final": final,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
    }
    save_final(model, tok, Path(args.out), info, args.save_dtype)
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
