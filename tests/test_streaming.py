"""StreamingAttention: sink + window caches kept in a ring of ``sinks + window`` slots.

The ring runtime is checked against the IR's whole-sequence graph, which attends under the
equivalent mask (causal, the last ``window`` keys and the first ``sinks``) with no cache at
all; and against dense attention where the window covers everything.
Regenerate the golden text with ``REWRITER_UPDATE_GOLDEN=1 pytest tests/test_streaming.py``.
"""
import os
from pathlib import Path

import pytest
import torch

import rewriter
from rewriter.errors import PassError, RewriterError
from rewriter.ops import OPS
from rewriter.passes import FuseQKV, FuseRoPE, MedusaHeads, SelfSpeculative, StreamingAttention
from rewriter.passes import from_spec
from rewriter.runtime.kv_cache import cache_table
from rewriter.ops import sink_attention
from rewriter.runtime.ring_cache import (_step_mask, sink_layout, sink_sdpa, slot_contents,
                                         visible)

from conftest import reference_greedy, traced_model

GOLDEN = Path(__file__).parent / "golden"
ROWS = [[3, 17, 42, 5, 99, 8, 64, 7, 9, 11, 13, 2], [1, 2, 3], [50, 60, 70, 80, 90]]
KW = dict(max_new_tokens=14, eos_token_id=[])


def test_the_ir_shows_sinks_and_window_on_every_attention():
    _, traced = traced_model("llama-gqa-3l", num_hidden_layers=1)
    after = str(rewriter.optimize(traced, passes=[StreamingAttention(sinks=4, window=8)]).ir)
    text = f"### after StreamingAttention(sinks=4, window=8)\n{after}\n"
    path = GOLDEN / "streaming_attention.txt"
    if os.environ.get("REWRITER_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()
    assert "window=8, sinks=4" in after


@pytest.mark.parametrize("config", ["llama-gqa-3l", "mistral-window-3l", "qwen2-hd20-2l"])
def test_a_window_covering_the_sequence_equals_dense_attention(config):
    _, traced = traced_model(config, initializer_range=0.2)
    dense = rewriter.optimize(traced)
    # sinks=0: a native sliding window (Mistral) stays exactly what it was; sinks + window
    # the whole context (128), the most it may be
    wide = rewriter.optimize(traced, passes=[StreamingAttention(sinks=0, window=128)])
    assert torch.equal(wide.generate(ROWS, **KW), dense.generate(ROWS, **KW))
    if config != "mistral-window-3l":  # sinks inside a window that covers everything
        wide = rewriter.optimize(traced, passes=[StreamingAttention(sinks=4, window=124)])
        assert torch.equal(wide.generate(ROWS, **KW), dense.generate(ROWS, **KW))


@pytest.mark.parametrize("config,sinks,window", [("llama-gqa-3l", 2, 4), ("llama-gqa-3l", 0, 3),
                                                 ("qwen2-hd20-2l", 4, 5), ("mistral-window-3l", 1, 6)])
def test_the_ring_equals_the_masked_whole_sequence_graph(config, sinks, window):
    _, traced = traced_model(config, initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=sinks, window=window)])
    dense = rewriter.optimize(traced)
    got = opt.generate(ROWS, **KW)
    for i, row in enumerate(ROWS):  # ragged: left padding; each row's sinks are its own
        assert torch.equal(got[i, -len(row) - 14:], reference_greedy(opt, row, 14)), i
    assert not torch.equal(got, dense.generate(ROWS, **KW))  # the window does cut attention


def test_the_ring_is_bounded_and_generation_runs_past_the_context_length():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2, max_position_embeddings=32)
    dense = rewriter.optimize(traced)
    with pytest.raises(ValueError, match="context length"):
        dense.generate([ROWS[0]], max_new_tokens=40)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=6)])
    got = opt.generate([ROWS[0]], max_new_tokens=40, eos_token_id=[])
    assert got.shape[1] == len(ROWS[0]) + 40 > 32
    assert torch.equal(got[0], reference_greedy(opt, ROWS[0], 40))
    cache = opt._cache
    assert all(k.shape[2] == 2 + 6 + 1 for k in cache.k.values())  # sinks + window + spare
    assert opt.kv_bytes_per_token(1000) == cache.nbytes // 1000  # what is allocated (batch 1)
    assert opt.kv_bytes_per_token(1000) < dense.kv_bytes_per_token(1000) / 100


