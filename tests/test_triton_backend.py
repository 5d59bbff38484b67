"""``backend="triton"``: the step programs run the Triton templates (under the interpreter
on this CPU) and give the same greedy tokens as ``backend="torch"``."""
import pytest
import torch

pytest.importorskip("triton")

import rewriter  # noqa: E402
from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseSwiGLU, LayerSkip  # noqa: E402

from conftest import make_model  # noqa: E402

FUSIONS = [FuseQKV, FuseSwiGLU, FuseAddRMSNorm]
ROWS = [[3, 17, 42, 5, 99, 8, 64], [1, 2, 3], [50, 60, 70, 80, 90]]


@pytest.mark.parametrize("config,fused", [("llama-gqa-3l", True), ("llama-gqa-3l", False),
                                          ("mistral-window-3l", True), ("qwen2-hd20-2l", True)])
def test_triton_greedy_tokens_equal_torch(config, fused):
    model = make_model(config, initializer_range=0.2)
    passes = [p() for p in FUSIONS] if fused else []
    ref = rewriter.optimize(model, passes=passes)
    tri = rewriter.optimize(model, passes=passes, backend="triton")
    kw = dict(max_new_tokens=12, eos_token_id=[])
    assert torch.equal(tri.generate(ROWS, **kw), ref.generate(ROWS, **kw))


def test_triton_artifact_round_trip(tmp_path):
    model = make_model("llama-gqa-3l", initializer_range=0.2)
    tri = rewriter.optimize(model, passes=[LayerSkip(layers=[1]), FuseQKV()], backend="triton")
    tri.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.backend == "triton"
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert torch.equal(loaded.generate(ROWS[:1], **kw), tri.generate(ROWS[:1], **kw))
    assert rewriter.load(tmp_path / "a", backend="torch").backend == "torch"


def test_triton_on_a_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        rewriter.optimize(make_model("llama-gqa-3l"), backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_cuda_matches_torch_on_cuda():
    model = make_model("llama-gqa-3l", initializer_range=0.2).cuda()
    ref = rewriter.optimize(model, passes=[p() for p in FUSIONS])
    tri = rewriter.optimize(model, passes=[p() for p in FUSIONS], backend="triton")
    kw = dict(max_new_tokens=16, eos_token_id=[])
    assert torch.equal(tri.generate(ROWS, **kw), ref.generate(ROWS, **kw))
