"""MiniCache: adjacent layers' caches merged by SLERP into one direction per token and KV
head, each layer's magnitudes apart, the most distinct tokens retained; checked against
the model (a setting that keeps every token) and against the paper's formulas written
out here."""
import math

import pytest
import torch

import rewriter
from rewriter.errors import PassError, RewriterError, VerificationError
from rewriter.ir.merging import check_merging, merged_pairs
from rewriter.passes import FuseRoPE, Int4Weights, LayerSkip, MiniCache, SelfSpeculative, ShareKV
from rewriter.passes import StreamingAttention, from_spec, to_spec
from rewriter.ops import OPS, op_arguments
from rewriter.runtime.attention import Step
from rewriter.runtime.kv_cache import CacheSpec, KVCache, cache_table, describe
from rewriter.runtime.merged_cache import merged_attention, restore

from artifact_tools import saved_and_loaded
from conftest import traced_model, varied_init

NAME = "llama-gqa-3l"
IDS = torch.tensor([[5, 9, 14, 2, 7, 30, 11, 4], [3, 3, 8, 1, 60, 12, 9, 2]])
KEEP_ALL = dict(gamma=1, retain=1)  # every token retained: the model's own attention


def _trace(name: str = NAME):
    return traced_model(name, initializer_range=varied_init(name))[1]


def _attention(ir, layer: int):
    return next(n for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"])
                if op_arguments("attention", tuple(n.args), dict(n.kwargs))["layer"] == layer)


@pytest.mark.parametrize("name, first", [(NAME, []), ("qwen2-mqa-3l", []),
                                         ("mistral-window-3l", []), (NAME, [FuseRoPE()]),
                                         (NAME, [Int4Weights(group_size=32)])])
def test_keeping_every_token_is_the_model(name, first):
    """gamma=1, retain=1: each token's own K/V from the side buffer; greedy tokens equal,
    log-probabilities within float tolerance (a ragged batch too); the paper's default
    changes them (so the comparison can fail)."""
    plain = rewriter.optimize(_trace(name), passes=[*first])
    keep = rewriter.optimize(_trace(name), passes=[*first, MiniCache(**KEEP_ALL)])
    assert merged_pairs(keep.ir.graph) == {1: 2}
    assert torch.equal(keep.generate(IDS, max_new_tokens=10), plain.generate(IDS, max_new_tokens=10))
    ragged = [[5, 9, 14], [3, 3, 8, 1, 60, 12, 9, 2]]
    assert torch.equal(keep.generate(ragged, max_new_tokens=6), plain.generate(ragged, max_new_tokens=6))
    long = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(keep.generate(long, max_new_tokens=4, prefill_chunk=16),  # 3 prompt steps
                       plain.generate(long, max_new_tokens=4, prefill_chunk=16))
    want = plain.score(long, 10)
    assert torch.allclose(keep.score(long, 10), want, atol=1e-4, rtol=1e-4)
    store = keep._cache.merged[1]
    assert (store["retained"] == 39).all()  # the last token is scored, not fed
    assert (store["overflow"] == 0).all()
    lossy = rewriter.optimize(_trace(name), passes=[*first, MiniCache()])
    assert not torch.allclose(lossy.score(long, 10), want, atol=1e-3)


def _slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """The paper's equation in float64: e = sin((1-t)W)/sin W a + sin(tW)/sin W b."""
    omega = torch.arccos((a * b).sum(-1, keepdim=True).clamp(-1, 1))
    return (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)


def _angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return torch.arccos(cos.clamp(-1, 1)) / math.pi  # [...] in [0, 1]


def _pair(t=0.5, gamma=0.25, retain=0.25, heads=2, dim=8, max_len=32):
    specs = [CacheSpec(id=0, num_heads=heads, num_kv_heads=heads, head_dim=dim, scale=0.3,
                       causal=True, window=None, merge=(t, gamma, retain), second=s)
             for s in (False, True)]
    return specs, KVCache({0: specs[0]}, 2, max_len, torch.float32, torch.device("cpu"))


def _run_pair(specs, cache, start, kv):
    """One step of both layers over ``kv`` (``[(k, v)] * 2``, ``[B, S, H*D]`` each)."""
    s = kv[0][0].shape[1]
    step = Step(cache, start, s, None)
    q = torch.randn(2, s, specs[0].num_heads * specs[0].head_dim)
    attend = lambda step, q, keys, values, spec: keys.new_zeros(q.shape)  # noqa: E731
    for spec, (k, v) in zip(specs, kv):
        merged_attention(step, q, k, v, spec, None, None, attend)


