"""DuoAttention: full caches for the KV heads whose gates say they retrieve, sink + window
rings for the others, in one layer.

The split runtime is checked against the IR's whole-sequence graph (each head under its
own mask, no cache), and against dense attention and StreamingAttention where the gates
make it one of them. Regenerate the golden text with
``REWRITER_UPDATE_GOLDEN=1 pytest tests/test_duo_attention.py``.
"""
import json
import os
from pathlib import Path

import pytest
import torch

import rewriter
from rewriter.drafts import duo_gates
from rewriter.errors import PassError, RewriterError, VerificationError
from rewriter.ops import REFERENCE, op_arguments
from rewriter.passes import (DuoAttention, FuseQKV, FuseRoPE, LayerSkip, SelfSpeculative,
                             StreamingAttention, TidalDecode, from_spec)
from rewriter.runtime.kv_cache import cache_table, ring_part

from artifact_tools import artifact_files, reseal
from conftest import reference_greedy, traced_model

GOLDEN = Path(__file__).parent / "golden"
ROWS = [[3, 17, 42, 5, 99, 8, 64, 7, 9, 11, 13, 2], [1, 2, 3], [50, 60, 70, 80, 90]]
KW = dict(max_new_tokens=14, eos_token_id=[])
MIXED = [[0.9, 0.1], [0.1, 0.2], [0.9, 0.8]]  # layer 0 split, layer 1 streams, layer 2 full


def _model(config="llama-gqa-3l"):
    """The trace of ``config`` (traced once per process; each pipeline optimizes a copy)."""
    return traced_model(config, initializer_range=0.2)[1]


def duo(model, gates=MIXED, sinks=2, window=4, extra=(), **kw):
    return rewriter.optimize(model, passes=[DuoAttention(gates, sinks=sinks, window=window, **kw),
                                            *extra])


def test_the_ir_shows_the_gates_and_the_split():
    after = str(duo(_model()).ir)
    text = f"### after DuoAttention({MIXED}, sinks=2, window=4)\n{after}\n"
    path = GOLDEN / "duo_attention.txt"
    if os.environ.get("REWRITER_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
    lines = [l for l in after.splitlines() if "rw.attention" in l]
    assert "gates=[0.9, 0.1], window=4, sinks=2, full_heads=[0]" in lines[0]
    assert "full_heads" not in lines[1] and "sinks=2" in lines[1]
    assert "sinks" not in lines[2] and "gates=[0.9, 0.8]" in lines[2]


@pytest.mark.parametrize("config", ["llama-gqa-3l", "qwen2-hd20-2l", "llama-hd24-2l"])
def test_the_split_runtime_equals_the_whole_sequence_graph(config):
    hf, model = traced_model(config, initializer_range=0.2)
    heads = hf.config.num_key_value_heads
    layers = hf.config.num_hidden_layers
    gates = [[0.9 if (h + i) % 2 == 0 else 0.1 for h in range(heads)] for i in range(layers)]
    opt = duo(model, gates)
    assert any(s.full_heads for s in cache_table(opt.ir.gm).values())
    got = opt.generate(ROWS, **KW)
    for i, row in enumerate(ROWS):  # ragged: left padding; each row's sinks are its own
        assert torch.equal(got[i, -len(row) - 14:], reference_greedy(opt, row, 14)), i
    assert not torch.equal(got, rewriter.optimize(model).generate(ROWS, **KW))


def test_all_heads_full_is_dense_and_all_streaming_is_streaming_attention():
    model = _model()
    dense = rewriter.optimize(model).generate(ROWS, **KW)
    full = duo(model, [[1.0, 0.7]] * 3)
    assert torch.equal(full.generate(ROWS, **KW), dense)
    assert not any(s.ring for s in cache_table(full.ir.gm).values())
    streaming = duo(model, [[0.0, 0.3]] * 3)
    want = rewriter.optimize(model, passes=[StreamingAttention(sinks=2, window=4)])
    assert torch.equal(streaming.generate(ROWS, **KW), want.generate(ROWS, **KW))
    assert all(s.bounded for s in cache_table(streaming.ir.gm).values())


def test_each_head_of_a_split_op_is_dense_or_streaming():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 4 * 8), torch.randn(2, 9, 2 * 8), torch.randn(2, 9, 2 * 8)
    common = dict(layer=0, num_heads=4, num_kv_heads=2, head_dim=8, scale=0.3)
    split = REFERENCE["attention"](q, k, v, **common, window=3, sinks=1, full_heads=[1])
    dense = REFERENCE["attention"](q, k, v, **common)
    ring = REFERENCE["attention"](q, k, v, **common, window=3, sinks=1)
    split, dense, ring = (t.view(2, 9, 4, 8) for t in (split, dense, ring))
    torch.testing.assert_close(split[:, :, 2:], dense[:, :, 2:])  # KV head 1: query heads 2, 3
    torch.testing.assert_close(split[:, :, :2], ring[:, :, :2])
    assert not torch.allclose(dense[:, :, :2], ring[:, :, :2])


