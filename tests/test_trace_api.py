"""``rewriter.trace`` then ``rewriter.optimize(traced, passes)``: one trace, many pipelines,
each on its own copy of the IR, each equal to optimizing the model directly."""
from __future__ import annotations

import pytest
import torch

import rewriter
from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU, LayerSkip, PromptLookup

from conftest import make_model, varied_init

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("trace_api")

NAME = "llama-gqa-3l"
IDS = torch.tensor([[5, 17, 3, 99, 42, 8, 61], [11, 2, 2, 7, 90, 33, 4]])


def pipelines():
    """Fresh passes each call: a pass object is not shared between two optimizes."""
    return {"fusions": [FuseQKV(), FuseSwiGLU(), FuseAddRMSNorm(), FuseRoPE()],
            "layer skip": [LayerSkip(layers=[1])],
            "prompt lookup": [PromptLookup(tokens=3)]}


@pytest.fixture(scope="module")
def model():
    return make_model(NAME, initializer_range=varied_init(NAME))


@pytest.fixture(scope="module")
def traced(model):
    return rewriter.trace(model)


def unmeasured(info: dict) -> dict:
    """``info`` without the round costs a speculative strategy times on this machine (two
    timings never agree)."""
    decoding = {k: v for k, v in (info.get("decoding") or {}).items() if k != "costs"}
    return {**info, "decoding": decoding}


def greedy(opt) -> list[list[int]]:
    return opt.generate(IDS, max_new_tokens=12, eos_token_id=[]).tolist()


@pytest.mark.parametrize("name", list(pipelines()))
def test_traced_equals_optimizing_the_model(model, traced, name):
    """Same IR text (node names included), same info, same greedy tokens."""
    direct = rewriter.optimize(model, pipelines()[name])
    from_trace = rewriter.optimize(traced, pipelines()[name])
    assert str(from_trace.ir) == str(direct.ir)
    assert unmeasured(from_trace.ir.info) == unmeasured(direct.ir.info)
    assert greedy(from_trace) == greedy(direct)


def test_pipelines_from_one_trace_leave_each_other_alone(traced):
    lifted = str(traced.ir)
    fused = rewriter.optimize(traced, pipelines()["fusions"])
    fused_text, fused_tokens = str(fused.ir), greedy(fused)
    skipped = rewriter.optimize(traced, pipelines()["layer skip"])
    assert str(skipped.ir) != fused_text  # the second pipeline did change its own copy
    assert len(skipped.ir.layers) == len(fused.ir.layers) - 1
    assert str(fused.ir) == fused_text and greedy(fused) == fused_tokens
    assert str(traced.ir) == lifted
    assert fused.ir.gm is not skipped.ir.gm
    plain = rewriter.optimize(traced)  # the lifted IR, no pass: nothing fused, no layer gone
    assert str(plain.ir) == lifted


def test_copies_share_the_weights(traced):
    """A copy costs graph objects, not memory: its weights are the traced model's."""
    a, b = traced.ir, traced.ir
    assert a.gm is not b.gm and a.graph is not b.graph and a.info is not b.info
    for name, weight in a.weights().items():
        assert b.weight(name) is weight


def test_the_traced_tokenizer_is_kept():
    model, tokenizer = rewriter.default_model()
    traced = rewriter.trace(model, tokenizer=tokenizer)
    opt = rewriter.optimize(traced)
    assert opt.tokenizer is not None
    assert opt.tokenizer.encode("def f(x):").ids == tokenizer.encode("def f(x):")
    assert "TracedModel(rewriter IR" in repr(traced) and "s to trace" in repr(traced)


def test_bad_arguments(model, traced):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module .* got str"):
        rewriter.trace("smollm2")
    with pytest.raises(ValueError, match="check"):
        rewriter.trace(model, check="yes")
    with pytest.raises(TypeError, match="tokenizer"):
        rewriter.trace(model, tokenizer=42)
    with pytest.raises(ValueError, match="example_inputs: the model is traced already"):
        rewriter.optimize(traced, example_inputs=(IDS,))
    with pytest.raises(TypeError, match="passes must be a list"):
        rewriter.optimize(traced, "fuse_qkv")


@pytest.mark.parametrize("inputs, shown", [(5, "got int"), (("a",), r"got \[str\]"), ((), r"got \[\]")])
def test_example_inputs_that_are_no_tensors_are_named(inputs, shown):
    from rewriter.errors import TraceError
    with pytest.raises(TraceError, match=f"example_inputs must be a non-empty tuple or list of tensors, {shown}"):
        rewriter.trace(torch.nn.Linear(4, 4), example_inputs=inputs)
    with pytest.raises(TraceError, match=r"to rewriter.trace\(\) or optimize\(\)"):
        rewriter.trace(torch.nn.Linear(4, 4))
