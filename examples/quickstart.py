"""The main job: optimize the default model, show the IR, compare quality and cost, generate.

    python examples/quickstart.py [--speedup 1.5] [--dump dumps/] [--full]

1. Load the project's small trained Llama (``rewriter.default_model()``; no network).
2. ``rewriter.optimize`` it with ``LayerSkip(speedup=...)`` and print the IR.
3. Measure both against the unoptimized model with ``rewriter.eval`` (held-out perplexity,
   greedy agreement, pass-key retrieval, forward passes / layers / KV bytes / ms per token).
4. Generate a continuation of a code prompt with each, through the KV-cache runtime.
"""
from __future__ import annotations

import argparse

import rewriter
from rewriter.eval import EvalSettings, evaluate, format_table
from rewriter.passes import LayerSkip

PROMPT = "import os\nimport sys\n\n\ndef main():\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speedup", type=float, default=1.5, help="LayerSkip target speedup")
    ap.add_argument("--dump", default=None, help="write the IR after every pass here")
    ap.add_argument("--full", action="store_true", help="the full evaluation (slower)")
    args = ap.parse_args()

    model, tokenizer = rewriter.default_model()
    print(f"default model: Llama, {model.config.num_hidden_layers} layers, "
          f"{model.num_parameters() / 1e6:.2f}M parameters\n")
    base = rewriter.optimize(model)
    opt = rewriter.optimize(model, passes=[LayerSkip(speedup=args.speedup)], dump=args.dump)
    print(opt.ir, "\n")

    settings = EvalSettings() if args.full else EvalSettings(
        ppl_chunks=8, prompts=4, passkey_depths=(0.2, 0.5, 0.8), passkey_trials=2)
    rows = evaluate({"unoptimized": base, repr(opt.passes[0]): opt}, tokenizer, settings)
    print(format_table(rows), "\n")

    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    for name, engine in (("unoptimized", base), (repr(opt.passes[0]), opt)):
        out = engine.generate(ids, max_new_tokens=48)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        print(f"--- {name}, greedy:\n{PROMPT}{text}\n")
    out = opt.generate(ids, max_new_tokens=48, do_sample=True, temperature=0.8, top_p=0.95, seed=0)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"--- {repr(opt.passes[0])}, sampled (temperature 0.8, top_p 0.95, seed 0):\n{PROMPT}{text}")


if __name__ == "__main__":
    main()
