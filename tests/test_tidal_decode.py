"""TidalDecode: selection layers pick the top-k tokens the later layers attend to at decode.

A one-token prompt has nothing to select, so from it on every step is a decode step and
the runtime must equal the whole-sequence graph, which selects at every position.
"""
import pytest
import torch

import rewriter
from rewriter.errors import PassError, RewriterError
from rewriter.ops import OPS, selected_mask
from rewriter.passes import (FuseQKV, FuseRoPE, SelfSpeculative, StreamingAttention, TidalDecode,
                             from_spec)

from conftest import make_model, reference_greedy, traced_model

ROWS = [[3, 17, 42, 5, 99, 8, 64, 7, 9, 11, 13, 2], [1, 2, 3], [50, 60, 70, 80, 90]]
KW = dict(max_new_tokens=12, eos_token_id=[])
# the Triton runs' new tokens: three decode steps select top_k 3 of the 12-token row's
# cache (the interpreter's time grows with every step)
TRITON_NEW = 4


def test_the_selection_is_an_ir_value_between_layers():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    ir = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[1], top_k=4)]).ir
    (sel,) = ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])
    users = sorted(u.meta["layer"] for u in sel.users)
    assert users == [2]  # the layers after it; layers 0 and 1 stay dense
    assert "select=%select_tokens" in str(ir)
    assert sorted(s["index"] for s in ir.layers) == [0, 1, 2]  # every layer keeps its span


@pytest.mark.parametrize("config", ["llama-gqa-3l", "qwen2-hd20-2l"])
def test_top_k_covering_every_token_equals_dense(config):
    model = make_model(config, initializer_range=0.2)
    traced = rewriter.trace(model)  # one trace, 2 pipelines
    dense = rewriter.optimize(traced)
    tidal = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0], top_k=128)])  # the context
    assert torch.equal(tidal.generate(ROWS, **KW), dense.generate(ROWS, **KW))


def test_recent_keeps_the_last_tokens_and_the_top_k_comes_from_before_them():
    from rewriter.ops import REFERENCE
    k = torch.tensor([9.0, 0.0, 5.0, 1.0, 8.0, 7.0]).view(1, 6, 1)  # one head, D=1
    q = torch.ones(1, 6, 1)  # attends most to the largest key
    sel = REFERENCE["select_tokens"](q, k, 0, 1, 1, 1, 1, 2)[0, 0]  # top 1 + 2 recent
    assert sel.shape == (6, 3)
    assert sel[5].tolist() == [0, 3, 4]  # 3 and 4 recent; the best before them is 0 (9.0)
    assert sel[4].tolist() == [0, 2, 3]
    assert sel[2].tolist() == [-1, 0, 1]
    assert sel[1].tolist() == [-1, -1, 0]


@pytest.mark.parametrize("layers,top_k,recent", [([0], 2, 0), ([0, 1], 3, 0), ([0], 2, 3)])
def test_decode_steps_equal_the_whole_sequence_graph(layers, top_k, recent):
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=layers, top_k=top_k,
                                                        recent=recent)])
    dense = rewriter.optimize(traced)
    prompts = [[5], [17], [99]]  # one token: every later step is a decode step
    got = opt.generate(prompts, max_new_tokens=16, eos_token_id=[])
    for i, row in enumerate(prompts):
        assert torch.equal(got[i], reference_greedy(opt, row, 16))
    assert not torch.equal(got, dense.generate(prompts, max_new_tokens=16, eos_token_id=[]))


@pytest.mark.parametrize("recent", [0, 4])
def test_a_ragged_batch_equals_each_row_alone_and_static_steps_agree(recent):
    # a one-token row: its local window reaches into its left padding, which it must not see
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0], top_k=3, recent=recent)])
    rows = [*ROWS, [7]]
    together = opt.generate(rows, **KW)
    for i, row in enumerate(rows):
        assert torch.equal(together[i, -12:], opt.generate([row], **KW)[0, -12:])
    opt.static_decode = True
    assert torch.equal(opt.generate(rows, **KW), together)


def test_a_window_or_top_k_past_the_cache_equals_dense_and_a_causal_window_is_refused():
    from rewriter.ops import check_arguments, op_arguments
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    dense = rewriter.optimize(traced).generate(ROWS, **KW)
    # past the cache (the context is 128 tokens, more is refused): capped at the cache
    for top_k, recent in [(1, 127), (128, 0)]:
        opt = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0], top_k=top_k,
                                                            recent=recent)])
        assert torch.equal(opt.generate(ROWS, **KW), dense)
    ir = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0], top_k=2)]).ir
    (attn,) = [n for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"])
               if n.kwargs.get("select") is not None][:1]
    with pytest.raises(ValueError, match="select .* window=4"):
        bound = op_arguments("attention", tuple(attn.args), dict(attn.kwargs))
        check_arguments("attention", (), {**bound, "window": 4})


