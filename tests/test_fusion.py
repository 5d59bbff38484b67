"""Fusion passes: each one's IR before and after on a one-layer Llama (golden text), and
numerically lossless against the unfused IR on every family it applies to.

Regenerate the golden files after an intended change with
``REWRITER_UPDATE_GOLDEN=1 pytest tests/test_fusion.py``, and read the diff.
"""
import functools
import os
from pathlib import Path

import pytest
import torch

import rewriter
from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU, LayerSkip

from conftest import CONFIGS, assert_close_rel, traced_model, varied_init

GOLDEN = Path(__file__).parent / "golden"
PASSES = {"fuse_qkv": FuseQKV, "fuse_swiglu": FuseSwiGLU, "fuse_add_rms_norm": FuseAddRMSNorm,
          "fuse_rope": FuseRoPE}
IDS = torch.tensor([[3, 17, 42, 5, 99, 8, 64], [1, 2, 3, 4, 5, 6, 7]])
GENERATE = dict(max_new_tokens=16, eos_token_id=[])


def varied(config):
    """The trace of ``config`` with weights large enough for varied greedy continuations."""
    return traced_model(config, initializer_range=varied_init(config))[1]


@functools.cache
def unfused(config):
    """The unfused pipeline's logits and greedy tokens for ``IDS``: the reference every
    fusion of ``config`` must equal (computed once, only read)."""
    base = rewriter.optimize(varied(config))
    return base(IDS), base.generate(IDS, **GENERATE)


@pytest.mark.parametrize("name", sorted(PASSES))
def test_before_and_after_match_the_golden_text(name):
    traced = traced_model("llama-gqa-3l", num_hidden_layers=1)[1]
    before = str(rewriter.optimize(traced).ir)
    after = str(rewriter.optimize(traced, passes=[PASSES[name]()]).ir)
    text = f"### before\n{before}\n\n### after {PASSES[name].__name__}()\n{after}\n"
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("REWRITER_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(PASSES))
def test_each_fusion_is_lossless(config, name):
    opt = rewriter.optimize(varied(config), passes=[PASSES[name]()])
    logits, tokens = unfused(config)
    assert_close_rel(opt(IDS), logits, rel=1e-5)
    assert torch.equal(opt.generate(IDS, **GENERATE), tokens)


def test_fusions_find_what_each_family_has():
    counts = {}
    for config in ("llama-gqa-3l", "gpt2-3l"):
        opt = rewriter.optimize(traced_model(config)[1], passes=[p() for p in PASSES.values()])
        counts[config] = opt.ir.info["fusions"]
    # every RMSNorm but the first and the final one: 2 per layer - 1
    assert counts["llama-gqa-3l"] == {"FuseQKV": 3, "FuseSwiGLU": 3, "FuseAddRMSNorm": 5,
                                      "FuseRoPE": 3}
    # GPT-2: biased q/k/v fuse (their biases too); no gated MLP, no RMSNorm, no RoPE
    assert counts["gpt2-3l"] == {"FuseQKV": 3, "FuseSwiGLU": 0, "FuseAddRMSNorm": 0, "FuseRoPE": 0}


def test_fused_weights_replace_the_originals():
    opt = rewriter.optimize(traced_model("llama-gqa-3l")[1], passes=[FuseQKV(), FuseSwiGLU()])
    names = set(opt.ir.weights())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    gone = {f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                   "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert not gone & names
    assert opt.ir.weight("model.layers.0.self_attn.qkv_proj.weight").shape == (64 + 32 + 32, 64)


def test_all_fusions_with_layer_skip_save_and_load(tmp_path):
    traced = traced_model("qwen2-mqa-3l", initializer_range=0.2)[1]
    passes = [LayerSkip(layers=[1]), FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm()]
    opt = rewriter.optimize(traced, passes=passes)
    ref = rewriter.optimize(traced, passes=[LayerSkip(layers=[1])])
    assert torch.equal(opt.generate(IDS, **GENERATE), ref.generate(IDS, **GENERATE))
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert torch.equal(loaded.generate(IDS, **GENERATE), opt.generate(IDS, **GENERATE))


def test_fused_ir_keeps_its_layer_spans():
    traced = traced_model("llama-gqa-3l")[1]
    plain = rewriter.optimize(traced).ir
    fused = rewriter.optimize(traced, passes=[p() for p in PASSES.values()]).ir
    assert [s["index"] for s in fused.layers] == [s["index"] for s in plain.layers] == [0, 1, 2]


def test_layer_skip_after_fuse_add_rms_norm_is_refused():
    traced = traced_model("llama-gqa-3l")[1]
    with pytest.raises(rewriter.PassError, match="must run before FuseAddRMSNorm"):
        rewriter.optimize(traced, passes=[FuseAddRMSNorm(), LayerSkip(layers=[1])])
