"""Quest: each layer reads only the cache pages whose key bounds could score highest.

A one-token prompt has nothing to select, so from it on every step is a decode step and
the runtime (page bounds kept beside the cache, updated as keys are written) must equal
the whole-sequence graph, which selects at every position from exact prefix bounds.
"""
import pytest
import torch

import rewriter
from rewriter.errors import PassError, RewriterError, VerificationError
from rewriter.ops import OPS, REFERENCE
from rewriter.passes import (FuseQKV, FuseRoPE, LayerSkip, Quest, SelfSpeculative,
                             StreamingAttention, TidalDecode, DuoAttention, from_spec)

from conftest import reference_greedy, traced_model

ROWS = [[3, 17, 42, 5, 99, 8, 64, 7, 9, 11, 13, 2], [1, 2, 3], [50, 60, 70, 80, 90]]
KW = dict(max_new_tokens=12, eos_token_id=[])


def _model(config="llama-gqa-3l"):
    """The trace of ``config`` (traced once per process; each pipeline optimizes a copy)."""
    return traced_model(config, initializer_range=0.2)[1]


def test_each_layer_selects_its_own_pages_in_the_ir():
    ir = rewriter.optimize(_model(), passes=[Quest(page=2, budget=4, dense_layers=1)]).ir
    selections = list(ir.graph.find_nodes(op="call_function", target=OPS["select_pages"]))
    assert sorted(n.meta["layer"] for n in selections) == [1, 2]  # layer 0 stays dense
    for n in selections:
        (attn,) = n.users
        assert attn.kwargs["select"] is n and attn.meta["layer"] == n.meta["layer"]
    assert "page=2, budget=4" in str(ir)


def test_the_reference_picks_the_pages_with_the_highest_bound():
    # one KV head, one query head, D=1: q=1 scores each page by its largest key
    k = torch.tensor([0.0, 5.0, 1.0, 1.0, 9.0, -3.0, 0.5, 0.0]).view(1, 8, 1)
    q = torch.ones(1, 8, 1)
    sel = REFERENCE["select_pages"](q, k, 0, 1, 1, 1, 2, 4)[0, 0]  # pages of 2, 2 pages
    assert sel[7].tolist() == [4, 5, 0, 1]  # pages {4,5} (max 9) and {0,1} (max 5)
    assert sel[5].tolist() == [4, -1, 0, 1]  # query 5: of page {4,5} only 4 is earlier
    assert sel[1].tolist() == [0, -1, -1, -1]
    q = -torch.ones(1, 8, 1)  # q=-1: a page's bound is minus its smallest key
    assert sel.shape == (8, 4)
    assert REFERENCE["select_pages"](q, k, 0, 1, 1, 1, 2, 2)[0, 0, 7].tolist() == [4, 5]


@pytest.mark.parametrize("config", ["llama-gqa-3l", "qwen2-hd20-2l"])
def test_a_budget_covering_every_token_equals_dense(config):
    traced = _model(config)
    dense = rewriter.optimize(traced)
    quest = rewriter.optimize(traced, passes=[Quest(page=4, budget=128, dense_layers=0)])  # the context
    assert torch.equal(quest.generate(ROWS, **KW), dense.generate(ROWS, **KW))


def test_recent_keeps_the_last_tokens_and_pages_come_from_before_them():
    k = torch.tensor([0.0, 5.0, 1.0, 1.0, 9.0, -3.0, 0.5, 0.0]).view(1, 8, 1)
    q = torch.ones(1, 8, 1)
    sel = REFERENCE["select_pages"](q, k, 0, 1, 1, 1, 2, 2, 3)[0, 0]  # one page + 3 recent
    assert sel.shape == (8, 5)
    # query 7: tokens 4-6 are recent; of the pages holding a key before 4 ({0,1} max 5,
    # {2,3} max 1) the best gives its keys before 4; page {4,5} (max 9) is not a candidate
    assert sel[7].tolist() == [0, 1, 4, 5, 6]
    assert sel[6].tolist() == [0, 1, 3, 4, 5]  # {0,1} (max 5) beats {2,3} (max 1)
    assert sel[4].tolist() == [0, -1, 1, 2, 3]  # page {0,1} gives only its key before 1
    assert sel[2].tolist() == [-1, -1, -1, 0, 1]  # nothing before the window
    assert sel[0].tolist() == [-1] * 5