def test_learned_positions_still_end_at_the_context_length():
    _, traced = traced_model("gpt2-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=1, window=4)])
    with pytest.raises(ValueError, match="context length"):
        opt.generate([[1, 2, 3]], max_new_tokens=opt.max_len, eos_token_id=[])


def test_static_decode_steps_give_the_same_tokens():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=5)])
    want = opt.generate(ROWS, **KW)
    opt.static_decode = True  # device-side positions, as a CUDA-graph step runs
    assert torch.equal(opt.generate(ROWS, **KW), want)


def test_slot_contents_follow_the_ring():
    # sinks 2, window 3: tokens 0 1 | 2 3 4 | then 5 overwrites 2, 6 overwrites 3
    got = slot_contents(torch.tensor([0, 1, 2, 4, 5, 6, 7]), 2, 3).tolist()
    assert got == [[-1, -1, -1, -1, -1], [0, -1, -1, -1, -1], [0, 1, -1, -1, -1],
                   [0, 1, 2, 3, -1], [0, 1, 2, 3, 4], [0, 1, 5, 3, 4], [0, 1, 5, 6, 4]]


def ring_step_inputs(first: list[int], s: int, sinks: int, window: int, size: int):
    """``(r_new, held, mask)`` as ``ring_attention`` builds them for a step of ``s`` tokens
    whose rows start at real index ``first``, over a ring of ``size`` slots."""
    first = torch.tensor(first)
    r_new = first[:, None] + torch.arange(s)  # [B, S]
    if s == 1:  # written first, then read with the ring
        held = slot_contents(first + 1, sinks, window, size)  # [B, C]
        return r_new, held, visible(r_new, held, window, sinks)[:, None]
    held = torch.cat([slot_contents(first, sinks, window, size), r_new], dim=1)  # [B, C + S]
    return r_new, held, _step_mask(first, r_new, sinks, window, size)


@pytest.mark.parametrize("s, first", [(20, [0, 0]), (20, [-5, 30]), (20, [-40, 1]), (2, [0, 1]),
                                      (1, [3, 100]), (1, [0, 1])])
@pytest.mark.parametrize("heads, size", [((4, 2), 9), ((3, 3), 9), ((6, 2), 7), ((4, 2), 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ring_step_with_sinks_is_the_reference_sink_attention(s, first, heads, size, dtype):
    # the one SDPA call a ring step makes (sink scores carried as extra query features)
    # against the reference's explicit scores in float32: rows still writing their
    # padding, rows whose sinks are not all written yet (first 0 or 1 with 3 sinks), rows
    # far past a full ring, one-token steps, rings shorter than sinks + window and than
    # the sinks; GQA and not; partial rotary (12 of 16 features)
    torch.manual_seed(0)
    (hq, hkv), sinks, window, d = heads, 3, 6, 16
    r_new, held, mask = ring_step_inputs(first, s, sinks, window, size)
    q = torch.randn(2, hq, s, d)
    k, v = torch.randn(2, hkv, held.shape[1], d), torch.randn(2, hkv, held.shape[1], d)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 12, 2).float() / 12)
    is_sink = ((held >= 0) & (held < sinks))[:, None, None]
    shift = (r_new - (sinks + window - 1)).clamp(min=0)
    g = hq // hkv
    want = sink_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask, 0.3,
                          is_sink, shift, inv_freq, d)
    lay = sink_layout(held, r_new, sinks, window, inv_freq, dtype, d)
    got = sink_sdpa(q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.3, lay, d).float()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=4e-2)
    torch.testing.assert_close(got, want, **tol)
    plain = sink_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask, 0.3,
                           is_sink, torch.zeros_like(shift), inv_freq, d)
    seen = mask & is_sink  # [B, 1, S, K]: a query scoring a sink it sees
    moved = bool(((shift > 0)[:, None, :, None] & seen).any())  # the sinks' positions matter
    if moved and dtype == torch.float32:  # in bfloat16 rounding alone differs
        assert not torch.allclose(got, plain, rtol=1e-3, atol=1e-3)


