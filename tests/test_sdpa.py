"""``rewriter.maths.sdpa``: the one-query bfloat16/float16 CPU path against ATen's SDPA."""
import pytest
import torch
import torch.nn.functional as F

import rewriter.maths.sdpa as sdpa_module
from rewriter.maths.sdpa import sdpa


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The path for calls of any size (by default small ones stay ATen's: faster there), on
    any machine (by default it is taken only where it was measured faster: ``_pays``)."""
    monkeypatch.setattr(sdpa_module, "_SMALL", 0)
    monkeypatch.setattr(sdpa_module, "_PAYS", {torch.bfloat16: True, torch.float16: True})
    monkeypatch.delenv(sdpa_module.ENV, raising=False)


def _inputs(b=2, hq=9, hkv=3, t=37, d=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, 1, d, generator=g) * 2).to(dtype)
    k = (torch.randn(b, hkv, t, d, generator=g) * 2).to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    return q, k, v


def _exact(q, k, v, mask=None, scale=None):
    """float32 SDPA on the same (rounded) inputs: what both paths approximate."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _refuse_aten(monkeypatch):
    """From here on, fail if a call reaches ATen's SDPA: the test is about the path beside it."""
    def refuse(*args, **kwargs):
        raise AssertionError("took ATen's SDPA")
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", refuse)


def _masks(b, hq, t):
    g = torch.Generator().manual_seed(1)
    ragged = torch.arange(t)[None, None, None] >= torch.tensor([0, 5])[:b, None, None, None]
    per_head = torch.rand(b, hq, 1, t, generator=g) > 0.3
    per_head[..., -1] = True
    return {"none": None, "shared": torch.rand(1, 1, 1, t, generator=g) > 0.2,
            "ragged": ragged, "per_head": per_head}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (6, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "shared", "ragged", "per_head"])
def test_grouped_path_matches_sdpa_to_its_precision(dtype, heads, mask_kind):
    hq, hkv = heads
    q, k, v = _inputs(hq=hq, hkv=hkv, dtype=dtype)
    mask = _masks(2, hq, k.shape[2])[mask_kind]
    kernel = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                            enable_gqa=hq != hkv)
    want = _exact(q, k, v, mask, 0.3)
    got = sdpa(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=hq != hkv)
    assert got.dtype == dtype and got.shape == q.shape
    # float32 attention rounded once: equal to it but for a rare tie of the rounding (the
    # kernel, which also rounds its softmax weights, differs on 15-20% of the outputs)
    assert (got != want.to(dtype)).float().mean() <= 0.02
    ulp = torch.finfo(dtype).eps * want.abs().max()
    assert (got.float() - want).abs().max() <= (kernel.float() - want).abs().max() + ulp


def test_grouped_path_is_taken(monkeypatch):
    q, k, v = _inputs()
    want = _exact(q, k, v, None, 0.25)
    _refuse_aten(monkeypatch)
    out = sdpa(q, k, v, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out.float(), want, atol=0.02, rtol=0.01)


def test_default_scale_is_one_over_root_d(monkeypatch):
    q, k, v = _inputs(d=16)
    _refuse_aten(monkeypatch)
    torch.testing.assert_close(sdpa(q, k, v, enable_gqa=True),
                               sdpa(q, k, v, scale=0.25, enable_gqa=True), atol=0, rtol=0)


def test_query_that_sees_nothing_gets_zeros_as_in_sdpa():
    q, k, v = _inputs()
    mask = torch.ones(2, 1, 1, k.shape[2], dtype=torch.bool)
    mask[1] = False
    got = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(want[1], got[1])
    assert not got.isnan().any()


def test_one_head_that_sees_nothing_gets_zeros():
    q, k, v = _inputs()
    mask = torch.ones(2, 9, 1, k.shape[2], dtype=torch.bool)
    mask[1, 4] = False  # row 1, query head 4 (KV head 1's second)
    got = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(got[1, 4], torch.zeros_like(got[1, 4]))
    others = torch.ones(2, 9, dtype=torch.bool)
    others[1, 4] = False
    assert torch.equal(got[others], sdpa(q, k, v, enable_gqa=True)[others])