@pytest.mark.parametrize("page,budget,dense_layers,recent",
                         [(2, 4, 1, 0), (3, 3, 0, 0), (4, 8, 2, 0), (2, 2, 0, 3), (4, 4, 1, 5)])
def test_decode_steps_equal_the_whole_sequence_graph(page, budget, dense_layers, recent):
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[Quest(page=page, budget=budget,
                                                  dense_layers=dense_layers, recent=recent)])
    prompts = [[5], [17], [99]]  # one token: every later step is a decode step
    got = opt.generate(prompts, max_new_tokens=20, eos_token_id=[])
    for i, row in enumerate(prompts):
        assert torch.equal(got[i], reference_greedy(opt, row, 20))
    dense = rewriter.optimize(traced).generate(prompts, max_new_tokens=20, eos_token_id=[])
    assert not torch.equal(got, dense)


@pytest.mark.parametrize("recent", [0, 4])
def test_a_ragged_batch_equals_each_row_alone_and_static_steps_agree(recent):
    # a one-token row: its local window reaches into its left padding, which it must not see
    opt = rewriter.optimize(_model(), passes=[Quest(page=2, budget=4, dense_layers=1, recent=recent)])
    rows = [*ROWS, [7]]
    together = opt.generate(rows, **KW)
    for i, row in enumerate(rows):
        assert torch.equal(together[i, -12:], opt.generate([row], **KW)[0, -12:])
    assert not torch.equal(together, rewriter.optimize(_model()).generate(rows, **KW))
    opt.static_decode = True
    assert torch.equal(opt.generate(rows, **KW), together)


def test_a_reused_cache_keeps_no_bounds_of_the_request_before():
    # decode steps fold their key into their page's bounds; a page opened by a later
    # request must not keep an earlier request's keys
    passes = lambda: [Quest(page=2, budget=2, dense_layers=0)]  # noqa: E731
    used = rewriter.optimize(_model(), passes=passes())
    used.generate([ROWS[0]], max_new_tokens=20, eos_token_id=[])
    fresh = rewriter.optimize(_model(), passes=passes())
    assert torch.equal(used.generate([[5]], **KW), fresh.generate([[5]], **KW))


def test_a_budget_past_the_cache_reads_no_more_than_the_cache():
    # the whole context (128 tokens; more is refused), past the cache of 12 + 12 tokens
    opt = rewriter.optimize(_model(), passes=[Quest(page=4, budget=128, dense_layers=1)])
    seen = []
    import rewriter.runtime.page_selection as ps
    original = ps.pages_to_tokens
    ps.pages_to_tokens = lambda *a: seen.append(a[3]) or original(*a)
    try:
        got = opt.generate([ROWS[0]], **KW)
    finally:
        ps.pages_to_tokens = original
    assert seen and max(seen) <= len(ROWS[0]) + KW["max_new_tokens"]  # what is written
    assert torch.equal(got, rewriter.optimize(_model()).generate([ROWS[0]], **KW))


def test_a_window_past_the_cache_reads_the_cache_and_equals_dense():
    # recent is capped at the positions a step can see, not allocated as asked
    opt = rewriter.optimize(_model(), passes=[Quest(page=4, budget=4, dense_layers=0, recent=124)])
    assert torch.equal(opt.generate(ROWS, **KW), rewriter.optimize(_model()).generate(ROWS, **KW))


def test_the_bounds_follow_the_cache_and_count_as_memory():
    opt = rewriter.optimize(_model(), passes=[Quest(page=4, budget=8, dense_layers=1)])
    opt.generate([ROWS[0]], max_new_tokens=3, eos_token_id=[])  # 14 tokens written, 15 seen
    cache = opt._cache
    high, low = cache.bounds[1]
    keys = cache.k[1][0, :, :14]  # [Hkv, 14, D]: the tokens written so far
    torch.testing.assert_close(high[0, :, 1], keys[:, 4:8].amax(1))
    torch.testing.assert_close(low[0, :, 3], keys[:, 12:14].amin(1))  # a partial page
    assert set(cache.bounds) == {1, 2}
    k_bytes = sum(t.numel() * t.element_size() for t in [*cache.k.values(), *cache.v.values()])
    assert cache.nbytes == k_bytes + 4 * high.numel() * high.element_size()
    # what kv_bytes_per_token reports is what the cache allocates, bounds included
    assert opt.kv_bytes_per_token(cache.max_len) == cache.nbytes // cache.max_len