def test_selected_mask_names_the_selection_and_the_query_itself():
    select = torch.tensor([[[[-1, -1], [0, -1], [1, 0]]]])  # [B=1, Hkv=1, S=3, k=2]
    mask = selected_mask(select, 3)[0, 0].int().tolist()
    assert mask == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    mask = selected_mask(torch.tensor([[[[0, -1]]]]), 5)[0, 0].int().tolist()  # the last of 5
    assert mask == [[1, 0, 0, 0, 1]]


def test_artifact_round_trip_and_the_command_line(tmp_path):
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[from_spec("tidal_decode:selection_layers=[0],top_k=3"),
                                            FuseQKV()])
    opt.save(tmp_path / "a")
    assert torch.equal(rewriter.load(tmp_path / "a").generate(ROWS, **KW), opt.generate(ROWS, **KW))


def test_conflicts_are_refused_by_name():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    with pytest.raises(PassError, match="before FuseRoPE"):
        rewriter.optimize(traced, passes=[FuseRoPE(), TidalDecode()])
    with pytest.raises(PassError, match="already limits"):
        rewriter.optimize(traced, passes=[StreamingAttention(window=8), TidalDecode()])
    with pytest.raises(PassError, match="speculative"):
        rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1]), TidalDecode()])
    with pytest.raises(RewriterError, match="TidalDecode"):
        rewriter.optimize(traced, passes=[TidalDecode(), SelfSpeculative(skip_layers=[1])])
    with pytest.raises(PassError, match="cache 9"):
        rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[9])])
    with pytest.raises(ValueError, match="top_k"):
        TidalDecode(top_k=0)
    for recent in (-1, True, 1.5, 2**31):
        with pytest.raises(ValueError, match="recent must be an integer >= 0"):
            TidalDecode(recent=recent)
    with pytest.raises(ValueError, match="selection_layers"):
        TidalDecode(selection_layers=[])


@pytest.mark.slow
@pytest.mark.parametrize("recent,rope", [(0, False), (2, True)])
def test_triton_backend_equals_torch(recent, rope):
    # decode steps pass the kernel the selected positions (with FuseRoPE, keys rotated as written)
    pytest.importorskip("triton")
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    passes = lambda: [TidalDecode(selection_layers=[0], top_k=3, recent=recent), FuseQKV(),  # noqa: E731
                      *([FuseRoPE()] if rope else [])]
    ref = rewriter.optimize(traced, passes=passes())
    tri = rewriter.optimize(traced, passes=passes(), backend="triton")
    kw = dict(max_new_tokens=TRITON_NEW, eos_token_id=[])
    assert torch.equal(tri.generate(ROWS, **kw), ref.generate(ROWS, **kw))


def test_later_selection_layers_attend_fully_and_a_last_one_is_refused():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    ir = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0, 1], top_k=3)]).ir
    selects = {n.meta["layer"]: n.kwargs.get("select")
               for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"])}
    assert selects[0] is None and selects[1] is None and selects[2] is not None
    assert selects[2].kwargs["layer"] == 1  # the newest selection
    with pytest.raises(PassError, match="never read"):
        rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[2])])


def test_passes_that_would_orphan_the_selection_are_refused():
    from rewriter.passes import LayerSkip
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    with pytest.raises(PassError, match="before TidalDecode"):
        rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0]), LayerSkip(layers=[1])])
    with pytest.raises(PassError, match="cannot follow TidalDecode"):
        rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0]), StreamingAttention()])
    skipped = rewriter.optimize(traced, passes=[LayerSkip(layers=[1]), TidalDecode(selection_layers=[0])])
    assert skipped.ir.info["skipped_layers"] == [1]


def test_a_selection_wired_to_another_layer_is_refused_when_verified():
    from rewriter.errors import VerificationError
    from rewriter.ir.verify import verify
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0], top_k=3)])
    (sel,) = opt.ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])
    sel.kwargs = {**sel.kwargs, "layer": 2}
    with pytest.raises(VerificationError, match="layer"):
        verify(opt.ir)


CALIBRATION = [[(7 * i + 3 * j) % 97 + 1 for i in range(48)] for j in range(2)]  # 48 > 32 queries


