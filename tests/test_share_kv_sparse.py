"""Shared KV caches that are sparse too: a reader keeps its owner's ring (StreamingAttention,
DuoAttention's streaming heads) and selects its own Quest pages from its owner's cache.

Each stack is checked against the IR's whole-sequence graph (``reference_greedy``), which
attends under the ring's mask or the selection with every reader taking its owner's K/V,
no cache at all.
"""
import pytest
import torch

import rewriter
from rewriter.errors import PassError, VerificationError
from rewriter.ir.nodes import attention_args
from rewriter.ir.sharing import attention_by_layer, check_sharing, sources
from rewriter.ops import op_arguments
from rewriter.passes import DuoAttention, Quest, ShareKV, StreamingAttention, TidalDecode
from rewriter.runtime.attention import Step
from rewriter.runtime.kv_cache import KVCache, cache_table
from rewriter.runtime.lower import lower

from conftest import reference_greedy, traced_model

# prompts longer than the rings below: a prompt step overwrites slots its own early
# tokens attend to, which a reader of the ring must still see
ROWS = [[3, 17, 42, 5, 99, 8, 64, 7, 9, 11, 13, 2], [1, 2, 3], [50, 60, 70, 80, 90]]
KW = dict(max_new_tokens=10, eos_token_id=[])
MIXED = [[0.9, 0.1], [0.1, 0.2], [0.2, 0.8]]  # layer 0 split (head 0 full), 1 streams, 2 split


def _trace():
    return traced_model("llama-gqa-3l", initializer_range=0.2)[1]


def _args(ir, layer: int) -> dict:
    return attention_args(attention_by_layer(ir.graph)[layer])


def _equals_the_graph(opt, rows=ROWS, **kw) -> torch.Tensor:
    got = opt.generate(rows, **{**KW, **kw})
    new = kw.get("max_new_tokens", KW["max_new_tokens"])
    for i, row in enumerate(rows):  # ragged: left padding
        assert torch.equal(got[i, -len(row) - new:], reference_greedy(opt, row, new)), i
    return got


@pytest.mark.parametrize("share", [dict(every=2), dict(last=2)])
def test_readers_of_a_ring_see_what_the_graph_sees(share):
    opt = rewriter.optimize(_trace(), passes=[ShareKV(**share), StreamingAttention(sinks=2, window=4)])
    got = _equals_the_graph(opt)
    assert set(cache_table(opt.ir.gm)) == ({0, 2} if "every" in share else {0})
    _equals_the_graph(opt, [list(range(5, 45)), list(range(60, 83))], prefill_chunk=16)
    plain = rewriter.optimize(_trace(), passes=[StreamingAttention(sinks=2, window=4)])
    assert not torch.equal(got, plain.generate(ROWS, **KW))  # the readers do read the owner's


@pytest.mark.parametrize("duo", [False, True])
def test_a_prompt_in_steps_reads_the_ring_as_it_was_before_its_owners_write(duo):
    """A second multi-token step overwrites ring slots its early tokens attend to; the
    reader, which runs after the owner's write, must still see them: every position's
    logits equal the whole-sequence graph's."""
    ring = DuoAttention(MIXED, sinks=2, window=4) if duo else StreamingAttention(sinks=2, window=4)
    opt = rewriter.optimize(_trace(), passes=[ShareKV(last=2), ring])
    program = lower(opt.ir, last_only=False)
    cache = KVCache(cache_table(opt.ir.gm), 1, 32, torch.float32, torch.device("cpu"))
    ids = torch.arange(5, 29)[None]  # [1, 24]
    positions = torch.arange(24)[None]
    with torch.no_grad():
        want = opt(ids)
        got = [program(Step(cache, start, n, None), ids[:, start:start + n],
                       positions[:, start:start + n]) for start, n in ((0, 10), (10, 14))]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-4, atol=1e-5)


def test_a_reader_keeps_its_owners_duo_split():
    """DuoAttention gives layer 2 its owner's split (head 0 full, head 1 in a ring), not the
    one its own gates would choose (head 1 full)."""
    opt = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0}),
                                              DuoAttention(MIXED, sinks=2, window=4)])
    reader, owner = _args(opt.ir, 2), _args(opt.ir, 0)
    assert reader["full_heads"] == owner["full_heads"] == [0] and reader["sinks"] == 2
    assert set(cache_table(opt.ir.gm)) == {0, 1}
    _equals_the_graph(opt)