def test_artifact_round_trip_and_the_command_line(tmp_path):
    opt = rewriter.optimize(_model(), passes=[from_spec("quest:page=2,budget=4,dense_layers=1"),
                                              FuseQKV(), FuseRoPE()])
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert torch.equal(loaded.generate(ROWS, **KW), opt.generate(ROWS, **KW))
    selections = loaded.ir.graph.find_nodes(op="call_function", target=OPS["select_pages"])
    assert sorted(n.meta["layer"] for n in selections) == [1, 2]
    got = loaded.generate([[5]], max_new_tokens=12, eos_token_id=[])
    assert torch.equal(got[0], reference_greedy(loaded, [5], 12))


@pytest.mark.parametrize("recent,rope", [(0, False), (3, True)])
def test_the_triton_backend_equals_torch(recent, rope):
    # decode steps pass the kernel the selected positions (FuseRoPE fuses only the dense
    # layer: a Quest layer's q and k have a second user, its page selection)
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    passes = lambda: [Quest(page=2, budget=4, dense_layers=1, recent=recent), FuseQKV(),  # noqa: E731
                      *([FuseRoPE()] if rope else [])]
    ref = rewriter.optimize(traced, passes=passes())
    tri = rewriter.optimize(traced, passes=passes(), backend="triton")
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert torch.equal(tri.generate(ROWS, **kw), ref.generate(ROWS, **kw))


def test_conflicts_are_refused_by_name():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)  # one trace for every pipeline below
    # Quest first: a budget within the context (the default 256 is past this model's 128)
    with pytest.raises(PassError, match="before FuseRoPE"):
        rewriter.optimize(traced, passes=[FuseRoPE(), Quest()])
    with pytest.raises(PassError, match="already limits"):
        rewriter.optimize(traced, passes=[StreamingAttention(window=8), Quest(dense_layers=0)])
    with pytest.raises(PassError, match="TidalDecode"):
        rewriter.optimize(traced, passes=[TidalDecode(selection_layers=[0]), Quest()])
    with pytest.raises(PassError, match="already limits"):
        rewriter.optimize(traced, passes=[Quest(budget=64, dense_layers=1), TidalDecode(selection_layers=[0])])
    with pytest.raises(PassError, match="Quest"):
        rewriter.optimize(traced, passes=[Quest(budget=64, dense_layers=1), StreamingAttention()])
    with pytest.raises(PassError, match="Quest"):
        rewriter.optimize(traced, passes=[Quest(budget=64, dense_layers=1),
                                         DuoAttention([[0.9, 0.1]] * 3, sinks=1, window=2)])
    with pytest.raises(PassError, match="speculative"):
        rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1]), Quest()])
    with pytest.raises(RewriterError, match="Quest"):
        rewriter.optimize(traced, passes=[Quest(budget=64, dense_layers=1), SelfSpeculative(skip_layers=[1])])
    with pytest.raises(PassError, match="nothing would select"):
        rewriter.optimize(traced, passes=[Quest(dense_layers=3)])


@pytest.mark.parametrize("kwargs,match", [({"page": 0}, "page"), ({"budget": 3, "page": 4}, "budget"),
                                          ({"dense_layers": -1}, "dense_layers"),
                                          ({"page": 2.5}, "page"), ({"recent": -1}, "recent"),
                                          ({"recent": True}, "recent"), ({"recent": 2**31}, "recent")])
def test_bad_parameters_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Quest(**kwargs)


def test_layer_skip_after_quest_drops_whole_layers():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[Quest(page=2, budget=4, dense_layers=0),
                                            LayerSkip(layers=[1])])
    layers = sorted(n.meta["layer"] for n in
                    opt.ir.graph.find_nodes(op="call_function", target=OPS["select_pages"]))
    assert layers == [0, 2]
    got = opt.generate([[5]], max_new_tokens=12, eos_token_id=[])
    assert torch.equal(got[0], reference_greedy(opt, [5], 12))


def test_a_selection_wired_to_another_layer_is_refused_when_verified():
    from rewriter.ir.verify import verify
    ir = rewriter.optimize(_model(), passes=[Quest(page=2, budget=4, dense_layers=1)]).ir
    a, b = ir.graph.find_nodes(op="call_function", target=OPS["select_pages"])
    (attn_b,) = b.users
    attn_b.kwargs = {**attn_b.kwargs, "select": a}  # layer 2 reading layer 1's pages
    with pytest.raises(VerificationError, match="own rotated q and k"):
        verify(ir)
