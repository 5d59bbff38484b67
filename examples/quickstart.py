"""The main job: optimize a model, show the IR, compare cost and quality, generate.

    python examples/quickstart.py [--speedup 1.5] [--dump dumps/]

Uses the project's trained default model when it is present in
``rewriter/assets/default_model``; until then, a seeded random Llama (whose quality
numbers mean nothing, and the table says so).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tabulate import tabulate
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import rewriter
from rewriter.passes import LayerSkip

DEFAULT_MODEL = Path(rewriter.__file__).parent / "assets" / "default_model"


def load_model():
    if (DEFAULT_MODEL / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL).eval(), "default (trained)"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.2)
    return LlamaForCausalLM(config).eval(), "random Llama (untrained: quality is not meaningful)"


def greedy(opt, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by re-running the whole prefix (no KV cache yet: see the runtime issue)."""
    for _ in range(new_tokens):
        nxt = opt(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


def measure(name, opt, base_logits, ids, n_layers):
    start = time.perf_counter()
    for _ in range(3):
        logits = opt(ids)
    ms = (time.perf_counter() - start) / 3 * 1e3
    agree = (logits.argmax(-1) == base_logits.argmax(-1)).float().mean().item()
    return [name, f"{len(opt.ir.layers)}/{n_layers}", f"{opt.ir.num_params() / 1e6:.2f}M",
            f"{ms:.1f}", f"{agree:.3f}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speedup", type=float, default=1.5, help="LayerSkip target speedup")
    ap.add_argument("--dump", default=None, help="write the IR after every pass here")
    args = ap.parse_args()

    model, label = load_model()
    n_layers = model.config.num_hidden_layers
    print(f"model: {label}, {n_layers} layers\n")
    base = rewriter.optimize(model)
    opt = rewriter.optimize(model, passes=[LayerSkip(speedup=args.speedup)], dump=args.dump)
    print(opt.ir, "\n")

    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    base_logits = base(ids)
    rows = [measure("unoptimized", base, base_logits, ids, n_layers),
            measure(repr(opt.passes[0]), opt, base_logits, ids, n_layers)]
    print(tabulate(rows, headers=["pipeline", "layers", "params", "forward ms (4x64, CPU)",
                                  "top-1 agreement"]), "\n")

    prompt = ids[:1, :8]
    print("greedy, unoptimized:", greedy(base, prompt, 16)[0, 8:].tolist())
    print("greedy, optimized:  ", greedy(opt, prompt, 16)[0, 8:].tolist())


if __name__ == "__main__":
    main()
