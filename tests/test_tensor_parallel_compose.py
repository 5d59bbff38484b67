"""TensorParallel with every other pass: two gloo ranks (``tp_worker.py``) against the same
passes without the split in one process, and the combinations refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rewriter
from rewriter.errors import PassError, RewriterError
from rewriter.ir.shard import shard
from rewriter.passes import (DuoAttention, FuseQKV, FuseSwiGLU, Int4Weights, PromptLookup,
                             SelfSpeculative, TensorParallel)
from rewriter.runtime.kv_cache import cache_table

from artifact_tools import artifact_files, reseal
from conftest import make_model
from tp_tools import same_as_one_process


# ---------------------------------------------------------------- two ranks, one process
# (the scenarios of every file run in one launch: the session fixture tp_ranks)
@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_fusions_int4_and_layer_skip_compose(tp_ranks):
    """FuseQKV / FuseSwiGLU (each fused weight split per part), FuseAddRMSNorm, FuseRoPE,
    all four, Int4Weights (groups whole), LayerSkip: before and after the split."""
    same_as_one_process(tp_ranks, ["fusions_before", "fusions_after", "int4_before",
                                   "int4_after", "layer_skip_before", "layer_skip_after"])


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_speculative_strategies_compose(tp_ranks):
    """Drafts on every rank (skipped layers, replicated heads, an EAGLE layer, copied
    text), acceptance from replicated logits: every rank takes the same decisions."""
    same_as_one_process(tp_ranks, ["self_speculative", "self_speculative_before", "medusa",
                                   "hydra", "eagle", "eagle_before",
                                   "prompt_lookup"])


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_sparse_and_shared_caches_compose(tp_ranks):
    """Per-KV-head choices follow their heads (DuoAttention with a rank of only full heads
    and one of only streaming heads; Quest's pages, TidalDecode's tokens); ShareKV and
    MiniCache share each rank's own caches."""
    same_as_one_process(tp_ranks, ["streaming", "streaming_before", "duo", "duo_uneven", "duo_share_kv",
                                   "quest", "tidal_decode", "share_kv", "minicache"])


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_artifact_and_triton_compose(tp_ranks):
    """The split model saved by the test process (whole weights and the pass:
    tp_tools.launch_every_scenario) and loaded by every rank; the Triton backend
    (interpreted) on two ranks."""
    same_as_one_process(tp_ranks, ["artifact", "triton"])


# ---------------------------------------------------------------- each rank's split
def test_fused_projections_split_per_part():
    """A fused q/k/v (gate/up) weight: each rank holds its rows of each part, in order,
    not one contiguous block of the fused rows."""
    model = make_model("llama-gqa-3l", hidden_size=72, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=96)
    plain = rewriter.optimize(model, passes=[TensorParallel(2)])
    fused = rewriter.optimize(model, passes=[FuseQKV(), FuseSwiGLU(), TensorParallel(2)])
    for rank in range(2):
        a, b = shard(plain.ir, rank).weights(), shard(fused.ir, rank).weights()
        layer = "model.layers.0."
        for fused_name, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj",
                                                          "self_attn.v_proj")),
                                  ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
            expected = torch.cat([a[f"{layer}{p}.weight"] for p in parts])  # [rows of each part]
            assert torch.equal(b[f"{layer}{fused_name}.weight"], expected), (rank, fused_name)


def test_duo_attention_heads_follow_their_ranks():
    """Layer 0's KV head 0 attends fully, head 1 streams: rank 0 attends fully (no ring),
    rank 1 streams its one head; the caches follow."""
    model = make_model("llama-gqa-3l")
    opt = rewriter.optimize(model, passes=[TensorParallel(2), DuoAttention(
        [[0.9, 0.1], [0.1, 0.2], [0.9, 0.8]], sinks=2, window=4)])
    windows = []
    for rank in range(2):
        table = cache_table(shard(opt.ir, rank).gm)
        windows.append([(s.num_kv_heads, s.window is not None) for s in table.values()][:1])
    assert windows == [[(1, False)], [(1, True)]]


# ---------------------------------------------------------------- refused by name
def test_int4_groups_straddling_ranks_are_refused_by_name():
    """Each rank's share of o_proj's 64 columns is 32: not a whole group of 64."""
    model = make_model("llama-gqa-3l", intermediate_size=128)
    why = r"TensorParallel.*o_proj.*not whole 4-bit groups of 64 \(Int4Weights\)"
    with pytest.raises(PassError, match=why):
        rewriter.optimize(model, passes=[Int4Weights(group_size=64), TensorParallel(2)])
    with pytest.raises(PassError, match="Int4Weights.* does not verify: " + why):
        rewriter.optimize(model, passes=[TensorParallel(2), Int4Weights(group_size=64)])


