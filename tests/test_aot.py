"""The kernels the Triton backend launches compile for an H100 (sm_90), checked on this CPU:
the interpreter that runs them here accepts programs the GPU compiler rejects."""
import importlib.util
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("records launches under TRITON_INTERPRET=1", allow_module_level=True)

import rewriter  # noqa: E402
from rewriter.codegen import rope  # noqa: E402
from rewriter.codegen.aot import compile_for, record_launches  # noqa: E402
from rewriter.codegen.decode_attention import decode_attention  # noqa: E402
from rewriter.codegen.prefill_attention import prefill_attention  # noqa: E402
from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU  # noqa: E402

from conftest import make_model  # noqa: E402

FUSIONS = [FuseQKV, FuseSwiGLU, FuseAddRMSNorm, FuseRoPE]


def _launch_everything():
    """Every template in the specializations the runtime uses, plus generated kernels.
    Two layers and one decode step launch every specialization three layers and two steps
    do (the layers' kernels are alike; the steps' too)."""
    kw = dict(max_new_tokens=2, eos_token_id=[])
    llama = make_model("llama-gqa-3l", initializer_range=0.2, num_hidden_layers=2).to(torch.bfloat16)
    fused = rewriter.optimize(llama, passes=[p() for p in FUSIONS], backend="triton")
    fused.generate([[3, 17, 42, 5, 99], [1, 2]], **kw)
    fused.static_decode = True  # the CUDA-graph step: positions read from device memory
    fused.generate([[3, 17, 42]], **kw)
    gpt2 = make_model("gpt2-3l", initializer_range=0.5, n_layer=2)
    rewriter.optimize(gpt2, backend="triton").generate([[3, 17, 42]], **kw)  # pointwise groups
    q, kc = torch.randn(2, 8, 64, dtype=torch.bfloat16), torch.randn(2, 2, 300, 64, dtype=torch.bfloat16)
    index = torch.randint(-1, 300, (2, 2, 40))
    decode_attention(q, kc, kc, 300, 0.125, window=32, sinks=4, index=index)
    ring = torch.arange(260).expand(2, 2, 260)  # a sink + window ring's decode step
    decode_attention(q, kc, kc, 260, 0.125, index=ring, q_sink=q.clone(), sink_slots=4)
    k = torch.randn(2, 1, 2 * 64)
    rope.rope_into_cache(k, torch.randn(2, 1, 64), torch.randn(2, 1, 64), 64,
                         torch.zeros(2, 2, 16, 64), torch.tensor([5]))
    for dim in (64, 128):  # the GPU's prefill tile (the interpreter's default is 16)
        kc = torch.randn(1, 2, 70, dim, dtype=torch.bfloat16)
        cs = torch.randn(1, 70, dim, dtype=torch.bfloat16)
        prefill_attention(torch.randn(1, 70, 4 * dim, dtype=torch.bfloat16), kc, kc, 4,
                          dim ** -0.5, block=64, cos=cs, sin=cs)
    # a speculative round's tree at each row's own start, K rotated into the cache first
    starts, kc = torch.tensor([3, 9]), torch.zeros(2, 2, 40, 64, dtype=torch.bfloat16)
    cs = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    rope.rope_into_cache(torch.randn(2, 8, 2 * 64, dtype=torch.bfloat16), cs, cs, 64, kc, starts)
    prefill_attention(torch.randn(2, 8, 4 * 64, dtype=torch.bfloat16), kc, kc, 4, 0.125,
                      q_start=starts, block=64, cos=cs, sin=cs,
                      tree=torch.tensor([1 << i | 1 for i in range(8)]))