def test_the_cache_holds_the_papers_merge_and_restores_by_its_formula():
    """Random K/V through both layers of a pair: stored directions are SLERP's (float64,
    written out above), magnitudes each layer's norms, the retained tokens those at or
    above gamma * d_min + (1 - gamma) * d_max of the running range, restored as they were;
    a decode step extends the range."""
    torch.manual_seed(0)
    t, gamma, heads, dim = 0.3, 0.25, 2, 8
    specs, cache = _pair(t, gamma, retain=0.5, heads=heads, dim=dim)
    kv = [(torch.randn(2, 6, heads * dim), torch.randn(2, 6, heads * dim)) for _ in range(2)]
    _run_pair(specs, cache, 0, kv)
    step2 = [(torch.randn(2, 1, heads * dim), torch.randn(2, 1, heads * dim)) for _ in range(2)]
    _run_pair(specs, cache, 6, step2)
    split = lambda x: x.double().view(2, -1, heads, dim).transpose(1, 2)  # noqa: E731 [B, H, S, D]
    (k1, v1), (k2, v2) = [(split(torch.cat([a[0], b[0]], 1)), split(torch.cat([a[1], b[1]], 1)))
                          for a, b in zip(kv, step2)]
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    assert torch.allclose(cache.k[0][:, :, :7].double(), _slerp(unit(k1), unit(k2), t), atol=1e-5)
    assert torch.allclose(cache.v[0][:, :, :7].double(), _slerp(unit(v1), unit(v2), t), atol=1e-5)
    mags = cache.merged[0]["magnitude"][:, :, :7].double()
    for i, x in enumerate((k1, v1, k2, v2)):
        assert torch.allclose(mags[..., i], x.norm(dim=-1), rtol=1e-5)
    d = torch.maximum(_angle(k1, k2), _angle(v1, v2))  # [B, H, 7]
    want = set()
    for b in range(2):
        for h in range(heads):
            first = d[b, h, :6]  # the prompt's range, then the decode token's
            cut = gamma * first.min() + (1 - gamma) * first.max()
            want |= {(b, h, j) for j in range(6) if first[j] >= cut - 1e-6}
            cut = gamma * d[b, h].min() + (1 - gamma) * d[b, h].max()
            want |= {(b, h, 6)} if d[b, h, 6] >= cut - 1e-6 else set()
    at = cache.merged[0]["side_at"]
    assert {(b, h, int(at[b, h, c])) for b, h, c in (at >= 0).nonzero().tolist()} == want
    for spec, (k, v) in zip(specs, ((k1, v1), (k2, v2))):
        keys, values = restore(cache, spec, 7)
        kept = torch.zeros(2, heads, 7, dtype=torch.bool)
        for b, h, j in want:
            kept[b, h, j] = True
        direction = _slerp(unit(k1), unit(k2), t)
        assert torch.allclose(keys.double()[~kept], (direction * k.norm(dim=-1, keepdim=True))[~kept],
                              atol=1e-5)
        assert torch.equal(keys.double()[kept], k[kept]) and torch.equal(values.double()[kept], v[kept])


def test_a_full_side_buffer_merges_the_rest_and_counts_them():
    """A row retains at most ceil(retain * its tokens so far) (the buffer holds that share of
    the allocated length): the first retained tokens (in position order) take the slots, the
    others merge and ``overflow`` counts them; a step that starts earlier forgets what was
    retained from there on."""
    torch.manual_seed(1)
    specs, cache = _pair(gamma=1.0, retain=0.25, max_len=32)  # every token wants a slot
    kv = [(torch.randn(2, 16, 16), torch.randn(2, 16, 16)) for _ in range(2)]
    _run_pair(specs, cache, 0, [(k[:, :10], v[:, :10]) for k, v in kv])  # 10 tokens: 3 fit
    store = cache.merged[0]
    assert (store["retained"] == 3).all() and (store["overflow"] == 7).all()
    assert (store["side_at"][..., :3] == torch.arange(3)).all()
    _run_pair(specs, cache, 2, [(k[:, :14], v[:, :14]) for k, v in kv])  # from 2, 16 tokens: 4
    assert (store["side_at"][..., :4] == torch.arange(4)).all()
    assert (store["retained"] == 4).all() and (store["overflow"] == 7 + 12).all()


