"""Triton kernel templates against their torch references (``rewriter.ops``), under
``TRITON_INTERPRET=1`` on the CPU: irregular sizes, fresh random inputs every run, and
outputs poisoned with NaN before the launch so an element a kernel fails to write fails."""
import pytest
import torch

pytest.importorskip("triton")

from rewriter.codegen import norm, rope, swiglu  # noqa: E402
from rewriter.ops import REFERENCE  # noqa: E402


@pytest.fixture(autouse=True)
def on_the_gpu_when_there_is_one():
    """The same tests run the compiled kernels on a GPU: every tensor is made there."""
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)


def poisoned(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 7, 96), (3, 5, 80), (1, 13, 200)])
def test_add_rms_norm(shape):
    x, r, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    out, total = poisoned(shape), poisoned(shape)
    norm.add_rms_norm(x, r, w, 1e-6, out=out, total=total)
    want_out, want_total = REFERENCE["add_rms_norm"](x, r, w, 1e-6)
    torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    out2 = poisoned(shape)
    norm.rms_norm(x, w, 1e-5, out=out2)
    torch.testing.assert_close(out2, REFERENCE["rms_norm"](x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 2 * 96), (2, 7, 2 * 160), (3, 3, 2 * 1300)])
def test_swiglu(shape):
    gu = torch.randn(shape)
    out = poisoned((*shape[:-1], shape[-1] // 2))
    swiglu.swiglu(gu, out=out)
    torch.testing.assert_close(out, REFERENCE["swiglu"](gu), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("b,s,heads,head_dim,rot", [(1, 1, 4, 16, 16), (2, 7, 3, 24, 24),
                                                     (3, 5, 2, 12, 12), (2, 3, 4, 20, 10)])
def test_rope(b, s, heads, head_dim, rot):
    x = torch.randn(b, s, heads * head_dim)
    cos, sin = torch.randn(b, s, rot), torch.randn(b, s, rot)
    out = poisoned(x.shape)
    rope.rope(x, cos, sin, head_dim, out=out)
    torch.testing.assert_close(out, REFERENCE["rope"](x, cos, sin, head_dim), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- decode attention

from rewriter.codegen.decode_attention import decode_attention, decode_attention_reference  # noqa: E402


def cache(b, hkv, length, dim):
    return torch.randn(b, hkv, length, dim), torch.randn(b, hkv, length, dim)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 2), (3, 1)])  # GQA 1, 4, 3, MQA
@pytest.mark.parametrize("dim,end", [(16, 37), (24, 130), (12, 5)])
def test_decode_attention_dense(hq, hkv, dim, end):
    b = 2
    k, v = cache(b, hkv, 160, dim)
    q = torch.randn(b, hq, dim)
    out = poisoned((b, hq, dim))
    decode_attention(q, k, v, end, 0.3, splits=3, block_n=16, out=out)
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, end, 0.3), rtol=1e-5, atol=1e-5)


def test_decode_attention_equals_the_ir_attention_op():
    """Dense decode attention is what ``rw.attention`` computes for the last query."""
    from rewriter.ops import REFERENCE
    b, s, hq, hkv, dim = 2, 37, 8, 2, 16
    q, k, v = torch.randn(b, s, hq * dim), torch.randn(b, s, hkv * dim), torch.randn(b, s, hkv * dim)
    want = REFERENCE["attention"](q, k, v, 0, hq, hkv, dim, 0.25, True, None)[:, -1]  # [B, Hq*D]
    kc = k.view(b, s, hkv, dim).transpose(1, 2).contiguous()  # [B, Hkv, S, D]
    vc = v.view(b, s, hkv, dim).transpose(1, 2).contiguous()
    got = decode_attention(q[:, -1].view(b, hq, dim), kc, vc, s, 0.25, splits=2, block_n=16)
    torch.testing.assert_close(got.reshape(b, -1), want, rtol=1e-5, atol=1e-5)


