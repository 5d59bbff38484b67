"""LayerSkip: the rewritten IR equals the Hugging Face model with those layers deleted."""
import pytest
import torch

import rewriter
from conftest import CONFIGS, assert_close_rel, drop_layers, hf_logits, traced_model
from rewriter.passes import LayerSkip
from rewriter.passes.layer_skip import kept_positions


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_skipping_layers_equals_hf_with_layers_deleted(name):
    model, traced = traced_model(name)
    skip = {1}
    opt = rewriter.optimize(traced, passes=[LayerSkip(layers=sorted(skip))])
    reference = drop_layers(model, skip)
    for b, s in [(1, 5), (2, 11)]:
        ids = torch.randint(0, model.config.vocab_size, (b, s))
        assert_close_rel(opt(ids), hf_logits(reference, ids))


def test_skipped_layers_leave_no_nodes_and_no_weights():
    model, traced = traced_model("llama-gqa-3l")
    opt = rewriter.optimize(traced, passes=[LayerSkip(layers=[1])])
    ir = opt.ir
    assert {n.meta.get("layer") for n in ir.ops()} - {None} == {0, 2}
    assert not any(".layers.1." in name for name in ir.weights())
    assert not any(".layers.1." in name for name, _ in ir.gm.named_buffers())
    assert [s["index"] for s in ir.layers] == [0, 2]
    assert ir.info["skipped_layers"] == [1]
    before = rewriter.optimize(traced).ir.num_params()
    per_layer = sum(p.numel() for p in model.model.layers[1].parameters())
    assert ir.num_params() == before - per_layer


def test_speedup_keeps_first_last_and_spreads_the_rest():
    model, traced = traced_model("llama-gqa-3l", num_hidden_layers=7)
    opt = rewriter.optimize(traced, passes=[LayerSkip(speedup=2.0)])
    kept = [s["index"] for s in opt.ir.layers]
    assert kept == [0, 2, 4, 6]  # round(7 / 2) = 4 kept
    ids = torch.randint(0, 128, (1, 8))
    assert_close_rel(opt(ids), hf_logits(drop_layers(model, {1, 3, 5}), ids))


@pytest.mark.parametrize("num_layers,speedup,expected", [
    (7, 2.0, {0, 2, 4, 6}),        # round(3.5) = 4 kept
    (8, 2.0, {0, 2, 5, 7}),        # 4 kept, evenly spread
    (32, 1.5, None),               # 21 kept
    (5, 1.0, {0, 1, 2, 3, 4}),     # speedup 1 keeps all
    (5, 2.0, {0, 2, 4}),           # 2.5 rounds half up to 3
    (4, 100.0, {0, 3}),            # never fewer than the first and last
])
def test_kept_positions_follow_the_unified_layer_skipping_rule(num_layers, speedup, expected):
    kept = kept_positions(num_layers, speedup)
    assert 0 in kept and num_layers - 1 in kept
    assert len(kept) == max(2, min(num_layers, int(num_layers / speedup + 0.5)))
    if expected is not None:
        assert kept == expected
    gaps = [b - a for a, b in zip(sorted(kept), sorted(kept)[1:])]
    assert max(gaps) - min(gaps) <= 1  # evenly spread


def test_two_layer_skips_compose():
    model, traced = traced_model("llama-gqa-3l", num_hidden_layers=6)
    opt = rewriter.optimize(traced, passes=[LayerSkip(layers=[1]), LayerSkip(layers=[3, 4])])
    assert [s["index"] for s in opt.ir.layers] == [0, 2, 5]
    ids = torch.randint(0, 128, (2, 9))
    assert_close_rel(opt(ids), hf_logits(drop_layers(model, {1, 3, 4}), ids))


def test_pass_is_recorded_with_its_parameters():
    _, traced = traced_model("llama-gqa-3l")
    opt = rewriter.optimize(traced, passes=[LayerSkip(speedup=1.5)])
    assert repr(opt.passes[0]) == "LayerSkip(speedup=1.5)"
    assert opt.history[0]["pass"] == "LayerSkip"
    assert opt.history[0]["params"] == {"layers": None, "speedup": 1.5}