@pytest.mark.parametrize("heads", [1, 9])
def test_rows_in_chunks_equal_one_call(monkeypatch, heads):
    q, k, v = _inputs(b=5, t=40)
    mask = torch.rand(5, heads, 1, 40, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[..., 0] = True
    whole = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    monkeypatch.setattr(sdpa_module, "_CHUNK", 2 * k[0].numel())  # two rows a chunk
    parts = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(whole, parts)
    monkeypatch.setattr(sdpa_module, "_CHUNK", 1)  # one row a chunk, the mask shared
    shared = mask[:1]
    assert torch.equal(sdpa(q, k, v, attn_mask=shared, enable_gqa=True),
                       torch.cat([sdpa(q[i:i + 1], k[i:i + 1], v[i:i + 1], attn_mask=shared,
                                       enable_gqa=True) for i in range(5)]))


def test_heads_are_grouped_only_with_enable_gqa():
    q, k, v = _inputs(hq=9, hkv=3)
    with pytest.raises(RuntimeError):  # as SDPA: 9 query heads over 3 without enable_gqa
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError):
        sdpa(q, k, v)


@pytest.mark.parametrize("case", ["float32", "two_queries", "float_mask", "mask_over_queries"])
def test_other_calls_are_atens(case):
    q, k, v = _inputs(dtype=torch.float32 if case == "float32" else torch.bfloat16)
    mask = None
    if case == "two_queries":
        q = torch.cat([q, q], 2)  # [B, Hq, 2, D]
    if case == "float_mask":
        mask = torch.zeros(1, 1, 1, k.shape[2], dtype=q.dtype)
    if case == "mask_over_queries":  # a mask that SDPA broadcasts but this path does not read
        mask = torch.ones(2, 1, 1, 1, dtype=torch.bool)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.equal(sdpa(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True), want)


def test_small_calls_stay_atens(monkeypatch):
    monkeypatch.setattr(sdpa_module, "_SMALL", 1024)
    aten, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a) or aten(*a, **kw))
    sdpa(*_inputs(b=1, hq=9, hkv=3, t=100), scale=0.3, enable_gqa=True)  # 900 (row, head, key)
    assert len(calls) == 1
    sdpa(*_inputs(b=1, hq=9, hkv=3, t=120), scale=0.3, enable_gqa=True)  # 1080
    assert len(calls) == 1


def test_kernel_only_sends_every_call_to_aten(monkeypatch):
    aten, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a) or aten(*a, **kw))
    q, k, v = _inputs(b=1, t=500)
    with sdpa_module.kernel_only():
        sdpa(q, k, v, enable_gqa=True)
    assert len(calls) == 1
    sdpa(q, k, v, enable_gqa=True)  # and back to the path after it
    assert len(calls) == 1


def test_a_machine_where_the_path_does_not_pay_keeps_the_kernel(monkeypatch):
    monkeypatch.setattr(sdpa_module, "_PAYS", {torch.bfloat16: False, torch.float16: True})
    aten, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(a) or aten(*a, **kw))
    q, k, v = _inputs(b=1, t=500)
    sdpa(q, k, v, enable_gqa=True)
    assert len(calls) == 1  # bfloat16: the kernel
    sdpa(q.half(), k.half(), v.half(), enable_gqa=True)  # float16 has a choice of its own
    assert len(calls) == 1


def _fake_clock(monkeypatch, kernel_costs, path_costs):
    """The probe's clock advanced by each call's cost (ms, in turn): no real timing."""
    now, costs = [0.0], {"kernel": list(kernel_costs), "path": list(path_costs)}
    monkeypatch.setattr(sdpa_module, "_clock", lambda: now[0])

    def costing(name, f):
        def call(*a, **kw):
            now[0] += costs[name].pop(0) if len(costs[name]) > 1 else costs[name][0]
            return f(*a, **kw)
        return call
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention",
                        costing("kernel", F.scaled_dot_product_attention))
    monkeypatch.setattr(sdpa_module, "_grouped", costing("path", sdpa_module._grouped))


@pytest.mark.parametrize("kernel,path,takes", [
    ([3.0], [1.0], True),  # the EPYC: the kernel 3.7x slower
    ([1.6], [1.0], True),
    ([1.4], [1.0], False),  # within the margin: the kernel keeps the calls
    ([0.4], [1.0], False),  # the Xeon in bfloat16
    ([0.4] * 2 + [9.0] * 20 + [0.4], [1.0], False),  # a busy machine slowed all but one call
    ([3.0], [1.0] * 2 + [20.0] * 20 + [1.0], True),
])
def test_the_choice_is_measured_on_each_sides_fastest_call(monkeypatch, kernel, path, takes):
    _fake_clock(monkeypatch, kernel, path)
    assert sdpa_module._measure(torch.bfloat16) is takes


