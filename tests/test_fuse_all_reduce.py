"""FuseAllReduceRMSNorm: the sum over ranks, the residual add and the norm after it as one
op; its IR against the unfused split IR and the model, its rule, and two ranks on gloo
(``tp_worker.py``) in both forms against one process."""
from __future__ import annotations

import pytest
import torch

import rewriter
from rewriter.errors import PassError
from rewriter.passes import (FuseAddRMSNorm, FuseAllReduceRMSNorm, LayerSkip, SelfSpeculative,
                             TensorParallel, from_spec, to_spec)
from rewriter.runtime.collectives import two_shot

from conftest import assert_close_rel, hf_logits, make_model
from tp_scenarios import SCENARIOS
from tp_tools import same_as_one_process

LAYERS = 3  # llama-gqa-3l
FUSED = [n for n in SCENARIOS if n.startswith("fused")]


def _ids():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def test_fused_ir_is_still_the_model():
    """2L - 1 sites (every sum but the last MLP's, whose norm is the final one), one sum
    left; the logits of the unfused split IR exactly, and the model's; the layer spans kept."""
    model = make_model("llama-gqa-3l")
    unfused = rewriter.optimize(model, passes=[TensorParallel(2)])
    fused = rewriter.optimize(model, passes=[TensorParallel(2), FuseAllReduceRMSNorm()])
    counts = fused.ir.op_counts()
    assert counts["rw.all_reduce_add_rms_norm"] == 2 * LAYERS - 1 and counts["rw.all_reduce"] == 1
    assert fused.ir.info["fusions"] == {"FuseAllReduceRMSNorm": 2 * LAYERS - 1}
    assert "world_size=2, two_shot_tokens=None)" in str(fused.ir)
    assert [s["index"] for s in fused.ir.layers] == [0, 1, 2]
    ids = _ids()
    assert torch.equal(fused(ids), unfused(ids))
    assert_close_rel(fused(ids), hf_logits(model, ids))


@pytest.mark.parametrize("order", ["after", "before", "before_split"])
def test_before_or_after_fuse_add_rms_norm(order):
    """The same sites and logits whichever ran first: after FuseAddRMSNorm its ops take the
    sum in; before it, nothing is left for it but the final norm, which it leaves."""
    passes = {"after": [TensorParallel(2), FuseAddRMSNorm(), FuseAllReduceRMSNorm(8)],
              "before": [TensorParallel(2), FuseAllReduceRMSNorm(8), FuseAddRMSNorm()],
              "before_split": [FuseAddRMSNorm(), TensorParallel(2), FuseAllReduceRMSNorm(8)]}[order]
    model = make_model("llama-gqa-3l")
    opt = rewriter.optimize(model, passes=passes)
    fusions = opt.ir.info["fusions"]
    assert fusions["FuseAllReduceRMSNorm"] == 2 * LAYERS - 1
    assert fusions["FuseAddRMSNorm"] == (0 if order == "before" else 2 * LAYERS - 1)
    counts = opt.ir.op_counts()
    assert counts["rw.all_reduce_add_rms_norm"] == 2 * LAYERS - 1
    assert "rw.add_rms_norm" not in counts and counts["rw.rms_norm"] == 2  # first and final
    assert "two_shot_tokens=8)" in str(opt.ir)
    plain = rewriter.optimize(model, passes=[TensorParallel(2), FuseAllReduceRMSNorm()])
    assert torch.equal(opt(_ids()), plain(_ids()))


def test_artifact_keeps_the_fused_op(tmp_path):
    """Saved and loaded (each rank would cut its shard at load): the same IR, the pass
    and its parameter recorded."""
    model = make_model("llama-gqa-3l")
    opt = rewriter.optimize(model, passes=[TensorParallel(2), FuseAllReduceRMSNorm(16)])
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.op_counts()["rw.all_reduce_add_rms_norm"] == 2 * LAYERS - 1
    assert loaded.pass_specs[-1] == {"name": "FuseAllReduceRMSNorm", "params": {"two_shot_tokens": 16}}
    assert torch.equal(loaded(_ids()), opt(_ids()))


def test_refused_without_the_split_and_nothing_to_fuse_in_gpt2():
    with pytest.raises(PassError, match=r"run TensorParallel\(world_size=N\) before it"):
        rewriter.optimize(make_model("llama-gqa-3l"), passes=[FuseAllReduceRMSNorm()])
    gpt2 = rewriter.optimize(make_model("gpt2-3l"), passes=[TensorParallel(2), FuseAllReduceRMSNorm()])
    assert gpt2.ir.info["fusions"] == {"FuseAllReduceRMSNorm": 0}  # LayerNorm: no site
    assert gpt2.ir.op_counts()["rw.all_reduce"] == 2 * 3


def test_skipping_layers_after_it_is_refused():
    """A fused op joins two layers: a skipped layer's sum would still feed the next norm."""
    split = [TensorParallel(2), FuseAllReduceRMSNorm()]
    for after, match in ((LayerSkip(layers=[1]), "must run before FuseAllReduceRMSNorm"),
                         (SelfSpeculative(skip_layers=[1]), "run it before FuseAllReduceRMSNorm")):
        with pytest.raises(PassError, match=match):
            rewriter.optimize(make_model("llama-gqa-3l"), passes=[*split, after])


def test_parameter():
    assert FuseAllReduceRMSNorm().two_shot_tokens is None
    assert from_spec("fuse_all_reduce_rms_norm:two_shot_tokens=64").two_shot_tokens == 64
    assert to_spec(FuseAllReduceRMSNorm(64)) == "fuse_all_reduce_rms_norm:two_shot_tokens=64"
    assert from_spec(to_spec(FuseAllReduceRMSNorm())).two_shot_tokens is None
    for bad in (0, -1, True, 2.5, "8", 2 ** 31, float("nan")):
        with pytest.raises(ValueError, match="two_shot_tokens must be None"):
            FuseAllReduceRMSNorm(bad)


def test_two_shot_rule():
    """From shapes and the device type alone: never on CPUs unless asked, above 128 tokens
    on CUDA; never with fewer tokens than ranks."""
    assert not any(two_shot(t, 2, None, "cpu") for t in (1, 2, 129, 10 ** 6))
    assert [two_shot(t, 2, None, "cuda") for t in (1, 128, 129)] == [False, False, True]
    assert [two_shot(t, 2, 8, "cpu") for t in (7, 8)] == [False, True]
    assert [two_shot(t, 4, 1, "cuda") for t in (3, 4)] == [False, True]


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_two_ranks_fused_match_unfused_and_one_process(tp_ranks):
    """The fused scenarios (reference and forced two-shot forms, token counts
    2 ranks share unevenly, the 9/3-head split, the Triton backend) give the tokens of one
    process and the same log-probabilities on every rank; on the prompts the unfused
    scenarios share, bit for bit what the unfused split gives."""
    ranks = same_as_one_process(tp_ranks, FUSED)
    for r in ranks:  # which form ran: reduce-scatters only where two-shot was forced
        assert "llama.calls.reduce_scatter_tensor" not in r and r["llama.calls.all_reduce"] > 0
        assert "fused.calls.reduce_scatter_tensor" not in r
        for name in ("fused_two_shot", "fused_two_shot_odd", "fused_uneven", "fused_triton"):
            assert r[f"{name}.calls.reduce_scatter_tensor"] > 0, name
            assert r[f"{name}.calls.all_gather_into_tensor"] > 0, name
    for fused in ("fused", "fused_two_shot"):
        for key in ("tokens", "logprobs"):
            assert torch.equal(ranks[0][f"{fused}.{key}"], ranks[0][f"llama.{key}"]), fused
