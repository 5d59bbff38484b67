"""The torch backend's faster kernels equal the reference ops bit for bit, on the inputs
they take and on the ones they hand back to the reference."""
import pytest
import torch

from rewriter.ops import REFERENCE
from rewriter.runtime.kernels import KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 7, 96), (2, 5, 80)])
def test_rms_norm_and_add_rms_norm(shape, dtype):
    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    assert torch.equal(KERNELS["rms_norm"](x, w, 1e-6), REFERENCE["rms_norm"](x, w, 1e-6))
    for got, want in zip(KERNELS["add_rms_norm"](x, r, w, 1e-5), REFERENCE["add_rms_norm"](x, r, w, 1e-5)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("heads,head_dim,rot", [(4, 16, 16), (3, 24, 24), (2, 12, 12), (4, 16, 8)])
def test_rope(heads, head_dim, rot):
    x = torch.randn(2, 5, heads * head_dim)
    cos, sin = torch.randn(2, 5, rot), torch.randn(2, 5, rot)  # rot < head_dim: partial rotary
    assert torch.equal(KERNELS["rope"](x, cos, sin, head_dim), REFERENCE["rope"](x, cos, sin, head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 96), (3, 7, 96), (5, 96)])
def test_linear_on_a_flattened_input(shape, dtype):
    x, w, b = torch.randn(shape, dtype=dtype), torch.randn(40, 96, dtype=dtype), torch.randn(40, dtype=dtype)
    for bias in (None, b):
        got, want = KERNELS["linear"](x, w, bias), REFERENCE["linear"](x, w, bias)
        assert got.shape == want.shape
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:  # bfloat16 3-d inputs take another ATen path: the same up to rounding
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_a_transposed_weight(bias):
    x, w = torch.randn(3, 5, 96), torch.randn(40, 96)
    b = torch.randn(40) if bias else None
    from rewriter.runtime.kernels import linear_t
    got = linear_t(x, w.t().contiguous(), b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_prefill_and_decode_programs_share_one_transposed_copy():
    import rewriter
    from conftest import make_model
    opt = rewriter.optimize(make_model("llama-gqa-3l"))
    programs = opt._lowered()
    prefill, decode = programs["prefill"], programs["decode"]
    transposed = lambda gm: {t.data_ptr() for t in gm.buffers() if t.dim() == 2 and t.shape == (64, 96)}  # noqa: E731
    # gate and up projections [96, 64] are read as [64, 96] copies (2 x 3 layers), one per weight
    assert opt.ir.weight("model.layers.0.mlp.up_proj.weight").shape == (96, 64)
    assert len(transposed(prefill)) == 6 and transposed(prefill) == transposed(decode)


def test_a_lowering_reuses_a_transposed_copy_until_its_weight_is_written():
    """Timing passes lower a model many times: each weight is transposed once, and again
    only after it changed in place (its version counter), never read stale."""
    import rewriter
    from conftest import make_model
    from rewriter.runtime.lower import lower
    opt = rewriter.optimize(make_model("llama-gqa-3l"))
    name = "model.layers.0.mlp.up_proj.weight"
    weight = opt.ir.weight(name)
    copies = lambda: [t for t in lower(opt.ir, False, "torch", {}).buffers()  # noqa: E731
                      if t.shape == weight.t().shape and torch.equal(t, weight.t())]
    first, again = copies(), copies()
    assert len(first) == 1 and first[0].data_ptr() == again[0].data_ptr()
    with torch.no_grad():
        weight.mul_(2)  # in place: the kept copy is stale
    fresh = copies()
    assert len(fresh) == 1 and fresh[0].data_ptr() != first[0].data_ptr()


def test_a_model_loaded_under_inference_mode_lowers_and_generates(tmp_path):
    """Weights made under inference_mode have no version counter: their transposed copies
    are not kept, and the model loads and decodes as any other."""
    import rewriter
    from conftest import make_model
    opt = rewriter.optimize(make_model("llama-gqa-3l"))
    want = opt.generate([[3, 4, 5]], max_new_tokens=4, eos_token_id=[])
    opt.save(tmp_path / "m")
    with torch.inference_mode():
        got = rewriter.load(tmp_path / "m").generate([[3, 4, 5]], max_new_tokens=4, eos_token_id=[])
    assert torch.equal(got, want)