def test_the_tokens_do_not_depend_on_the_cache_a_call_finds():
    """A longer request allocates a longer cache (and side buffer), which the next call
    reuses: retention is bounded by each row's own tokens, so the same call gives the same
    tokens on either cache."""
    fresh = rewriter.optimize(_trace(), passes=[MiniCache(gamma=1, retain=0.05)])
    reused = rewriter.optimize(_trace(), passes=[MiniCache(gamma=1, retain=0.05)])
    reused.generate(IDS, max_new_tokens=120, eos_token_id=[])  # a longer cache, kept
    want = fresh.generate(IDS, max_new_tokens=40, eos_token_id=[])
    assert torch.equal(reused.generate(IDS, max_new_tokens=40, eos_token_id=[]), want)


def test_a_step_started_on_the_device_is_refused():
    """A CUDA-graph step's start is read on the device only; the merged cache's side
    buffer needs it on the host."""
    specs, cache = _pair()
    kv = [(torch.randn(2, 1, 16), torch.randn(2, 1, 16))] * 2
    step = Step(cache, torch.tensor(0), 1, None, end=32)
    with pytest.raises(RewriterError, match="start is on the host"):
        merged_attention(step, torch.randn(2, 1, 16), *kv[0], specs[0], None, None, None)


def test_the_allocator_holds_what_the_table_counts():
    """The allocated bytes equal the spec's count and kv_bytes_per_token, and both equal
    the arithmetic: directions once, four magnitudes, ceil(retain * L) side slots of two
    layers' K and V plus a position, three counters per head; ``describe`` (dumps) counts
    the same per token, less the counters."""
    opt = rewriter.optimize(_trace(), passes=[MiniCache(retain=0.05)])
    plain = rewriter.optimize(_trace())
    L, h, d, f = 128, 2, 16, 4  # context, KV heads, head size, float32 bytes
    side = math.ceil(0.05 * L)
    pair = 2 * h * L * d * f + h * L * 4 * f + h * side * (4 * d * f + 8) + h * (8 + 8 + 2 * 4)
    table = cache_table(opt.ir.gm)
    assert sorted(table) == [0, 1]  # layer 2 allocates nothing of its own
    cache = KVCache(table, 1, L, torch.float32, torch.device("cpu"))
    assert cache.nbytes == 2 * h * L * d * f + pair
    assert opt.kv_bytes_per_token() == cache.nbytes // L
    assert plain.kv_bytes_per_token() == 3 * 2 * h * d * f
    per_token = describe(table, torch.float32)["bytes_per_token"]
    assert per_token == 2 * 2 * h * d * f + 4 * h * f + int(0.05 * h * (4 * d * f + 8))
    opt.generate(IDS, max_new_tokens=3)  # a batch of 2: every part has its batch dimension
    assert opt._cache.nbytes == 2 * sum(s.bytes_for(opt._cache.max_len, torch.float32)
                                        for s in opt._cache.table.values())


def test_the_verifier_refuses_pairs_the_cache_could_not_serve():
    opt = rewriter.optimize(_trace(), passes=[MiniCache(start=0)])
    ir = opt.ir
    assert merged_pairs(ir.graph) == {0: 1}
    nodes = {i: _attention(ir, i) for i in range(3)}

    def refused(change, message):
        saved = {i: (n.args, dict(n.kwargs)) for i, n in nodes.items()}
        change()
        with pytest.raises(VerificationError, match=message):
            check_merging(ir)
        for i, n in nodes.items():
            n.args, n.kwargs = saved[i]

    def set_(layer, **kw):  # by position where the op was traced with it so
        names = [a.name for a in OPS["attention"]._schema.arguments]
        for key, value in kw.items():
            n = nodes[layer]
            if names.index(key) < len(n.args):
                n.update_arg(names.index(key), value)
            else:
                n.kwargs = {**n.kwargs, key: value}

    refused(lambda: set_(0, merge_with=7), "which has no attention")
    refused(lambda: set_(2, merge_with=0, merge=[0.5, 0.05, 0.05]), "a pair names each other")
    refused(lambda: (set_(0, merge_with=2), set_(2, merge_with=0, merge=[0.5, 0.05, 0.05]),
                     set_(1, merge_with=None, merge=None)), "not adjacent")
    refused(lambda: set_(1, merge=[0.5, 0.1, 0.05]), "its merge")
    refused(lambda: (set_(0, window=4), set_(1, window=5)), "its window")
    refused(lambda: set_(1, kv_source=0), r"kv_source: MiniCache is refused with a shared cache")
    check_merging(ir)
    ir.info["decoding"] = {"strategy": "self_speculative"}
    with pytest.raises(VerificationError, match="refuses the speculative strategy 'self_speculative'"):
        check_merging(ir)


