"""The tensor-parallel test scenarios: a model, the passes before and after the split,
built alike by the test process (whole, on one process) and by each rank
(``tp_worker.py``, split), so the two can be compared."""
from __future__ import annotations

import functools
import os
import tempfile

import torch

import conftest
import rewriter
from rewriter.errors import RewriterError
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
    # the other families the frontend lifts: a sliding window, parallel attention + MLP,
    # partial rotary, OPT (its MLP is not marked as one, so only attention splits)
    "mistral": ("mistral-window-3l", {}, ["tensor_parallel:world_size=2"]),
    "neox": ("neox-parallel-3l", {}, ["tensor_parallel:world_size=2"]),
    "phi": ("phi-gqa-2l", {}, ["tensor_parallel:world_size=2"]),
    "opt": ("opt-2l", {}, ["tensor_parallel:world_size=2"]),
    # Phi-3: qkv_proj and gate_up_proj split by the lifter into the linears the split reads
    "phi3": ("phi3-gqa-2l", {}, ["tensor_parallel:world_size=2"]),
    # Qwen3: the QK-norm (rw.head_rms_norm) split by whole heads, its [D] weight whole
    "qwen3": ("qwen3-gqa-2l", {}, ["tensor_parallel:world_size=2"]),
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

# ---- composition: TensorParallel with every other pass (tests/test_tensor_parallel_compose.py)
TP = "tensor_parallel:world_size=2"
UNEVEN = dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, intermediate_size=96)
FUSIONS = ["fuse_qkv", "fuse_swiglu", "fuse_add_rms_norm", "fuse_rope"]
DUO = "duo_attention:sinks=2,window=4,gates="
# layer 0: rank 0 keeps only KV head 0 (full), rank 1 only head 1 (streaming)
DUO_GATES = "[[0.9,0.1],[0.1,0.2],[0.9,0.8]]"
# 3 KV heads, ranks keep 0-1 and 2: mixed + full, mixed + streaming, full + streaming
DUO_UNEVEN = "[[0.9,0.1,0.9],[0.1,0.9,0.1],[0.9,0.9,0.1]]"


def _eagle(before: bool):
    """EagleDraft from a seeded random draft file (made alike in every process), before or
    after the split; the draft layer stays whole on every rank."""
    def build(model, split: bool):
        from rewriter.passes import EagleDraft
        with tempfile.TemporaryDirectory() as d:
            path = conftest.random_draft(model, os.path.join(d, "draft.safetensors"))
            draft = [EagleDraft(weights=str(path), nodes=6, expand=2, depth=3)]
            tp = [from_spec(TP)] * split
            return rewriter.optimize(model, passes=draft + tp if before else tp + draft)
    return build


def _draft_heads(arch: str):
    """MedusaHeads / HydraHeads from a seeded random heads file, replicated on every rank."""
    def build(model, split: bool):
        from test_hydra_heads import hydra_heads
        with tempfile.TemporaryDirectory() as d:
            path = hydra_heads(model, os.path.join(d, "heads.safetensors"), k=2, arch=arch)
            heads = from_spec(f"{arch}_heads:weights={path},tree=[[0],[1],[0,0],[0,1]]")
            return rewriter.optimize(model, passes=[from_spec(TP)] * split + [heads])
    return build


def _artifact(model, split: bool):
    """The split model saved by the test process (``TP_COMPOSE_ARTIFACT``: whole weights and
    the pass), loaded by every rank; one process runs the same passes without the split."""
    if split:
        return rewriter.load(os.environ["TP_COMPOSE_ARTIFACT"])
    return rewriter.optimize(model, passes=[from_spec("fuse_qkv"), from_spec("fuse_swiglu")])


def _triton(model, split: bool):
    specs = [TP] * split + ["fuse_add_rms_norm"]
    return rewriter.optimize(model, passes=[from_spec(s) for s in specs], backend="triton")