def test_memory_is_allocated_per_part():
    model = _model()
    opt, dense = duo(model), rewriter.optimize(model)
    opt.generate(ROWS, **KW)
    shapes = {key: tuple(t.shape) for key, t in opt._cache.k.items()}
    length = shapes[2][2]
    assert shapes[0] == (3, 1, length, 16) and shapes[ring_part(0)] == (3, 1, 2 + 4 + 1, 16)
    assert shapes[1] == (3, 2, 7, 16) and shapes[2] == (3, 2, length, 16)
    per_head_token = 2 * 16 * 4  # K and V, float32
    want = per_head_token * (1 * 1000 + 1 * 7 + 2 * 7 + 2 * 1000)
    assert opt.kv_bytes_per_token(1000) == want // 1000
    assert dense.kv_bytes_per_token(1000) == per_head_token * 6
    assert opt.kv_bytes_per_token(1000) < dense.kv_bytes_per_token(1000) / 1.9


def test_static_decode_steps_give_the_same_tokens():
    opt = duo(_model())
    want = opt.generate(ROWS, **KW)
    opt.static_decode = True  # device-side positions, as a CUDA-graph step runs
    assert torch.equal(opt.generate(ROWS, **KW), want)


def test_fusions_and_layer_skip_compose():
    model = _model()
    want = duo(model).generate(ROWS, **KW)
    assert torch.equal(duo(model, extra=[FuseQKV(), FuseRoPE()]).generate(ROWS, **KW), want)
    skipped = rewriter.optimize(model, passes=[LayerSkip(layers=[1]), DuoAttention(MIXED, sinks=2,
                                                                                   window=4)])
    got = skipped.generate(ROWS, **KW)
    for i, row in enumerate(ROWS):
        assert torch.equal(got[i, -len(row) - 14:], reference_greedy(skipped, row, 14)), i


def test_artifact_round_trip_keeps_the_split_and_the_gates(tmp_path):
    opt = duo(_model(), extra=[FuseRoPE()])
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert torch.equal(loaded.generate(ROWS, **KW), opt.generate(ROWS, **KW))
    assert cache_table(loaded.ir.gm) == cache_table(opt.ir.gm)
    assert "gates=[0.9, 0.1]" in str(loaded.ir) and "full_heads=[0]" in str(loaded.ir)


def test_a_tampered_split_is_refused_on_load(tmp_path):
    duo(_model()).save(tmp_path / "a")
    path = artifact_files(tmp_path / "a")["ir.json"]
    data = json.loads(path.read_text())
    split = [n for n in data["graph"] if "full_heads" in n.get("kwargs", {})]
    assert len(split) == 1
    split[0]["kwargs"]["full_heads"] = [0, 1]  # every head: no ring left to split off
    path.write_text(json.dumps(data))
    reseal(tmp_path / "a")
    with pytest.raises(rewriter.ArtifactError, match="full_heads"):
        rewriter.load(tmp_path / "a")


def test_the_triton_backend_equals_torch(monkeypatch):
    from rewriter.runtime import triton_attention
    kernel, sink_queries = triton_attention.decode_attention, []

    def counted(*args, **kw):
        sink_queries.append(kw.get("q_sink") is not None)
        return kernel(*args, **kw)

    monkeypatch.setattr(triton_attention, "decode_attention", counted)
    model = _model()
    # 8 new tokens: the 3-token row's ring of 2 + 4 slots wraps too (the interpreter's time
    # grows with every step)
    kw = {**KW, "max_new_tokens": 8}
    want = duo(model).generate(ROWS, **kw)
    triton = rewriter.optimize(model, passes=[DuoAttention(MIXED, sinks=2, window=4)],
                               backend="triton")
    assert torch.equal(triton.generate(ROWS, **kw), want)
    # per decode step: layer 0's full head and ring, layer 1's ring, layer 2's full heads
    steps = kw["max_new_tokens"] - 1
    assert sink_queries.count(True) == 2 * steps and sink_queries.count(False) == 2 * steps