def test_duo_sparsity_counts_the_heads_of_the_owners():
    opt = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0}),
                                              DuoAttention(MIXED, sinks=2, window=4, sparsity=0.5)])
    # owners 0 and 1 hold 4 KV heads: the 2 lowest gates (0.1, 0.1) stream
    assert _args(opt.ir, 0)["full_heads"] == [0] and _args(opt.ir, 1)["full_heads"] == [1]
    assert _args(opt.ir, 2)["full_heads"] == [0]


def test_a_reader_selects_its_own_pages_from_its_owners_cache():
    opt = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 1}),
                                              Quest(page=2, budget=4, dense_layers=1)])
    select = _args(opt.ir, 2)["select"]
    assert op_arguments("select_pages", tuple(select.args), dict(select.kwargs))["layer"] == 1
    assert select.args[0] is _args(opt.ir, 2)["q"]  # its own queries
    prompts = [[5], [17], [99]]  # one token: every later step is a decode step, which selects
    got = _equals_the_graph(opt, prompts, max_new_tokens=20)
    shared = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 1})])
    assert not torch.equal(got, shared.generate(prompts, max_new_tokens=20, eos_token_id=[]))


def test_a_reader_of_a_dense_owner_stays_dense():
    opt = rewriter.optimize(_trace(), passes=[ShareKV(sources={1: 0}),
                                              Quest(page=2, budget=4, dense_layers=1)])
    assert _args(opt.ir, 0)["select"] is None and _args(opt.ir, 1)["select"] is None
    assert _args(opt.ir, 2)["select"] is not None


def test_token_selections_and_the_wrong_order_are_refused_by_name():
    with pytest.raises(PassError, match="TidalDecode.*cannot follow ShareKV"):
        rewriter.optimize(_trace(), passes=[ShareKV(every=2),
                                            TidalDecode(selection_layers=[0], top_k=4)])
    for first in (Quest(page=2, budget=4, dense_layers=1), DuoAttention(MIXED, sinks=2, window=4)):
        with pytest.raises(PassError, match="must run before StreamingAttention, DuoAttention"):
            rewriter.optimize(_trace(), passes=[first, ShareKV(every=2)])


def test_the_verifier_refuses_a_reader_whose_cache_differs_from_its_owners():
    ring = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0}),
                                               StreamingAttention(sinks=2, window=4)]).ir
    attention_by_layer(ring.graph)[2].update_kwarg("sinks", 3)
    with pytest.raises(VerificationError, match=r"its sinks \(3\) is not the owner's \(2\)"):
        check_sharing(ring)
    with pytest.raises(PassError, match=r"its window \(4\) is not the owner's \(None\)"):
        rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0}),
                                            StreamingAttention(sinks=2, window=4, layers=[2])])
    quest = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 1}),
                                                Quest(page=2, budget=4, dense_layers=1)]).ir
    select = _args(quest, 2)["select"]
    select.update_kwarg("layer", 2)
    with pytest.raises(VerificationError, match="its page selection names cache 2"):
        check_sharing(quest)
    select.update_kwarg("layer", 1)
    select.update_kwarg("page", 4)
    with pytest.raises(VerificationError, match=r"its Quest pages \(4\) are not the owner's \(2\)"):
        check_sharing(quest)
    assert sources(quest.graph) == {2: 1}


def test_the_triton_backend_gives_the_torch_tokens():
    """Under the interpreter: one-token ring steps through the decode kernel, the reader's
    prompt step reading the ring its owner kept for it."""
    pytest.importorskip("triton")
    passes = lambda: [ShareKV(every=2), StreamingAttention(sinks=2, window=4)]  # noqa: E731
    torch_side = rewriter.optimize(_trace(), passes=passes())
    tri = rewriter.optimize(_trace(), passes=passes(), backend="triton")
    assert torch.equal(tri.generate(ROWS[:1], max_new_tokens=4, eos_token_id=[]),
                       torch_side.generate(ROWS[:1], max_new_tokens=4, eos_token_id=[]))


def test_kv_bytes_count_each_shared_ring_once():
    plain = rewriter.optimize(_trace(), passes=[StreamingAttention(sinks=2, window=4)])
    shared = rewriter.optimize(_trace(), passes=[ShareKV(sources={1: 0, 2: 0}),
                                                 StreamingAttention(sinks=2, window=4)])
    assert list(cache_table(shared.ir.gm)) == [0] and len(cache_table(plain.ir.gm)) == 3
    # a ring of 2 + 4 slots and a spare, 2 KV heads of 16, K and V in float32
    assert shared.kv_bytes_per_token(64) * 64 == 7 * 2 * 16 * 2 * 4
    assert plain.kv_bytes_per_token(64) == 3 * shared.kv_bytes_per_token(64)