def test_rings_sharing_and_speculation_are_refused_by_name():
    with pytest.raises(PassError, match="sinks: MiniCache is refused with a sink"):
        rewriter.optimize(_trace(), passes=[StreamingAttention(sinks=2, window=8), MiniCache()])
    with pytest.raises(PassError, match="MiniCache is refused with a shared cache"):
        rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0}), MiniCache()])
    # a merged layer whose cache another reads: the reader would take directions for K/V
    with pytest.raises(PassError, match=r"layers \[2\] read its cache \(ShareKV\)"):
        rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0}), MiniCache(start=0)])
    with pytest.raises(PassError, match="cannot follow MiniCache"):
        rewriter.optimize(_trace(), passes=[MiniCache(start=0), ShareKV(sources={2: 0})])
    with pytest.raises((PassError, VerificationError), match="refuses the speculative strategy"):
        rewriter.optimize(_trace(), passes=[MiniCache(), SelfSpeculative(skip_layers=[0])])
    with pytest.raises(PassError, match="refuses the speculative strategy"):
        rewriter.optimize(_trace(), passes=[SelfSpeculative(skip_layers=[0]), MiniCache()])
    with pytest.raises(PassError, match="merged with layer 2, which has no attention"):
        rewriter.optimize(_trace(), passes=[MiniCache(), LayerSkip(layers=[2])])
    with pytest.raises(PassError, match="merged with layer 2 already"):
        rewriter.optimize(_trace(), passes=[MiniCache(), MiniCache()])


@pytest.mark.parametrize("kwargs, message", [
    ({"start": -1}, "start"), ({"start": True}, "start"), ({"start": 1.5}, "start"),
    ({"t": 1.5}, "t must be"), ({"t": True}, "t must be"), ({"gamma": float("nan")}, "gamma"),
    ({"gamma": -0.1}, "gamma"), ({"retain": "all"}, "retain"), ({"retain": 2}, "retain")])
def test_bad_parameters_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MiniCache(**kwargs)


def test_pairs_from_the_middle_and_what_has_none():
    assert MiniCache().pairs(list(range(30))) == [(i, i + 1) for i in range(15, 29, 2)]
    assert MiniCache(start=0).pairs([0, 2, 3, 5, 6]) == [(0, 2), (3, 5)]
    with pytest.raises(PassError, match="layer 5 has no attention"):
        rewriter.optimize(_trace(), passes=[MiniCache(start=5)])
    with pytest.raises(PassError, match="nothing to merge"):
        rewriter.optimize(_trace("llama-hd24-2l"), passes=[MiniCache()])
    with pytest.raises(ValueError, match="gamma must be"):
        from_spec("minicache:gamma=2")


def test_artifacts_and_pass_specs_round_trip(tmp_path):
    opt = rewriter.optimize(_trace(), passes=[from_spec("minicache:gamma=0.1,retain=0.2")])
    assert "merge_with=1, merge=[0.5, 0.1, 0.2]" in str(opt.ir)
    assert from_spec(to_spec(MiniCache(start=1, t=0.4))).params() == \
        {"start": 1, "t": 0.4, "gamma": 0.05, "retain": 0.05}
    back = saved_and_loaded(opt, tmp_path / "a", IDS)
    assert merged_pairs(back.ir.graph) == {1: 2}


def test_the_triton_backend_gives_the_torch_tokens():
    """Under the interpreter: K/V restored by torch, attended by the Triton kernels."""
    pytest.importorskip("triton")
    torch_side = rewriter.optimize(_trace(), passes=[MiniCache()])
    tri = rewriter.optimize(_trace(), passes=[MiniCache()], backend="triton")
    assert torch.equal(tri.generate(IDS, max_new_tokens=5), torch_side.generate(IDS, max_new_tokens=5))