def test_calibration_chooses_the_layers_that_keep_the_most_attention(monkeypatch):
    """The pass builds what best_selection_layers chooses from the measured kept mass, with
    the matrix's positions mapped to the IR's layers."""
    import rewriter.measure.attention_recall as recall
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    kept = torch.tensor([[1.0, 0.1, 0.1], [0.0, 1.0, 0.9], [0.0, 0.0, 1.0]])
    monkeypatch.setattr(recall, "kept_mass", lambda rows, top_k, recent: kept)
    tidal = TidalDecode(calibrate=CALIBRATION, top_k=4, max_read=0.8)
    opt = rewriter.optimize(traced, passes=[tidal])
    assert tidal.selection_layers == [1] and tidal.report["selection_layers"] == [1]
    assert tidal.report["tokens"] == 48
    # layer 1 selects for layer 2: (2 dense + (4 + 1) / 48) / 3 layers of dense bytes
    assert tidal.report["read"] == pytest.approx((2 + 5 / 48) / 3)
    (sel,) = opt.ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])
    assert sel.meta["layer"] == 1 and [u.meta["layer"] for u in sel.users] == [2]
    same = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[1], top_k=4)])
    assert torch.equal(opt.generate(ROWS, **KW), same.generate(ROWS, **KW))
    assert "calibrate=<2 prompts>" in repr(tidal)


def test_calibration_averages_each_prompts_measure_and_chooses_from_it():
    """The pass's batching and averaging: its matrix is the mean of the prompts' own, and
    its layers are what best_selection_layers makes of that mean."""
    from rewriter.measure.attention_recall import attention_rows, best_selection_layers, kept_mass
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    tidal = TidalDecode(calibrate=CALIBRATION, top_k=8, recent=2, max_read=0.9)
    rewriter.optimize(traced, passes=[tidal])
    ir = rewriter.optimize(traced).ir
    kept = sum(kept_mass(attention_rows(ir, torch.tensor([p]), 32), 8, 2) for p in CALIBRATION) / 2
    assert torch.allclose(torch.tensor(tidal.report["kept"]), kept, atol=1e-6)
    want = best_selection_layers(kept, 48, 8, 2, 0.9)
    assert tidal.selection_layers == want.selection_layers


def test_calibration_refusals_name_the_problem():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    with pytest.raises(ValueError, match="not both"):
        TidalDecode(selection_layers=[0], calibrate=CALIBRATION)
    for bad in ([], [[1, 2, 3]], "abc", [[1.0] * 40], [[-1] * 40]):
        with pytest.raises(ValueError, match="calibrate must be a list of token-id lists"):
            TidalDecode(calibrate=bad)
    for bad in (0, 1.5, float("nan"), True, "0.3"):
        with pytest.raises(ValueError, match="max_read"):
            TidalDecode(calibrate=CALIBRATION, max_read=bad)
    with pytest.raises(PassError, match="no selection fits.*max_read"):
        rewriter.optimize(traced, passes=[TidalDecode(calibrate=CALIBRATION, top_k=4, max_read=0.3)])
    with pytest.raises(PassError, match="outside the vocabulary"):
        rewriter.optimize(traced, passes=[TidalDecode(calibrate=[[10 ** 6] * 40])])
    with pytest.raises(ValueError, match="max_read goes with calibrate"):
        TidalDecode(selection_layers=[0], max_read=0.3)
    assert TidalDecode(calibrate=CALIBRATION).max_read == 0.25


def test_calibration_refuses_what_it_cannot_select_from_before_measuring(monkeypatch):
    import rewriter.measure.attention_recall as recall

    def never(*args):
        raise AssertionError("calibration ran")
    monkeypatch.setattr(recall, "attention_rows", never)
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    with pytest.raises(PassError, match="before FuseRoPE"):
        rewriter.optimize(traced, passes=[FuseRoPE(), TidalDecode(calibrate=CALIBRATION)])
    with pytest.raises(PassError, match="already limits"):
        rewriter.optimize(traced, passes=[StreamingAttention(window=8), TidalDecode(calibrate=CALIBRATION)])
    from rewriter.passes import Quest
    with pytest.raises(PassError, match="select=a selection"):
        rewriter.optimize(traced, passes=[Quest(page=4, budget=8, dense_layers=1),
                                          TidalDecode(calibrate=CALIBRATION)])


def test_calibration_names_the_ir_layers_after_layer_skip(monkeypatch):
    """Matrix positions are the IR's remaining layers: after LayerSkip drops layer 0, the
    first position is cache 1."""
    import rewriter.measure.attention_recall as recall
    from rewriter.passes import LayerSkip
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    monkeypatch.setattr(recall, "kept_mass", lambda rows, top_k, recent: torch.tensor([[1.0, 0.9], [0.0, 1.0]]))
    tidal = TidalDecode(calibrate=CALIBRATION, top_k=4, max_read=0.9)
    opt = rewriter.optimize(traced, passes=[LayerSkip(layers=[0]), tidal])
    assert tidal.report["layers"] == [1, 2] and tidal.selection_layers == [1]
    (sel,) = opt.ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])
    assert [u.meta["layer"] for u in sel.users] == [2]


