"""``Int4Weights`` and ``rw.linear_int4``: the 4-bit format, exactness on weights already on a
4-bit grid (GGUF Q4_1), the CPU kernel against the reference op, artifacts, bad input."""
import pytest
import torch

import rewriter
from rewriter.errors import ArtifactError, PassError
from rewriter.maths.int4 import dequantize, quantize, unpack
from rewriter.passes import FuseQKV, FuseSwiGLU, Int4Weights, LayerSkip, from_spec
from rewriter.runtime.kernels import int4_cpu_tables, linear_int4_cpu

from artifact_tools import reseal, version_dir
from conftest import assert_close_rel, make_model, traced_model

IDS = torch.tensor([[3, 17, 42, 5, 99, 8, 64], [1, 2, 3, 4, 5, 6, 7]])
GENERATE = dict(max_new_tokens=12, eos_token_id=[])


def on_grid(model: torch.nn.Module, group: int = 32) -> torch.nn.Module:
    """``model`` with every ``nn.Linear`` weight replaced by a 4-bit reading whose step and
    minimum are float16 numbers, as a model dequantized from a Q4_1 GGUF file has; the LM
    head left alone."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m is not head and m.in_features % group == 0:
                codes, scales, mins = quantize(m.weight, group)
                scales, mins = scales.half().float(), mins.half().float()
                m.weight.copy_(dequantize(codes, scales, mins, group))
    return model


def test_quantize_packs_two_codes_a_byte_low_nibble_first():
    w = torch.tensor([[0.0, 1.0, 2.0, 15.0] * 8])  # one group of 32, min 0, step 1
    codes, scales, mins = quantize(w, 32)
    assert codes.dtype == torch.uint8 and codes.shape == (1, 16)
    assert codes[0, 0].item() == 0 | (1 << 4) and codes[0, 1].item() == 2 | (15 << 4)
    assert scales.item() == 1.0 and mins.item() == 0.0
    assert torch.equal(unpack(codes)[0], w[0].to(torch.uint8))
    assert torch.equal(dequantize(codes, scales, mins, 32), w)


def test_quantize_error_is_at_most_half_a_step_and_exact_on_a_grid():
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 3
    codes, scales, mins = quantize(w, 32)
    back = dequantize(codes, scales, mins, 32)
    step = scales.repeat_interleave(32, dim=1)  # [out, in]
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(dequantize(*quantize(back, 32), 32), back)  # re-quantizing is exact
    const = torch.full((16, 64), 0.25)  # a constant group: step 0, every code 0
    assert torch.equal(dequantize(*quantize(const, 64), 64), const)


@pytest.mark.parametrize("config", ["llama-gqa-3l", "qwen2-mqa-3l", "mistral-window-3l"])
def test_int4_is_lossless_on_weights_already_on_the_grid(config):
    model = on_grid(make_model(config, initializer_range=0.2))
    traced = rewriter.trace(model)  # one trace, 2 pipelines
    base = rewriter.optimize(traced)
    opt = rewriter.optimize(traced, passes=[Int4Weights()])
    assert opt.ir.info["int4"]["max_abs_error"] == 0.0
    assert opt.ir.info["int4"]["linears"] == 7 * 3  # q k v o gate up down, 3 layers
    assert torch.equal(opt(IDS), base(IDS))  # the reference op: the same weights, bit for bit
    assert torch.equal(opt.generate(IDS, **GENERATE), base.generate(IDS, **GENERATE))


def test_int4_on_ordinary_weights_is_lossy_and_says_by_how_much():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    opt = rewriter.optimize(traced, passes=[Int4Weights()])
    info = opt.ir.info["int4"]
    assert 0 < info["max_abs_error"] < info["max_abs_weight"] / 15  # under one step of 15
    base = rewriter.optimize(traced)
    assert not torch.equal(opt(IDS), base(IDS))
    # the runtime (a dense dequantized copy in float32) follows the IR's reference op
    assert torch.equal(opt.generate(IDS, **GENERATE), reference_greedy(opt, IDS, 12))


def reference_greedy(opt, ids, new: int) -> torch.Tensor:
    """Greedy tokens from whole-sequence calls of the IR (its reference ops), no KV cache."""
    for _ in range(new):
        ids = torch.cat([ids, opt(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_lm_head_stays_dense_unless_asked():
    _, traced = traced_model("llama-gqa-3l")
    kept = rewriter.optimize(traced, passes=[Int4Weights()])
    assert "lm_head.weight" in kept.ir.weights()
    taken = rewriter.optimize(traced, passes=[Int4Weights(group_size=64, lm_head=True)])
    assert "lm_head.weight" not in taken.ir.weights()
    assert "lm_head.int4_codes" in taken.ir.weights()
    # 6 of 7 linears a layer (down_proj's 96 in-features are not groups of 64) + the head
    assert taken.ir.info["int4"]["linears"] == 6 * 3 + 1
    assert "rw.linear(" in str(taken.ir)  # the down projections stay dense


def test_cpu_kernel_matches_the_reference_op_in_bfloat16():
    torch.manual_seed(1)
    w = torch.randn(96, 128).bfloat16()
    codes, scales, mins = quantize(w, 32)
    x = torch.randn(2, 5, 128).bfloat16()
    reference = rewriter.ops.REFERENCE["linear_int4"](x, codes, scales, mins, None, 32)
    bias = torch.randn(96).bfloat16()
    fast = linear_int4_cpu(x, *int4_cpu_tables(codes, scales, mins), 32)
    assert fast.shape == (2, 5, 96) and fast.dtype == torch.bfloat16
    assert_close_rel(fast.float(), reference.float(), rel=2e-2)
    with_bias = linear_int4_cpu(x, *int4_cpu_tables(codes, scales, mins), 32, bias)
    assert torch.equal(with_bias, fast + bias)


def test_bfloat16_programs_use_the_cpu_kernel_and_float32_ones_a_dense_copy():
    model = make_model("llama-gqa-3l", initializer_range=0.2)
    for dtype, kernel in ((torch.float32, "linear_t"), (torch.bfloat16, "linear_int4_cpu")):
        opt = rewriter.optimize(model.to(dtype), passes=[Int4Weights()])
        code = opt.programs()
        assert kernel in code["decode"] and "linear_int4(" not in code["decode"]
    assert "linear_int4_cpu" in code["prefill"]
    # bfloat16: the kernel's tokens against the reference op's (rounding may differ late)
    fast, slow = opt.generate(IDS, **GENERATE), reference_greedy(opt, IDS, 12)
    assert (fast == slow).float().mean() > 0.9


def test_int4_composes_with_fusions_and_layer_skip_and_round_trips(tmp_path):
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2)
    passes = [LayerSkip(layers=[1]), FuseQKV(), FuseSwiGLU(), Int4Weights()]
    opt = rewriter.optimize(traced, passes=passes)
    assert opt.ir.info["int4"]["linears"] == 2 * 4  # qkv, o, gate_up, down in 2 layers
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert "rw.linear_int4" in str(loaded.ir)
    assert torch.equal(loaded.generate(IDS, **GENERATE), opt.generate(IDS, **GENERATE))
    assert loaded.ir.info["int4"] == opt.ir.info["int4"]


def test_bad_parameters_are_refused():
    for bad in (16, 33, 0, True, "32", 32.0):
        with pytest.raises(ValueError, match="group_size"):
            Int4Weights(group_size=bad)
    with pytest.raises(ValueError, match="lm_head"):
        Int4Weights(lm_head="yes")
    with pytest.raises(ValueError, match="group_size"):
        from_spec("int4_weights:group_size=16")
    assert from_spec("int4_weights:group_size=64,lm_head=true").params() == \
        {"group_size": 64, "lm_head": True, "exact": False}
    assert from_spec("int4_weights:exact=true").params()["exact"] is True


def test_a_model_with_nothing_to_quantize_is_a_pass_error():
    _, traced = traced_model("llama-hd24-2l", hidden_size=72, intermediate_size=120)  # no multiple of 256
    with pytest.raises(PassError, match="no linear whose in-features are a multiple of 256"):
        rewriter.optimize(traced, passes=[Int4Weights(group_size=256)])


@pytest.mark.parametrize("what", ["codes_dtype", "codes_width", "scales_shape"])
def test_tampered_int4_weights_in_an_artifact_are_refused(tmp_path, what):
    from safetensors.torch import load_file, save_file
    opt = rewriter.optimize(traced_model("llama-gqa-3l")[1], passes=[Int4Weights()])
    opt.save(tmp_path / "a")
    path = version_dir(tmp_path / "a") / "weights.safetensors"
    weights = load_file(path)
    name = "model.layers.0.mlp.down_proj.int4_codes"
    if what == "codes_dtype":
        weights[name] = weights[name].to(torch.int8)
    elif what == "codes_width":
        weights[name] = weights[name][:, :-1].contiguous()
    else:
        scales = name.replace("codes", "scales")
        weights[scales] = weights[scales][:, :1].contiguous()
    save_file(weights, path)
    reseal(tmp_path / "a")
    with pytest.raises(ArtifactError):
        rewriter.load(tmp_path / "a")