def test_threshold_and_sparsity_choose_the_full_heads():
    gates = [[0.9, 0.1], [0.4, 0.6], [0.3, 0.8]]
    assert DuoAttention(gates, sinks=1, window=2).full_heads() == [[0], [1], [1]]
    # a gate at the threshold keeps its head full, as the reference's >= does
    assert DuoAttention(gates, threshold=0.6, sinks=1, window=2).full_heads() == [[0], [1], [1]]
    assert DuoAttention([[0.0, 1.0]], threshold=0.0, sinks=1, window=2).full_heads() == [[0, 1]]
    assert DuoAttention([[0.0, 1.0]], threshold=1.0, sinks=1, window=2).full_heads() == [[1]]
    # sparsity counts the layers asked about only
    assert DuoAttention(gates, sparsity=0.5, sinks=1, window=2).full_heads([1, 2]) == [[0, 1], [1], [1]]
    assert DuoAttention(gates, threshold=0.35, sinks=1, window=2).full_heads() == [[0], [0, 1], [1]]
    # the two lowest of six gates (0.1, 0.3) stream, whatever the threshold
    assert DuoAttention(gates, sparsity=1 / 3, sinks=1, window=2).full_heads() == [[0], [0, 1], [1]]
    assert DuoAttention(gates, sparsity=0.0, sinks=1, window=2).full_heads() == [[0, 1]] * 3
    assert DuoAttention(gates, sparsity=1.0, sinks=1, window=2).full_heads() == [[], [], []]


def test_speculative_strategies_and_token_selection_are_refused():
    model = _model()
    with pytest.raises(RewriterError, match="sink \\+ window"):
        duo(model, extra=[SelfSpeculative(skip_layers=[1])])
    with pytest.raises(PassError, match="speculative"):
        rewriter.optimize(model, passes=[SelfSpeculative(skip_layers=[1]),
                                         DuoAttention(MIXED, sinks=2, window=4)])
    with pytest.raises(PassError, match="TidalDecode"):
        rewriter.optimize(model, passes=[TidalDecode(selection_layers=[0], top_k=4),
                                         DuoAttention(MIXED, sinks=2, window=4)])
    with pytest.raises(PassError, match="limits what it sees"):
        duo(model, extra=[TidalDecode(selection_layers=[0], top_k=4)])
    with pytest.raises(PassError, match="StreamingAttention"):
        rewriter.optimize(model, passes=[StreamingAttention(sinks=1, window=4),
                                         DuoAttention(MIXED, sinks=2, window=4)])


def test_models_that_do_not_fit_the_gates_are_refused():
    with pytest.raises(PassError, match="sliding window"):
        duo(_model("mistral-window-3l"))
    with pytest.raises(PassError, match="gates cover 2 layers"):
        duo(_model(), MIXED[:2])
    with pytest.raises(PassError, match="1 KV heads"):
        duo(_model("qwen2-mqa-3l"))


@pytest.mark.parametrize("kwargs,match", [
    ({"gates": [[0.5, 1.5]]}, "in \\[0, 1\\]"), ({"gates": [[0.5], [0.5, 0.5]]}, "same number"),
    ({"gates": []}, "non-empty"), ({"gates": [[float("nan"), 0.5]]}, "in \\[0, 1\\]"),
    ({"gates": [[0.5, 0.5]], "sinks": None}, "sinks= and window="),
    ({"gates": [[0.5, 0.5]], "threshold": 2}, "threshold"),
    ({"gates": [[0.5, 0.5]], "sparsity": -0.1}, "sparsity"),
    ({"gates": [[0.5, 0.5]], "window": 0}, "window"), ({"gates": 3}, "gates must be"),
])
def test_bad_parameters_name_themselves(kwargs, match):
    kwargs = {"sinks": 1, "window": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        DuoAttention(**kwargs)


@pytest.mark.parametrize("content,match", [
    (b"not json", "not JSON"), (b"[1, 2]", "not a rewriter-duo-gates"),
    (json.dumps({"format": "rewriter-duo-gates", "version": 1, "sinks": 4, "window": 8,
                 "gates": [[0.5, 2.0]]}).encode(), "gate \\[0\\]\\[1\\]"),
    (json.dumps({"format": "rewriter-duo-gates", "version": 1, "sinks": -4, "window": 8,
                 "gates": [[0.5, 0.2]]}).encode(), "sinks"),
    (json.dumps({"format": "rewriter-duo-gates", "version": 1, "sinks": 4, "window": 8,
                 "gates": [[0.5, 0.2]], "model": []}).encode(), "model must be an object"),
])
def test_bad_gates_files_are_refused_with_the_reason(tmp_path, content, match):
    path = tmp_path / "gates.json"
    path.write_bytes(content)
    with pytest.raises(duo_gates.GatesFileError, match=match):
        DuoAttention(str(path))


def test_a_huge_or_missing_gates_file_is_refused(tmp_path):
    with pytest.raises(duo_gates.GatesFileError, match="no such gates file"):
        DuoAttention(str(tmp_path / "absent.json"))
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (duo_gates.MAX_BYTES + 1))
    with pytest.raises(duo_gates.GatesFileError, match="larger than"):
        DuoAttention(str(big))


