"""The tensor-parallel test scenarios: a model, the passes before and after the split,
built alike by the test process (whole, on one process) and by each rank
(``tp_worker.py``, split), so the two can be compared."""
from __future__ import annotations

import torch

import conftest
import rewriter
from rewriter.passes import from_spec

WORLD = 2
NEW_TOKENS = 8

# name -> (config, overrides, passes as specs; "tensor_parallel" marks where the split goes)
SCENARIOS = {
    # even split: 2 KV groups, 2 ranks
    "llama": ("llama-gqa-3l", {}, ["tensor_parallel:world_size=2"]),
    # SmolLM2's shape of heads: 9 query heads over 3 KV heads, so 2 ranks split 2 + 1
    "uneven": ("llama-gqa-3l", dict(hidden_size=72, num_attention_heads=9,
                                    num_key_value_heads=3, intermediate_size=96),
               ["tensor_parallel:world_size=2"]),
    # biases on q/k/v (column-parallel: sliced) and MQA refused at 2 ranks is another test
    "qwen2": ("qwen2-hd20-2l", {}, ["tensor_parallel:world_size=2"]),
    # GPT-2: LayerNorm, fc -> gelu -> proj with biases (the row bias added once)
    "gpt2": ("gpt2-3l", {}, ["tensor_parallel:world_size=2"]),
}


def prompts(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 11), generator=g)


def build(name: str, split: bool):
    """The scenario's engine: with ``split`` every pass, else the passes without the split."""
    config, overrides, specs = SCENARIOS[name]
    model = conftest.make_model(config, **overrides)
    passes = [from_spec(s) for s in specs if split or not s.startswith("tensor_parallel")]
    return rewriter.optimize(model, passes=passes), model


def outputs(engine, vocab: int) -> dict[str, torch.Tensor]:
    """Greedy tokens and the runtime's log-probabilities of the prompts."""
    ids = prompts(vocab)
    return {"tokens": engine.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=vocab - 1,
                                      pad_token_id=0),
            "logprobs": engine.score(ids, prefix=1)}


def run_split(name: str) -> dict[str, torch.Tensor]:
    engine, model = build(name, split=True)
    return outputs(engine, model.config.vocab_size)


def run_whole(name: str) -> dict[str, torch.Tensor]:
    engine, model = build(name, split=False)
    return outputs(engine, model.config.vocab_size)