def test_decode_attention_padding_window_and_sinks():
    b, hq, hkv, dim, end = 3, 6, 2, 20, 75
    k, v = cache(b, hkv, 80, dim)
    q = torch.randn(b, hq, dim)
    start = torch.tensor([0, 9, 40], dtype=torch.int32)
    for window, sinks in [(0, 0), (16, 0), (16, 4), (50, 3)]:
        out = poisoned((b, hq, dim))
        decode_attention(q, k, v, end, 0.2, start=start, window=window, sinks=sinks, splits=4,
                         block_n=16, out=out)
        want = decode_attention_reference(q, k, v, end, 0.2, start=start.long(), window=window, sinks=sinks)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_decode_attention_per_head_token_lists():
    b, hq, hkv, dim, end = 2, 8, 2, 16, 90
    k, v = cache(b, hkv, 96, dim)
    q = torch.randn(b, hq, dim)
    index = torch.stack([torch.randperm(end)[:21] for _ in range(b * hkv)]).view(b, hkv, 21).int()
    index[1, 0, 15:] = -1  # a shorter list for one head
    out = poisoned((b, hq, dim))
    decode_attention(q, k, v, end, 0.25, index=index, splits=2, block_n=16, out=out)
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, end, 0.25, index=index),
                               rtol=1e-5, atol=1e-5)


def test_decode_attention_scores_sink_slots_with_their_own_query():
    # a sink + window ring: slots below sink_slots hold the sinks, scored by q rotated back
    b, hq, hkv, dim, size = 2, 6, 2, 16, 40
    k, v = cache(b, hkv, size + 1, dim)
    q, q_sink = torch.randn(b, hq, dim), torch.randn(b, hq, dim)
    index = torch.arange(size).expand(b, hkv, size).clone()
    index[1, :, 30:] = -1  # a ring not yet full in row 1
    out = poisoned((b, hq, dim))
    decode_attention(q, k, v, size, 0.25, index=index, q_sink=q_sink, sink_slots=3, splits=2,
                     block_n=16, out=out)
    want = decode_attention_reference(q, k, v, size, 0.25, index=index, q_sink=q_sink,
                                      sink_slots=3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    plain = decode_attention_reference(q, k, v, size, 0.25, index=index)
    assert not torch.allclose(want, plain, atol=1e-3)  # the sink query changes the answer
    # the sinks anywhere in the position list: a reversed ring reads them in its last block
    flipped = index.flip(-1).contiguous()
    decode_attention(q, k, v, size, 0.25, index=flipped, q_sink=q_sink, sink_slots=3, splits=2,
                     block_n=16, out=out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="q_sink"):
        decode_attention(q, k, v, size, 0.25, q_sink=q_sink[:, :3], sink_slots=3)
    with pytest.raises(ValueError, match="q_sink"):
        decode_attention(q, k, v, size, 0.25, q_sink=q_sink.double(), sink_slots=3)
    for bad in (dict(sink_slots=3), dict(q_sink=q_sink), dict(q_sink=q_sink, sink_slots=-1)):
        with pytest.raises(ValueError, match="sink_slots"):
            decode_attention(q, k, v, size, 0.25, **bad)


def test_decode_attention_refuses_blocks_the_gpu_cannot_compile():
    q, (k, v) = torch.randn(1, 4, 16), cache(1, 2, 40, 16)
    for block_n in (8, 24):  # tl.dot needs K >= 16; tl.arange a power of two
        with pytest.raises(ValueError, match="block_n"):
            decode_attention(q, k, v, 33, 0.25, block_n=block_n)


def test_decode_attention_reads_another_layers_cache():
    """KV sharing: the same query against a second cache tensor, chosen by the caller."""
    k0, v0 = cache(1, 2, 40, 16)
    k1, v1 = cache(1, 2, 40, 16)
    q = torch.randn(1, 4, 16)
    a, b = decode_attention(q, k0, v0, 33, 0.25), decode_attention(q, k1, v1, 33, 0.25)
    torch.testing.assert_close(b, decode_attention_reference(q, k1, v1, 33, 0.25), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, b)


# ---------------------------------------------------------------------------- prefill attention

from rewriter.codegen.prefill_attention import prefill_attention  # noqa: E402


def as_cache(x, hkv, dim, length):
    """[B, S, Hkv*D] -> a [B, Hkv, length, D] cache holding it at positions [0, S)."""
    b, s, _ = x.shape
    c = torch.randn(b, hkv, length, dim)  # junk past S must never be read
    c[:, :, :s] = x.view(b, s, hkv, dim).transpose(1, 2)
    return c


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 2), (3, 1)])
@pytest.mark.parametrize("s,dim,window", [(7, 16, None), (29, 24, None), (33, 12, 5), (1, 16, None)])
def test_prefill_attention_equals_the_ir_attention_op(hq, hkv, s, dim, window):
    from rewriter.ops import REFERENCE
    b = 2
    q, k, v = torch.randn(b, s, hq * dim), torch.randn(b, s, hkv * dim), torch.randn(b, s, hkv * dim)
    want = REFERENCE["attention"](q, k, v, 0, hq, hkv, dim, 0.3, True, window)
    out = poisoned(q.shape)
    prefill_attention(q, as_cache(k, hkv, dim, s + 5), as_cache(v, hkv, dim, s + 5), hq, 0.3,
                      window=window or 0, out=out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_prefill_attention_left_padding_matches_rows_alone():
    from rewriter.ops import REFERENCE
    hq, hkv, dim, width = 4, 2, 16, 19
    lengths = [19, 11, 4]
    q, k, v = torch.randn(3, width, hq * dim), torch.randn(3, width, hkv * dim), torch.randn(3, width, hkv * dim)
    start = torch.tensor([width - n for n in lengths], dtype=torch.int32)
    out = poisoned(q.shape)
    prefill_attention(q, as_cache(k, hkv, dim, width), as_cache(v, hkv, dim, width), hq, 0.25,
                      start=start, out=out)
    for row, n in enumerate(lengths):
        alone = REFERENCE["attention"](q[row:row + 1, -n:], k[row:row + 1, -n:], v[row:row + 1, -n:],
                                       0, hq, hkv, dim, 0.25, True, None)
        torch.testing.assert_close(out[row:row + 1, -n:], alone, rtol=1e-5, atol=1e-5)
    assert not out.isnan().any()  # padding queries too: they see themselves


def test_prefill_attention_continues_after_cached_tokens():
    """A chunk of 6 tokens after 10 cached ones equals the last 6 rows of the full prefill."""
    from rewriter.ops import REFERENCE
    hq, hkv, dim, total = 4, 2, 16, 16
    q, k, v = torch.randn(1, total, hq * dim), torch.randn(1, total, hkv * dim), torch.randn(1, total, hkv * dim)
    want = REFERENCE["attention"](q, k, v, 0, hq, hkv, dim, 0.25, True, None)[:, 10:]
    got = prefill_attention(q[:, 10:], as_cache(k, hkv, dim, 20), as_cache(v, hkv, dim, 20), hq, 0.25, q_start=10)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b,s,heads,head_dim,rot,start", [(2, 5, 2, 16, 16, 3), (1, 1, 1, 24, 24, 9),
                                                           (3, 4, 2, 20, 10, 0)])
