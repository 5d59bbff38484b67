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

# name -> (config, overrides, passes as specs; "tensor_parallel" marks where the split goes
#          [, options: {"backend": "triton", "prompts": (batch, length)}])
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

# FuseAllReduceRMSNorm: the rule's form (CPU: all-reduce then add + norm) and the forced
# two-shot form (two_shot_tokens=1), before and after FuseAddRMSNorm; 3-row prompts give
# token counts (21, 15, 9, then 3 per decode step) that 2 ranks share unevenly, and
# two_shot_tokens=4 runs the prefill two-shot and the decode steps the other way.
_UNEVEN = SCENARIOS["uneven"][1]
_FUSE = "fuse_all_reduce_rms_norm"
_SPLIT = "tensor_parallel:world_size=2"
SCENARIOS.update({
    "fused": ("llama-gqa-3l", {}, [_SPLIT, _FUSE]),
    "fused_two_shot": ("llama-gqa-3l", {}, [_SPLIT, f"{_FUSE}:two_shot_tokens=1"]),
    "fused_two_shot_odd": ("llama-gqa-3l", {}, [_SPLIT, "fuse_add_rms_norm",
                                                f"{_FUSE}:two_shot_tokens=1"], {"prompts": (3, 7)}),
    "fused_uneven": ("llama-gqa-3l", _UNEVEN, ["fuse_add_rms_norm", _SPLIT,
                                               f"{_FUSE}:two_shot_tokens=4"], {"prompts": (3, 5)}),
    "fused_triton": ("llama-gqa-3l", {"num_hidden_layers": 1},
                     [_SPLIT, f"{_FUSE}:two_shot_tokens=1"],
                     {"backend": "triton", "prompts": (3, 3)}),
})
# passes that need the split: the one-process run leaves them out with it
SPLIT_ONLY = ("tensor_parallel", _FUSE)


def prompts(vocab: int, shape: tuple[int, int] = (2, 11)) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, shape, generator=g)


def options(name: str) -> dict:
    return SCENARIOS[name][3] if len(SCENARIOS[name]) > 3 else {}


def build(name: str, split: bool):
    """The scenario's engine: with ``split`` every pass, else the passes without the split."""
    config, overrides, specs = SCENARIOS[name][:3]
    model = conftest.make_model(config, **overrides)
    passes = [from_spec(s) for s in specs if split or not s.startswith(SPLIT_ONLY)]
    backend = options(name).get("backend", "torch")
    return rewriter.optimize(model, passes=passes, backend=backend), model


def outputs(engine, vocab: int, shape: tuple[int, int] = (2, 11)) -> dict[str, torch.Tensor]:
    """Greedy tokens and the runtime's log-probabilities of the prompts."""
    ids = prompts(vocab, shape)
    return {"tokens": engine.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=vocab - 1,
                                      pad_token_id=0),
            "logprobs": engine.score(ids, prefix=1)}


def run_split(name: str) -> dict[str, torch.Tensor]:
    engine, model = build(name, split=True)
    return outputs(engine, model.config.vocab_size, options(name).get("prompts", (2, 11)))


def run_whole(name: str) -> dict[str, torch.Tensor]:
    engine, model = build(name, split=False)
    return outputs(engine, model.config.vocab_size, options(name).get("prompts", (2, 11)))