SCENARIOS.update({
    "fusions_before": ("llama-gqa-3l", UNEVEN, [*FUSIONS, TP]),
    "fusions_after": ("qwen2-hd20-2l", {}, [TP, *FUSIONS]),
    # the MLP's 3 (5) groups of 32 split 2 + 1 (3 + 2), each rank's heads one (two) groups
    "int4_before": ("llama-gqa-3l", {}, ["int4_weights:group_size=32", TP]),
    "int4_after": ("llama-gqa-3l", dict(hidden_size=128, intermediate_size=160),
                   [TP, "int4_weights:group_size=32"]),
    "layer_skip_before": ("llama-gqa-3l", {}, ["layer_skip:layers=[1]", TP]),
    "layer_skip_after": ("llama-gqa-3l", {}, [TP, "layer_skip:layers=[1]"]),
    "self_speculative": ("llama-gqa-3l", {}, [TP, "self_speculative:skip_layers=[1]"]),
    "self_speculative_before": ("llama-gqa-3l", UNEVEN, ["self_speculative:skip_layers=[1]", TP]),
    "medusa": ("llama-gqa-3l", {}, _draft_heads("medusa")),
    "hydra": ("llama-gqa-3l", UNEVEN, _draft_heads("hydra")),
    "eagle": ("llama-gqa-3l", {}, _eagle(before=False)),
    "eagle_before": ("llama-gqa-3l", UNEVEN, _eagle(before=True)),
    "prompt_lookup": ("llama-gqa-3l", {}, [TP, "prompt_lookup:adapt=false"]),
    "streaming": ("llama-gqa-3l", {}, [TP, "streaming_attention:sinks=2,window=4"]),
    "streaming_before": ("gpt2-3l", {}, ["streaming_attention:sinks=2,window=4", TP]),
    "duo": ("llama-gqa-3l", {}, [TP, DUO + DUO_GATES]),
    "duo_uneven": ("llama-gqa-3l", UNEVEN, [DUO + DUO_UNEVEN, TP]),
    # layer 1 reads layer 0's cache; on rank 0 both keep only a full head
    "duo_share_kv": ("llama-gqa-3l", {}, ["share_kv:every=2", DUO + DUO_GATES, TP]),
    "quest": ("llama-gqa-3l", {}, [TP, "quest:page=4,budget=8,dense_layers=1"]),
    "tidal_decode": ("llama-gqa-3l", UNEVEN, ["tidal_decode:selection_layers=[1],top_k=4", TP]),
    "share_kv": ("llama-gqa-3l", {}, [TP, "share_kv:every=2"]),
    "minicache": ("llama-gqa-3l", {}, [TP, "minicache"]),
    "artifact": ("llama-gqa-3l", UNEVEN, _artifact),
    "triton": ("llama-gqa-3l", dict(num_hidden_layers=2), _triton),
})
# ---- end of composition

# ---- Gemma 3 (tests/test_gemma3.py): 2 KV groups of 2 heads each; the QK-norm per head
# keeps its weight [D] whole on each rank; the fused GeGLU GEMM splits by its halves;
# FuseAllReduceRMSNorm finds no site (each sum
# feeds a post-norm, not the residual add) and leaves the split model as it was
SCENARIOS.update({
    "gemma3": ("gemma3:gqa-3l", {}, [TP]),
    "gemma3_fused": ("gemma3:gqa-3l", {}, [*FUSIONS, TP, _FUSE]),
})
# ---- end of Gemma 3



def prompts(vocab: int, shape: tuple[int, int] = (2, 11)) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, shape, generator=g)


def options(name: str) -> dict:
    return SCENARIOS[name][3] if len(SCENARIOS[name]) > 3 else {}


def _differs(model, split: bool):
    """Each rank drafting with other skipped layers: the same graph, other decoding choices
    (``info["decoding"]``); every rank must refuse to run."""
    import torch.distributed as dist
    layer = 1 + (dist.get_rank() if split else 0)
    passes = [from_spec(f"self_speculative:skip_layers=[{layer}]"), *[from_spec(TP)] * split]
    return rewriter.optimize(model, passes=passes)


SCENARIOS["differs"] = ("llama-gqa-3l", {}, _differs)
# scenario -> the error every rank must raise (tp_worker.py records it and goes on)
REFUSED = {"differs": RewriterError}


def _make(config: str, overrides: dict):
    """(a seeded model of ``config``, what ``rewriter.optimize`` takes): tests/conftest.py's
    configs traced once per process (``traced_model``: scenarios of one config share the
    trace), tests/test_frontend_families.py's and test_frontend_new_families.py's traced by
    ``optimize``."""
    if config in conftest.CONFIGS:
        return conftest.traced_model(config, **overrides)
    if config.startswith("gemma3:"):
        return _gemma3(config.split(":", 1)[1], tuple(sorted(overrides.items())))
    import test_frontend_families
    import test_frontend_new_families
    families = test_frontend_new_families if config in test_frontend_new_families.FAMILIES \
        else test_frontend_families
    model = families.make(config, **overrides)
    return model, model


@functools.cache
def _gemma3(name: str, overrides: tuple):
    """tests/test_gemma3.py's model ``name`` and its trace, once per process."""
    import test_gemma3
    model = test_gemma3.make(name, **dict(overrides))
    return model, rewriter.trace(model)


def build(name: str, split: bool):
    """The scenario's engine: with ``split`` every pass, else the passes without the split."""
    config, overrides, specs = SCENARIOS[name][:3]
    model, traced = _make(config, overrides)
    if callable(specs):  # a scenario that builds its own engine: specs(model, split)
        return specs(model, split), model
    passes = [from_spec(s) for s in specs if split or not s.startswith(SPLIT_ONLY)]
    backend = options(name).get("backend", "torch")
    return rewriter.optimize(traced, passes=passes, backend=backend), model


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