def test_a_calibrated_artifact_keeps_its_layers_and_info_counts_the_prompts(tmp_path, capsys):
    from rewriter.cli import main
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    tidal = TidalDecode(calibrate=CALIBRATION, top_k=4, max_read=0.9)
    opt = rewriter.optimize(traced, passes=[tidal])
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert torch.equal(loaded.generate(ROWS, **KW), opt.generate(ROWS, **KW))
    (sel,) = loaded.ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])
    assert [sel.meta["layer"]] == tidal.selection_layers
    assert main(["info", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert f"selection_layers={tidal.selection_layers}" in out and "calibrate=<2 prompts>" in out
    assert str(CALIBRATION[0][:8])[1:-1] not in out  # the ids themselves are not printed


# select_own: a selection layer attends to its own selection too (every key scored, the
# chosen values read); the selection is made before its attention


def test_select_own_feeds_its_layers_attention_and_the_last_layer_may_select():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    p = TidalDecode(selection_layers=[0, 2], top_k=3, select_own=True)
    assert repr(p) == "TidalDecode(selection_layers=[0, 2], top_k=3, recent=0, select_own=True)"
    ir = rewriter.optimize(traced, passes=[p]).ir
    order = {n: i for i, n in enumerate(ir.graph.nodes)}
    attn = {n.meta["layer"]: n for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"])}
    sel = {n.kwargs["layer"]: n for n in ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])}
    assert attn[0].kwargs["select"] is sel[0] and attn[1].kwargs["select"] is sel[0]
    assert attn[2].kwargs["select"] is sel[2]  # the last layer selects for itself
    assert order[sel[0]] < order[attn[0]] and order[sel[2]] < order[attn[2]]
    assert sel[0].args[:2] == (attn[0].args[0], attn[0].args[1])  # its own rotated q and k


@pytest.mark.parametrize("layers,top_k,recent", [([0], 2, 0), ([0, 2], 3, 0), ([1], 2, 3)])
def test_select_own_decode_steps_equal_the_whole_sequence_graph(layers, top_k, recent):
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=layers, top_k=top_k,
                                                        recent=recent, select_own=True)])
    paper = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=layers[:1], top_k=top_k,
                                                          recent=recent)])
    prompts = [[5], [17], [99]]
    got = opt.generate(prompts, max_new_tokens=16, eos_token_id=[])
    for i, row in enumerate(prompts):
        assert torch.equal(got[i], reference_greedy(opt, row, 16))
    # the selection layers no longer attend fully: not the paper's TidalDecode
    assert not torch.equal(got, paper.generate(prompts, max_new_tokens=16, eos_token_id=[]))


def test_select_own_with_top_k_covering_every_token_equals_dense_and_survives_an_artifact(tmp_path):
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    dense = rewriter.optimize(traced).generate(ROWS, **KW)
    every = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0, 2], top_k=128,
                                                          select_own=True)])
    assert torch.equal(every.generate(ROWS, **KW), dense)
    opt = rewriter.optimize(traced, passes=[
        from_spec("tidal_decode:selection_layers=[1],top_k=3,select_own=true"), FuseQKV()])
    got = opt.generate(ROWS, **KW)
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert torch.equal(loaded.generate(ROWS, **KW), got)
    (attn,) = [n for n in loaded.ir.graph.find_nodes(op="call_function", target=OPS["attention"])
               if n.meta["layer"] == 1]
    assert attn.kwargs["select"].kwargs["layer"] == 1  # still its own selection
    opt.static_decode = True
    assert torch.equal(opt.generate(ROWS, **KW), got)