def test_a_gates_file_sets_sinks_and_window_and_the_cli_spec_reads_it(tmp_path):
    path = tmp_path / "g.json"
    duo_gates.save(duo_gates.Gates(MIXED, 2, 4), path)
    p = from_spec(f"duo_attention:gates={path},threshold=0.5")
    assert (p.sinks, p.window, p.full_heads()) == (2, 4, [[0], [], [0, 1]])
    model = _model()
    assert torch.equal(rewriter.optimize(model, passes=[p]).generate(ROWS, **KW),
                       duo(model).generate(ROWS, **KW))


@pytest.mark.parametrize("kwargs,match", [
    ({"full_heads": [0]}, "needs sinks"),
    ({"full_heads": [0, 1], "sinks": 1, "window": 2}, "some, not all"),
    ({"full_heads": [1, 0], "sinks": 1, "window": 2}, "sorted"),
    ({"full_heads": [2], "sinks": 1, "window": 2}, "some, not all"),
    ({"gates": [0.5]}, "1 values for 2 KV heads"),
])
def test_bad_split_attributes_fail_verification(kwargs, match):
    opt = rewriter.optimize(_model())
    node = next(n for n in opt.ir.graph.nodes if n.target is rewriter.ops.OPS["attention"])
    bound = op_arguments("attention", tuple(node.args), dict(node.kwargs))
    node.args = tuple(node.args[:3])
    node.kwargs = {**{k: v for k, v in bound.items() if k not in "qkv"}, **kwargs}
    with pytest.raises(VerificationError, match=match):
        from rewriter.ir.verify import verify
        verify(opt.ir)


def test_the_cache_description_counts_full_and_ring_heads():
    from rewriter.runtime.kv_cache import describe
    table = describe(cache_table(duo(_model()).ir.gm), torch.float32)
    per_head = 2 * 16 * 4
    assert table["bytes_per_token"] == per_head * (1 + 0 + 2)  # layer 0's full head, layer 2
    assert table["bounded_bytes"] == per_head * (1 + 2) * (2 + 4 + 1)


def test_a_split_on_a_sliding_window_model_is_refused_on_load(tmp_path):
    model = _model("mistral-window-3l")
    rewriter.optimize(model, passes=[StreamingAttention(sinks=1, window=3)]).save(tmp_path / "a")
    path = artifact_files(tmp_path / "a")["ir.json"]
    data = json.loads(path.read_text())
    node = next(n for n in data["graph"] if "sinks" in n.get("kwargs", {}))
    node["kwargs"]["full_heads"] = [0]
    path.write_text(json.dumps(data))
    reseal(tmp_path / "a")
    with pytest.raises(rewriter.ArtifactError, match="sliding window"):
        rewriter.load(tmp_path / "a")


def test_deeply_nested_gates_files_are_refused(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(duo_gates.GatesFileError, match="not JSON"):
        DuoAttention(str(path))
    path.write_text(json.dumps({"format": "rewriter-duo-gates", "version": True, "sinks": 1,
                                "window": 2, "gates": [[0.5]]}))
    with pytest.raises(duo_gates.GatesFileError, match="version"):
        DuoAttention(str(path))


def test_original_positions_leave_the_sinks_where_they_are():
    ir = duo(_model(), positions="original").ir
    assert "rotary=" not in str(ir) and "sinks=2" in str(ir)