def test_every_kernel_the_backend_launches_compiles_for_sm90_without_spills():
    with record_launches(90) as launches:
        _launch_everything()
    names = {x.name for x in launches}
    assert {"add_rms_norm_kernel", "swiglu_kernel", "rope_kernel", "prefill_attention_kernel",
            "decode_attention_split_kernel", "decode_attention_combine_kernel"} <= names
    assert any(n.startswith("pointwise_") for n in names)
    reports = compile_for(launches, 90)
    failed = [f"{r.name} {r.constexprs}: {r.error}" for r in reports if not r.ok]
    assert not failed, "\n".join(failed)
    spilled = [f"{r.name} {r.constexprs}: {r.stack_bytes} B" for r in reports if r.stack_bytes]
    assert not spilled, spilled
    assert all(r.registers is not None and r.stack_bytes is not None for r in reports)
    seen = {(r.name, k, v) for r in reports for k, v in r.constexprs.items()}
    for variant in [("decode_attention_split_kernel", "HAS_INDEX", "True"),
                    ("decode_attention_split_kernel", "END_FROM_PTR", "True"),
                    ("rope_kernel", "START_FROM_PTR", "True"),
                    ("rope_kernel", "HAS_V", "True"),
                    ("decode_attention_split_kernel", "HAS_ROPE", "True"),
                    ("decode_attention_split_kernel", "HAS_SINK_Q", "True"),
                    ("prefill_attention_kernel", "HAS_ROPE", "True"),
                    ("prefill_attention_kernel", "BLOCK_M", "64"),
                    ("prefill_attention_kernel", "QSTART_PER_ROW", "True"),
                    ("prefill_attention_kernel", "HAS_TREE", "True"),
                    ("decode_attention_split_kernel", "DOT_F32", "False")]:
        assert variant in seen, variant
    assert not any(k == "DOT_F32" and v == "True" for _, k, v in seen)  # GPU builds only


def _kernel_from_source(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


LOOP_TYPE = '''
import triton
import triton.language as tl


@triton.jit
def loop_type_kernel(x_ptr, n):
    acc = 0  # int32 before the loop, fp32 inside it
    for i in range(0, n):
        acc += tl.load(x_ptr + i)
    tl.store(x_ptr, acc)
'''

HUGE_TILES = '''
import triton
import triton.language as tl


@triton.jit
def huge_tiles_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + i[:, None] * BLOCK + i[None, :]).to(tl.float32)
    b = tl.load(a_ptr + i[None, :] * BLOCK + i[:, None]).to(tl.float32)
    c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))  # two 256x256 bf16 tiles: 256 KiB
    tl.store(out_ptr + i[:, None] * BLOCK + i[None, :], c)
'''


def test_a_kernel_the_interpreter_runs_but_the_gpu_compiler_rejects_is_reported(tmp_path):
    kernel = _kernel_from_source(tmp_path, "loop_type_kernel", LOOP_TYPE)
    x = torch.ones(8)
    with record_launches() as launches:
        kernel[(1,)](x, 8)
    assert x[0] == 8  # the interpreter ran it
    (report,) = compile_for(launches, 90)
    assert not report.ok and "Loop-carried variable acc" in report.error
    assert report.name == "loop_type_kernel"


def test_a_kernel_over_the_shared_memory_limit_is_reported(tmp_path):
    kernel = _kernel_from_source(tmp_path, "huge_tiles_kernel", HUGE_TILES)
    a = torch.randn(256, 256)
    out = torch.empty_like(a)
    with record_launches() as launches:
        kernel[(1,)](a, out, BLOCK=256)  # (not checked: the interpreter's bf16 dot is wrong)
    (report,) = compile_for(launches, 90)
    assert not report.ok and "shared memory" in report.error, report


NO_SPECIALIZE = '''
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def no_specialize_kernel(x_ptr, n):
    tl.store(x_ptr, n)
'''


def test_the_decorators_options_shape_the_recorded_signature(tmp_path):
    kernel = _kernel_from_source(tmp_path, "no_specialize_kernel", NO_SPECIALIZE)
    x = torch.zeros(1, dtype=torch.int32)
    with record_launches() as launches:
        kernel[(1,)](x, 1)  # 1 would be a constexpr, were `n` specialized
    assert '"n": "i32"' in launches[0].signature


def test_a_specialization_is_listed_once():
    x = torch.randn(3, 40)
    from rewriter.codegen import norm
    w = torch.randn(40)
    with record_launches() as launches:
        for _ in range(3):
            norm.rms_norm(x, w, 1e-6)
        norm.rms_norm(torch.randn(3, 100), torch.randn(100), 1e-6)  # another BLOCK
    assert len(launches) == 2


def test_a_compile_that_runs_too_long_is_stopped_with_its_process_group():
    from rewriter.codegen import norm
    with record_launches() as launches:
        norm.rms_norm(torch.randn(2, 40), torch.randn(40), 1e-6)
    with pytest.raises(RuntimeError, match="took over"):
        compile_for(launches, 90, timeout=0.2)