def test_select_own_refusals_and_a_selection_wired_backwards():
    from rewriter.errors import VerificationError
    from rewriter.ir.verify import verify
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="select_own must be True or False"):
            TidalDecode(select_own=bad)
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[1], top_k=3, select_own=True)])
    verify(opt.ir)
    (sel,) = opt.ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])
    # layer 1's q and k scored, but the runtime would read cache 0's keys: refused
    sel.kwargs = {**sel.kwargs, "layer": 0}
    with pytest.raises(VerificationError, match="layer 0's own rotated q and k"):
        verify(opt.ir)
    sel.kwargs = {**sel.kwargs, "layer": 1}
    verify(opt.ir)
    attn = {n.meta["layer"]: n for n in opt.ir.graph.find_nodes(op="call_function", target=OPS["attention"])}
    # a selection before its layer's attention that this attention does not read: refused
    attn[1].kwargs = {**attn[1].kwargs, "select": None}
    with pytest.raises(VerificationError, match="before it when that attention reads it"):
        verify(opt.ir)
    # the paper's selection moved before its own layer's attention: refused
    paper = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[1], top_k=3)])
    (sel,) = paper.ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])
    attn = {n.meta["layer"]: n for n in paper.ir.graph.find_nodes(op="call_function", target=OPS["attention"])}
    attn[1].prepend(sel)
    with pytest.raises(VerificationError, match="after that layer's attention"):
        verify(paper.ir)


def test_a_selection_of_keys_rotated_inside_the_attention_is_refused():
    """After FuseRoPE a layer's q and k are unrotated and its cache holds rotated keys, so a
    selection scoring that q against that cache would rank the wrong keys."""
    from rewriter.errors import VerificationError
    from rewriter.ir.verify import verify
    from rewriter.ops import op_arguments
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[FuseRoPE()])
    attn = {n.meta["layer"]: n for n in opt.ir.graph.find_nodes(op="call_function", target=OPS["attention"])}
    assert attn[1].kwargs.get("cos") is not None
    a = attn[1]
    args = op_arguments("attention", tuple(a.args), dict(a.kwargs))
    with opt.ir.graph.inserting_before(a):
        sel = opt.ir.graph.call_function(OPS["select_tokens"], (args["q"], args["k"]), {
            "layer": 1, "num_heads": args["num_heads"], "num_kv_heads": args["num_kv_heads"],
            "head_dim": args["head_dim"], "top_k": 3})
    a.kwargs = {**a.kwargs, "select": sel}
    with pytest.raises(VerificationError, match="no rotation inside the op"):
        verify(opt.ir)


def test_select_own_ragged_batch_with_a_window_equals_each_row_alone():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0, 2], top_k=3, recent=4,
                                                        select_own=True)])
    rows = [*ROWS, [7]]  # a one-token row: its window reaches into its left padding
    together = opt.generate(rows, **KW)
    for i, row in enumerate(rows):
        assert torch.equal(together[i, -12:], opt.generate([row], **KW)[0, -12:])
    opt.static_decode = True
    assert torch.equal(opt.generate(rows, **KW), together)


@pytest.mark.slow
def test_select_own_triton_backend_equals_torch():
    pytest.importorskip("triton")
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    passes = lambda: [TidalDecode(selection_layers=[0, 2], top_k=3, recent=1, select_own=True),  # noqa: E731
                      FuseQKV()]
    ref = rewriter.optimize(traced, passes=passes())
    tri = rewriter.optimize(traced, passes=passes(), backend="triton")
    kw = dict(max_new_tokens=TRITON_NEW, eos_token_id=[])
    assert torch.equal(tri.generate(ROWS, **kw), ref.generate(ROWS, **kw))


def test_select_own_calibration_lets_the_last_layer_select_for_itself(monkeypatch):
    """With select_own the programme counts a selection layer as every key plus its
    selection's values and its own top-k's kept mass: here the last layer, which keeps
    little of layer 0's choice, selects for itself."""
    import rewriter.measure.attention_recall as recall
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    kept = torch.tensor([[0.8, 0.9, 0.1], [0.0, 0.5, 0.1], [0.0, 0.0, 0.9]])
    monkeypatch.setattr(recall, "kept_mass", lambda rows, top_k, recent: kept)
    sparse = 5 / 48  # top_k 4 + the query, of 48 tokens
    budget = (2 * (1 + sparse) / 2 + sparse) / 3
    tidal = TidalDecode(calibrate=CALIBRATION, top_k=4, max_read=budget, select_own=True)
    opt = rewriter.optimize(traced, passes=[tidal])
    assert tidal.selection_layers == [0, 2]
    assert tidal.report["read"] == pytest.approx(budget)
    assert tidal.report["mean_kept"] == pytest.approx((0.8 + 0.9 + 0.9) / 3)
    same = rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0, 2], top_k=4,
                                                         select_own=True)])
    assert torch.equal(opt.generate(ROWS, **KW), same.generate(ROWS, **KW))
    with pytest.raises(PassError, match="no selection fits"):  # the paper's layers cost more
        rewriter.optimize(traced, passes=[TidalDecode(calibrate=CALIBRATION, top_k=4,
                                                      max_read=(1 + 2 * sparse) / 3 - 0.01)])