def test_timing_passes_after_the_split_are_refused_by_name():
    """A pass that chooses by timing cannot time a split model in one process, and ranks
    timing apart would choose apart: it goes before TensorParallel, or is told its choice."""
    model = make_model("llama-gqa-3l")
    with pytest.raises(PassError, match="PromptLookup.*before TensorParallel"):
        rewriter.optimize(model, passes=[TensorParallel(2), PromptLookup(adapt=True)])
    prompts = [[(7 * i + 3) % 120 for i in range(40)]]
    with pytest.raises(PassError, match="SelfSpeculative.*before TensorParallel"):
        rewriter.optimize(model, passes=[TensorParallel(2), SelfSpeculative(calibrate=prompts)])


def test_kv_bytes_per_token_is_the_whole_models():
    """A split model reports the whole model's KV bytes (every rank's together), as
    unsplit; each rank holds its own heads' share."""
    model = make_model("llama-gqa-3l", hidden_size=72, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=96)
    whole = rewriter.optimize(model)
    split = rewriter.optimize(model, passes=[TensorParallel(2)])
    assert split.kv_bytes_per_token(64) == whole.kv_bytes_per_token(64)
    per_rank = [sum(s.bytes_for(64, torch.float32) for s in cache_table(shard(split.ir, r).gm).values())
                for r in range(2)]
    assert sum(per_rank) == 64 * whole.kv_bytes_per_token(64)
    assert per_rank[0] == 2 * per_rank[1]  # 2 KV heads and 1


def _hostile(tmp_path, edit) -> Path:
    model = make_model("llama-gqa-3l", num_hidden_layers=1)
    rewriter.optimize(model, passes=[TensorParallel(2)]).save(tmp_path / "a")
    path = artifact_files(tmp_path / "a")["ir.json"]
    ir = json.loads(path.read_text())
    edit(ir)
    path.write_text(json.dumps(ir))
    reseal(tmp_path / "a")
    return tmp_path / "a"


def _sums(ir: dict) -> list[dict]:
    return [n for n in ir["graph"] if n.get("target") == "rw.all_reduce"]


def _other_world(ir: dict) -> None:
    _sums(ir)[0]["args"][1] = 3


def _no_split_recorded(ir: dict) -> None:
    del ir["info"]["tensor_parallel"]


def _no_sums(ir: dict) -> None:
    for n in _sums(ir):  # each sum's users read its input instead: the sums are gone
        name, source = n["name"], n["args"][0]
        for m in ir["graph"]:
            m["args"] = json.loads(json.dumps(m.get("args", [])).replace(
                json.dumps({"node": name}), json.dumps(source)))
    ir["graph"] = [n for n in ir["graph"] if n.get("target") != "rw.all_reduce"]


def _partial_read(ir: dict) -> None:
    """The residual add reads the projection's own (partial) value, not its sum."""
    total = _sums(ir)[0]
    reader = next(m for m in ir["graph"] if {"node": total["name"]} in m.get("args", []))
    reader["args"] = [total["args"][0] if a == {"node": total["name"]} else a
                      for a in reader["args"]]


def _sliced_read(ir: dict) -> None:
    """The residual add reads the attention's output (each rank's slice of the heads)
    instead of its sum: a reader outside the region."""
    total = _sums(ir)[0]
    attention = next(m for m in ir["graph"] if m.get("target") == "rw.attention")
    reader = next(m for m in ir["graph"] if {"node": total["name"]} in m.get("args", []))
    reader["args"] = [{"node": attention["name"]} if a == {"node": total["name"]} else a
                      for a in reader["args"]]


def _keyword_sum(ir: dict) -> None:
    """A sum whose input comes by keyword: read by name, as the op's schema allows."""
    total = _sums(ir)[0]
    total["kwargs"] = {"x": total["args"][0], "world_size": total["args"][1]}
    total["args"] = []


@pytest.mark.parametrize("edit, why", [
    (_sliced_read, "reads attention, of which each rank holds only a slice"),
    (_keyword_sum, None),
    (_other_world, "sums over 3 ranks, but the IR is split over 2"),
    (_no_split_recorded, "records no tensor-parallel split"),
    (_no_sums, "split over 2 ranks .* but sums over none"),
    (_partial_read, "is summed over ranks but is not a projection read by its sum alone"),
])
def test_hostile_split_artifacts_are_refused_at_load(tmp_path, edit, why):
    """An ir.json whose sums disagree with its recorded split runs other arithmetic than
    the model's on the ranks: refused at load, by name, in one process."""
    if why is None:  # a legitimate form: it loads
        rewriter.load(_hostile(tmp_path, edit))
        return
    with pytest.raises(RewriterError, match=why):
        rewriter.load(_hostile(tmp_path, edit))
