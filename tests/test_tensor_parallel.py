"""TensorParallel: the split IR (whole weights, sums over ranks), each rank's shard, and
two ranks on gloo (``tp_worker.py``) against one process."""
from __future__ import annotations

import pytest
import torch

import rewriter
from rewriter.errors import PassError, RewriterError
from rewriter.ir.shard import ShardError, shard, split_units
from rewriter.passes import TensorParallel, from_spec

from conftest import assert_close_rel, hf_logits, make_model
from tp_tools import refusal, same_as_one_process


def test_split_units_are_contiguous_and_uneven_first():
    assert split_units(3, 2) == [(0, 2), (2, 3)]
    assert split_units(4, 2) == [(0, 2), (2, 4)]
    assert split_units(5, 3) == [(0, 2), (2, 4), (4, 5)]


def test_split_ir_is_still_the_model():
    """Whole weights, sums that are the identity: the IR the pass returns gives the model's
    logits, with one sum after each row-parallel projection (two per layer)."""
    model = make_model("llama-gqa-3l")
    opt = rewriter.optimize(model, passes=[TensorParallel(world_size=2)])
    assert opt.ir.op_counts()["rw.all_reduce"] == 2 * 3
    assert opt.ir.info["tensor_parallel"] == {"world_size": 2}
    assert "rw.all_reduce(%linear_3, world_size=2)" in str(opt.ir)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_close_rel(opt(ids), hf_logits(model, ids))
    assert from_spec("tensor_parallel:world_size=2").world_size == 2


def test_uneven_split_gives_whole_kv_groups():
    """9 query heads over 3 KV heads on 2 ranks: 6 + 3 query heads, 2 + 1 KV heads, the MLP
    halved; rank 1 adds no row bias twice (there is none here) and every weight is cut."""
    model = make_model("llama-gqa-3l", hidden_size=72, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=96)
    opt = rewriter.optimize(model, passes=[TensorParallel(2)])
    heads = []
    for rank in range(2):
        piece = shard(opt.ir, rank)
        attn = next(n for n in piece.graph.nodes if n.target is torch.ops.rw.attention.default)
        heads.append((attn.kwargs.get("num_heads", attn.args[4]), attn.args[5]))
        w = piece.weights()
        assert w["model.layers.0.self_attn.q_proj.weight"].shape[0] == heads[-1][0] * 8
        assert w["model.layers.0.self_attn.o_proj.weight"].shape[1] == heads[-1][0] * 8
        assert w["model.layers.0.mlp.down_proj.weight"].shape[1] == 48
        assert piece.info["tensor_parallel"] == {"world_size": 2, "rank": rank}
    assert heads == [(6, 2), (3, 1)]


def test_impossible_splits_are_refused_by_name():
    with pytest.raises(PassError, match="2 KV heads; each of 4 ranks needs a whole one"):
        rewriter.optimize(make_model("llama-gqa-3l"), passes=[TensorParallel(4)])
    with pytest.raises(PassError, match="1 KV heads"):
        rewriter.optimize(make_model("qwen2-mqa-3l"), passes=[TensorParallel(2)])
    for bad in (1, 0, 2.0, True, "2", 10 ** 6):
        with pytest.raises(ValueError, match="world_size"):
            TensorParallel(bad)
    model = make_model("llama-gqa-3l")
    with pytest.raises(PassError, match="split already"):
        rewriter.optimize(model, passes=[TensorParallel(2), TensorParallel(2)])


def test_split_model_without_ranks_says_how_to_run_it():
    """One process, no process group: optimize() builds every rank's programs (their
    errors surface there), and generate names the way to run it."""
    opt = rewriter.optimize(make_model("llama-gqa-3l"), passes=[TensorParallel(2)])
    with pytest.raises(RewriterError, match="run it in 2 processes"):
        opt.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    with pytest.raises(ShardError, match="rank 2 is not one of the 2 ranks"):
        shard(opt.ir, 2)


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_two_ranks_on_gloo_match_one_process(tp_ranks):
    """Two processes on 127.0.0.1: the same greedy tokens on every rank and as one process,
    log-probabilities within float32 rounding (sums in another order)."""
    # the split alone, on every family; other files test the rest
    names = ["llama", "uneven", "qwen2", "gpt2", "mistral", "neox", "phi", "opt"]
    same_as_one_process(tp_ranks, names)


def test_info_names_the_ranks_a_split_artifact_runs_on(tmp_path):
    import subprocess
    import sys
    opt = rewriter.optimize(make_model("llama-gqa-3l"), passes=[TensorParallel(2)])
    opt.save(tmp_path / "tp2")
    out = subprocess.run([sys.executable, "-m", "rewriter", "info", str(tmp_path / "tp2")],
                         capture_output=True, text=True, timeout=300).stdout
    assert f"split over 2 ranks: rewriter run {tmp_path / 'tp2'} --tp 2" in out


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_ranks_holding_different_models_refuse_to_run(tp_ranks):
    """Ranks whose models differ only in a decoding choice (SelfSpeculative's skipped
    layers, recorded in info, not in the graph) would pair unlike collectives: every rank
    refuses at lowering, by name (a rank's error ending the launch: tests/test_tp_run.py)."""
    for why in refusal(tp_ranks, "differs"):
        assert why.startswith("RewriterError: ranks [1] hold a different model than rank 0"), why
    assert not any(k.startswith("differs.") and k != "differs.refused" for k in tp_ranks[0])