def test_a_sink_score_a_query_cannot_see_does_not_spoil_its_row():
    # sinks 0..2, a step of two tokens. Row 0: its first query sees neither sink 1 (the last
    # column, the step's next token) nor sink 2 (not written; its stand-in is that column).
    # Row 1: its first query is padding and sees only itself, not sink 0 (the last column).
    # In float16 the sink scores with that key overflow (a float16 product; SDPA scores in
    # float32): they must not reach the queries that do not see those sinks
    r_new, held, mask = ring_step_inputs([0, -1], 2, 3, 6, 9)
    k = torch.ones(2, 1, held.shape[1], 8, dtype=torch.float16)
    k[:, :, -1] = 3e4
    lay = sink_layout(held, r_new, 3, 6, torch.zeros(4), torch.float16, 8)
    q = torch.ones(2, 1, 2, 8, dtype=torch.float16)
    v = torch.randn(2, 1, held.shape[1], 8).half()
    out = sink_sdpa(q, k, v, mask, 1.0, lay, 8)  # [B, H, S, D]
    # each first query sees one key, its own (column 9 of 9 ring slots + 2 new): its value
    assert bool(mask[:, 0, 0].sum(-1).eq(1).all()) and bool(mask[:, 0, 0, 9].all())
    torch.testing.assert_close(out[:, :, 0], v[:, :, 9], rtol=0, atol=1e-3)


def test_the_ring_holds_exactly_the_sinks_and_the_window():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=3)])
    dense = rewriter.optimize(traced)
    row = ROWS[0]  # 12 tokens: the ring keeps 0, 1 and 9, 10, 11 (token r in 2 + (r - 2) % 3)
    opt.generate([row], max_new_tokens=1, eos_token_id=[])
    dense.generate([row], max_new_tokens=1, eos_token_id=[])
    # layer 0's keys do not depend on attention, so the dense cache holds the same ones
    ring, full = opt._cache.k[0][0], dense._cache.k[0][0]  # [Hkv, slots, D]
    for slot, token in [(0, 0), (1, 1), (2, 11), (3, 9), (4, 10)]:
        torch.testing.assert_close(ring[:, slot], full[:, token], rtol=1e-5, atol=1e-6)


def test_artifact_round_trip(tmp_path):
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=4), FuseQKV(), FuseRoPE()])
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert torch.equal(loaded.generate(ROWS, **KW), opt.generate(ROWS, **KW))
    assert {s.sinks for s in cache_table(loaded.ir.gm).values()} == {2}


def test_speculative_strategies_are_refused_with_a_ring():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    with pytest.raises(PassError, match="speculative"):
        rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1]), StreamingAttention()])
    with pytest.raises(RewriterError, match="sink \\+ window"):
        rewriter.optimize(traced, passes=[StreamingAttention(window=8), SelfSpeculative(skip_layers=[1])])
    with pytest.raises(RewriterError, match="sink \\+ window"):
        rewriter.optimize(traced, passes=[StreamingAttention(window=8), MedusaHeads(num_heads=2)])


@pytest.mark.parametrize("kwargs,match", [({"sinks": -1}, "sinks"), ({"window": 0}, "window"),
                                          ({"window": 2.5}, "window"), ({"sinks": True}, "sinks"),
                                          ({"layers": []}, "layers"), ({"layers": "0"}, "layers")])
def test_bad_parameters_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamingAttention(**kwargs)


def test_layers_and_the_command_line_spec():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[from_spec("streaming_attention:sinks=1,window=4,layers=[0,2]")])
    table = cache_table(opt.ir.gm)
    assert [table[i].ring for i in sorted(table)] == [True, False, True]
    with pytest.raises(PassError, match="cache 7"):
        rewriter.optimize(traced, passes=[StreamingAttention(layers=[7])])
    got = opt.generate(ROWS, **KW)
    for i, row in enumerate(ROWS):
        assert torch.equal(got[i, -len(row) - 14:], reference_greedy(opt, row, 14))