def test_rope_into_cache_writes_rotated_keys_and_nothing_else(b, s, heads, head_dim, rot, start):
    k = torch.randn(b, s, heads * head_dim)
    cos, sin = torch.randn(b, s, rot), torch.randn(b, s, rot)
    cache = poisoned((b, heads, start + s + 4, head_dim))
    rope.rope_into_cache(k, cos, sin, head_dim, cache, start)
    want = REFERENCE["rope"](k, cos, sin, head_dim).view(b, s, heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(cache[:, :, start:start + s], want, rtol=1e-5, atol=1e-5)
    assert cache[:, :, :start].isnan().all() and cache[:, :, start + s:].isnan().all()


@pytest.mark.parametrize("device_start", [False, True])
def test_rope_into_cache_stores_v_in_the_same_launch(device_start):
    """K rotated and V copied by one kernel, from views of a fused qkv output (row stride
    wider than the row), at a position that may be a device value."""
    b, s, heads, head_dim, start = 2, 3, 3, 20, 4
    qkv = torch.randn(b, s, 5 * heads * head_dim)  # [B, S, (3 q + 1 k + 1 v) heads]
    k, v = qkv[..., 3 * heads * head_dim:4 * heads * head_dim], qkv[..., 4 * heads * head_dim:]
    cos, sin = torch.randn(b, s, 16), torch.randn(b, s, 16)
    k_cache, v_cache = poisoned((b, heads, 9, head_dim)), poisoned((b, heads, 9, head_dim))
    where = torch.tensor([start]) if device_start else start
    rope.rope_into_cache(k, cos, sin, head_dim, k_cache, where, v=v, v_cache=v_cache)
    split = lambda x: x.reshape(b, s, heads, head_dim).transpose(1, 2)  # noqa: E731
    torch.testing.assert_close(k_cache[:, :, start:start + s],
                               split(REFERENCE["rope"](k, cos, sin, head_dim)), rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache[:, :, start:start + s], split(v))
    for c in (k_cache, v_cache):
        assert c[:, :, :start].isnan().all() and c[:, :, start + s:].isnan().all()


def test_rope_into_cache_never_reads_a_device_start_on_the_host(monkeypatch):
    """Under CUDA-graph capture any host read of the start (``item``, formatting it into a
    message) is forbidden: the H100 run of 2026-11-22 failed its capture on exactly that."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a device tensor was read on the host")
    b, s, heads, head_dim = 1, 1, 2, 16
    k, cos, sin = torch.randn(b, s, heads * head_dim), torch.randn(b, s, 16), torch.randn(b, s, 16)
    cache = poisoned((b, heads, 8, head_dim))
    start = torch.tensor([5])
    for name in ("__format__", "__repr__", "item", "tolist", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    rope.rope_into_cache(k, cos, sin, head_dim, cache, start)
    monkeypatch.undo()
    want = REFERENCE["rope"](k, cos, sin, head_dim).view(b, s, heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(cache[:, :, 5:6], want, rtol=1e-5, atol=1e-5)


def test_decode_attention_ignores_token_indices_outside_the_cache():
    """A bad index list is masked inside the kernel, never read out of bounds."""
    b, hq, hkv, dim, end = 1, 4, 2, 16, 30
    k, v = cache(b, hkv, 32, dim)
    q = torch.randn(b, hq, dim)
    good = torch.tensor([[[3, 7, 11, 29], [0, 1, 2, 5]]], dtype=torch.int32)
    bad = torch.tensor([[[3, 7, 11, 29, 30, 10_000], [0, 1, 2, 5, -7, 1 << 30]]], dtype=torch.int32)
    want = decode_attention(q, k, v, end, 0.25, index=good)
    torch.testing.assert_close(decode_attention(q, k, v, end, 0.25, index=bad), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention(q, k, v, 33, 0.25)  # more positions than the cache holds


# ---------------------------------------------------------------------------- bfloat16

def _bf16_cases():
    t = lambda *s: torch.randn(*s, dtype=torch.bfloat16)  # noqa: E731
    x, r, w, gu = t(5, 200), t(5, 200), t(200), t(5, 2 * 150)
    qp, cs, sn = t(1, 9, 4 * 24), t(1, 9, 24), t(1, 9, 24)
    q1, kc, vc = t(2, 6, 24), t(2, 2, 77, 24), t(2, 2, 77, 24)
    cq, sq = t(2, 1, 24), t(2, 1, 24)
    kp, vp, qq = t(1, 2, 29, 24), t(1, 2, 29, 24), t(1, 29, 6 * 24)
    k, v = (c.transpose(1, 2).reshape(1, 29, 48) for c in (kp, vp))  # [B, S, Hkv*D]
    return {
        "add_rms_norm": (lambda: norm.add_rms_norm(x, r, w, 1e-6)[0],
                         lambda: REFERENCE["add_rms_norm"](x, r, w, 1e-6)[0]),
        "swiglu": (lambda: swiglu.swiglu(gu), lambda: REFERENCE["swiglu"](gu)),
        "rope": (lambda: rope.rope(qp, cs, sn, 24), lambda: REFERENCE["rope"](qp, cs, sn, 24)),
        # rw.rotary's tables are fp32: the kernels round them to bf16 themselves
        "rope_fp32_tables": (lambda: rope.rope(qp, cs.float(), sn.float(), 24),
                             lambda: REFERENCE["rope"](qp, cs.float(), sn.float(), 24)),
        "decode_attention_rope": (
            lambda: decode_attention(q1, kc, vc, 77, 0.2, cos=cq.float(), sin=sq.float()),
            lambda: decode_attention_reference(
                REFERENCE["rope"](q1.reshape(2, 1, -1), cq.float(), sq.float(), 24).view(2, 6, 24),
                kc, vc, 77, 0.2)),
        "decode_attention": (lambda: decode_attention(q1, kc, vc, 77, 0.2),
                             lambda: decode_attention_reference(q1, kc, vc, 77, 0.2)),
        "prefill_attention": (lambda: prefill_attention(qq, kp, vp, 6, 0.2),
                              lambda: REFERENCE["attention"](qq, k, v, 0, 6, 2, 24, 0.2, True, None)),
    }


@pytest.mark.parametrize("name", ["add_rms_norm", "swiglu", "rope", "rope_fp32_tables",
                                  "decode_attention", "decode_attention_rope", "prefill_attention"])
def test_templates_in_bfloat16(name):
    """bf16 is what a GPU runs. Under the interpreter this also guards the workarounds for
    its bf16 gaps (``tl.dot`` and bf16 products; see ``rewriter.codegen.interpreted``)."""
    got, want = (f() for f in _bf16_cases()[name])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------- bad arguments

def _bad_calls():
    x, w = torch.randn(3, 40), torch.randn(40)
    q, cs = torch.randn(2, 5, 4 * 16), torch.randn(2, 5, 16)
    return {
        "weight of the wrong length": lambda: norm.rms_norm(x, torch.randn(39), 1e-6),
        "residual of another shape": lambda: norm.add_rms_norm(x, torch.randn(3, 41), w, 1e-6),
        "norm output too small": lambda: norm.rms_norm(x, w, 1e-6, out=torch.empty(2, 40)),
        "odd gate_up": lambda: swiglu.swiglu(torch.randn(3, 41)),
        "swiglu output too small": lambda: swiglu.swiglu(torch.randn(3, 40), out=torch.empty(3, 19)),
        "features not whole heads": lambda: rope.rope(q, cs, cs, 24),
        "cos for fewer tokens": lambda: rope.rope(q, cs[:, :4], cs[:, :4], 16),
        "rotary wider than a head": lambda: rope.rope(q, torch.randn(2, 5, 18), torch.randn(2, 5, 18), 16),
        "cache of another head_dim": lambda: rope.rope_into_cache(
            torch.randn(2, 1, 32), torch.randn(2, 1, 16), torch.randn(2, 1, 16), 16,
            torch.zeros(2, 2, 8, 32), 0),
        "write past the cache": lambda: rope.rope_into_cache(
            torch.randn(2, 3, 32), torch.randn(2, 3, 16), torch.randn(2, 3, 16), 16,
            torch.zeros(2, 2, 8, 16), 6),
        **{f"rope start {name}": (lambda bad=bad: rope.rope_into_cache(
            torch.randn(2, 3, 32), torch.randn(2, 3, 16), torch.randn(2, 3, 16), 16,
            torch.zeros(2, 2, 8, 16), bad)) for name, bad in _bad_starts().items()},
        **{f"prefill_attention q_start {name}": (lambda bad=bad: prefill_attention(
            torch.randn(2, 3, 64), torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16), 4, 0.25,
            q_start=bad)) for name, bad in {**_bad_starts(), "of one row": torch.tensor([3])}.items()},
    }


def _bad_starts():
    """Per-row starts for 2 rows that both kernels refuse."""
    return {"float": torch.tensor([1.0, 2.0]), "2-d": torch.tensor([[1, 2]]),
            "3 rows": torch.tensor([1, 2, 3]), "strided": torch.tensor([[4, 0], [5, 0]])[:, 0],
            "expanded": torch.tensor([4]).expand(2), "on the meta device": torch.tensor(
                [1, 2], device="meta"), "0-dim float": torch.tensor(3.0)}


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_are_refused_before_a_launch(case):
    with pytest.raises(ValueError, match="rms_norm|swiglu|rope|prefill_attention"):
        _bad_calls()[case]()


# ---------------------------------------------------------------------------- q rotated in attention

@pytest.mark.parametrize("hq,hkv,dim,rot", [(4, 4, 16, 16), (6, 2, 24, 24), (8, 2, 20, 10)])
def test_decode_attention_rotates_q_itself(hq, hkv, dim, rot):
    """``FuseRoPE`` on the Triton path: q rotated inside the kernel == rope, then attention."""
    b, end = 3, 45
    k, v = cache(b, hkv, 50, dim)
    q = torch.randn(b, 1, (hq + 2 * hkv) * dim)[..., :hq * dim]  # q of a fused qkv: a view
    cos, sin = torch.randn(b, 1, rot), torch.randn(b, 1, rot)
    out = poisoned((b, hq, dim))
    decode_attention(q.view(b, hq, dim), k, v, end, 0.3, cos=cos, sin=sin, out=out, block_n=16)
    want = decode_attention(rope.rope(q, cos, sin, dim).view(b, hq, dim), k, v, end, 0.3, block_n=16)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out, decode_attention(q.view(b, hq, dim), k, v, end, 0.3))


@pytest.mark.parametrize("hq,hkv,s,dim,rot", [(4, 2, 19, 16, 16), (6, 6, 33, 24, 12)])
def test_prefill_attention_rotates_q_itself(hq, hkv, s, dim, rot):
    b = 2
    q = torch.randn(b, s, (hq + 2 * hkv) * dim)[..., :hq * dim]  # q of a fused qkv: a view
    k, v = cache(b, hkv, s + 3, dim)
    cos, sin = torch.randn(b, s, rot), torch.randn(b, s, rot)
    got = prefill_attention(q, k, v, hq, 0.3, cos=cos, sin=sin)
    want = prefill_attention(rope.rope(q, cos, sin, dim), k, v, hq, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="prefill_attention"):
        prefill_attention(q, k, v, hq, 0.3, cos=cos[:, :-1], sin=sin[:, :-1])
