"""Triton kernel templates against their torch references (``rewriter.ops``), under
``TRITON_INTERPRET=1`` on the CPU: irregular sizes, fresh random inputs every run, and
outputs poisoned with NaN before the launch so an element a kernel fails to write fails."""
import pytest
import torch

pytest.importorskip("triton")

from rewriter.codegen import norm, rope, swiglu  # noqa: E402
from rewriter.ops import REFERENCE  # noqa: E402


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