def test_a_sinks_attribute_without_a_window_is_refused_when_verified():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced)  # its IR is a copy: changing it leaves the trace alone
    node = next(iter(opt.ir.gm.graph.find_nodes(op="call_function", target=OPS["attention"])))
    node.kwargs = {**node.kwargs, "sinks": 2}  # the model has no window
    from rewriter.ir.verify import verify
    with pytest.raises(Exception, match="needs a window"):
        verify(opt.ir)


@pytest.mark.slow
def test_triton_backend_equals_torch(monkeypatch):
    pytest.importorskip("triton")
    from rewriter.runtime import triton_attention
    kernel, sink_queries = triton_attention.decode_attention, []

    def counted(*args, **kw):  # a ring's decode step: the kernel, with the rotated-back query
        sink_queries.append(kw.get("q_sink") is not None)
        return kernel(*args, **kw)

    monkeypatch.setattr(triton_attention, "decode_attention", counted)
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    passes = lambda: [StreamingAttention(sinks=2, window=4), FuseQKV(), FuseRoPE()]  # noqa: E731
    ref = rewriter.optimize(traced, passes=passes())
    tri = rewriter.optimize(traced, passes=passes(), backend="triton")
    kw = dict(max_new_tokens=8, eos_token_id=[])
    assert torch.equal(tri.generate(ROWS, **kw), ref.generate(ROWS, **kw))
    assert len(sink_queries) == 3 * 7 and all(sink_queries)  # 3 layers x 7 decode steps


@pytest.mark.parametrize("fused", [False, True])
def test_cache_positions_make_the_output_independent_of_how_far_the_sinks_lie(fused):
    # The last token's receptive field (window x layers) lies inside the filler in both
    # prompts, so only the distance to the sinks differs between them: StreamingLLM's
    # positions put the sinks just before the window either way.
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    near = [1, 2] + [5] * 12 + [7, 8, 9, 10]
    far = [1, 2] + [5] * 40 + [7, 8, 9, 10]
    fusions = [FuseQKV(), FuseRoPE()] if fused else []
    cache = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=4), *fusions])
    original = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=4,
                                                                    positions="original"), *fusions])
    last = lambda opt, row: opt(torch.tensor([row]))[0, -1]  # noqa: E731
    torch.testing.assert_close(last(cache, near), last(cache, far), rtol=1e-4, atol=1e-5)
    assert (last(original, near) - last(original, far)).abs().max() > 1e-3
    kw = dict(max_new_tokens=6, eos_token_id=[])  # the ring runtime agrees
    assert torch.equal(cache.generate([near], **kw)[0, -6:], cache.generate([far], **kw)[0, -6:])
    assert torch.equal(cache.generate([far], **kw)[0], reference_greedy(cache, far, 6))


def test_a_ring_never_allocates_more_than_the_sequence_needs():
    # a context of 128 positions: the config's own
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=4, window=124)])  # > 32 tokens
    dense = rewriter.optimize(traced)
    kw = dict(max_new_tokens=20, eos_token_id=[])
    assert torch.equal(opt.generate(ROWS, **kw), dense.generate(ROWS, **kw))
    assert opt._cache.nbytes == dense._cache.nbytes * 129 // 128  # 128 slots and the spare
    # past the context: refused by name, not allocated (tests/test_runtime_bounds.py)
    with pytest.raises(ValueError, match=r"sinks \+ window = 1 \+ 2147483647 = .* context length, 128"):
        rewriter.optimize(traced, passes=[StreamingAttention(sinks=1, window=2**31 - 1)])


def test_scores_through_the_ring_equal_the_masked_graph():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=5)])
    ids = torch.tensor([[3, 17, 42, 5, 99, 8, 64, 7, 9, 11, 13, 2, 4, 6, 8, 10]])
    want = opt(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[:, 5:, 0]  # [1, 10]
    torch.testing.assert_close(opt.score(ids, 6), want, rtol=1e-4, atol=1e-5)


def test_only_streaming_positions_may_outgrow_the_context():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2, max_position_embeddings=32)
    opt = rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=6, positions="original")])
    with pytest.raises(ValueError, match="context length"):
        opt.generate([ROWS[0]], max_new_tokens=40, eos_token_id=[])