def test_the_choice_can_be_fixed_by_hand(monkeypatch):
    monkeypatch.setattr(sdpa_module, "_PAYS", {torch.bfloat16: True})
    monkeypatch.setattr(sdpa_module, "_measure", lambda dtype: pytest.fail("measured"))
    q, k, v = _inputs(b=1, t=500)
    monkeypatch.setenv(sdpa_module.ENV, "off")
    _refuse_path = []
    monkeypatch.setattr(sdpa_module, "_grouped", lambda *a: _refuse_path.append(1))
    sdpa(q, k, v, enable_gqa=True)
    assert _refuse_path == []
    monkeypatch.setenv(sdpa_module.ENV, "on")
    monkeypatch.setattr(sdpa_module, "_PAYS", {torch.bfloat16: False})
    sdpa(q, k, v, enable_gqa=True)
    assert _refuse_path == [1]
    assert sdpa_module.path_taken(torch.float16)  # "on" for every dtype, nothing measured
    monkeypatch.setenv(sdpa_module.ENV, "yes")
    with pytest.raises(ValueError, match="REWRITER_SDPA_PATH must be auto, on or off"):
        sdpa(q, k, v, enable_gqa=True)


def test_nothing_is_measured_for_calls_the_path_never_takes(monkeypatch):
    monkeypatch.setattr(sdpa_module, "_PAYS", {})
    monkeypatch.setattr(sdpa_module, "_measure", lambda dtype: pytest.fail("measured"))
    monkeypatch.setattr(sdpa_module, "_SMALL", 1024)
    q, k, v = _inputs(b=1, t=500)
    sdpa(q.float(), k.float(), v.float(), enable_gqa=True)  # float32
    sdpa(*_inputs(b=1, t=100), enable_gqa=True)  # 900 triples: small
    sdpa(torch.cat([q, q], 2), k, v, enable_gqa=True)  # two queries
    with sdpa_module.kernel_only():
        sdpa(q, k, v, enable_gqa=True)
    assert sdpa_module._PAYS == {}


def test_tracing_neither_measures_nor_keeps_a_choice(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(sdpa_module, "_PAYS", {})
    monkeypatch.setattr(sdpa_module, "_measure", lambda dtype: pytest.fail("measured"))
    with FakeTensorMode():
        q, k, v = _inputs(b=1, t=500)
        out = sdpa(q, k, v, enable_gqa=True)  # the kernel's fake
    assert out.shape == q.shape and sdpa_module._PAYS == {}


def test_the_choice_is_measured_once_a_dtype(monkeypatch):
    monkeypatch.setattr(sdpa_module, "_PAYS", {})
    made = []
    monkeypatch.setattr(sdpa_module, "_measure", lambda dtype: made.append(dtype) or True)
    q, k, v = _inputs(b=1, t=500)
    for _ in range(3):
        sdpa(q, k, v, enable_gqa=True)
    sdpa(q.half(), k.half(), v.half(), enable_gqa=True)
    assert made == [torch.bfloat16, torch.float16]
    sdpa(q.float(), k.float(), v.float(), enable_gqa=True)  # float32 is never measured
    assert made == [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("how", ["compiling", "fake"])
def test_a_choice_made_before_tracing_is_not_used_while_tracing(monkeypatch, how):
    monkeypatch.setattr(sdpa_module, "_PAYS", {torch.bfloat16: True})
    taken = []
    monkeypatch.setattr(sdpa_module, "_grouped", lambda *a: taken.append(1))
    if how == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        sdpa(*_inputs(b=1, t=500), enable_gqa=True)
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            sdpa(*_inputs(b=1, t=500), enable_gqa=True)
    assert taken == []  # the kernel
    monkeypatch.setenv(sdpa_module.ENV, "ON")  # fixed by hand: taken while tracing too
    if how == "compiling":
        sdpa(*_inputs(b=1, t=500), enable_gqa=True)
    else:
        with FakeTensorMode():
            sdpa(*_inputs(b=1, t=500), enable_gqa=True)
    assert taken == [1]


def test_path_taken_says_what_a_call_would_do(monkeypatch):
    monkeypatch.setattr(sdpa_module, "_PAYS", {torch.bfloat16: True})
    monkeypatch.setattr(sdpa_module, "_SMALL", 1024)
    assert sdpa_module.path_taken(torch.bfloat16)
    assert not sdpa_module.path_taken(torch.float32)  # float32 never takes it
    with sdpa_module.kernel_only():
        assert not sdpa_module.path_taken(torch.bfloat16)
    monkeypatch.setenv(sdpa_module.ENV, "on")
    assert not sdpa_module.path_taken(torch.float32)
