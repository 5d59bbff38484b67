"""Every documented error: its type, and a message that names the problem."""
import pytest
import torch

import rewriter
from conftest import make_model, traced_model
from rewriter.passes import LayerSkip
from test_frontend import TinyMLP


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # branches on data: no single graph exists
            return x * 2
        return x - 1


def test_untraceable_module_raises_trace_error_naming_it():
    with pytest.raises(rewriter.TraceError, match=r"cannot trace DataDependent: .+"):
        rewriter.optimize(DataDependent(), example_inputs=(torch.randn(3, 4),))


def test_non_lm_module_without_example_inputs_raises_trace_error():
    with pytest.raises(rewriter.TraceError, match=r"TinyMLP.*example_inputs"):
        rewriter.optimize(TinyMLP())


def test_layer_skip_on_a_model_without_layers_raises_pass_error():
    with pytest.raises(rewriter.PassError, match=r"LayerSkip\(layers=\[0\]\) needs decoder layers"):
        rewriter.optimize(TinyMLP(), passes=[LayerSkip(layers=[0])],
                          example_inputs=(torch.randn(2, 12),))


class Explodes(rewriter.Pass):
    def run(self, ir):
        raise RuntimeError("boom")


class BreaksIR(rewriter.Pass):
    def run(self, ir):  # removes a weight some node still reads
        delattr(ir.gm.lm_head, "weight")
        return ir


def test_failing_pass_error_names_the_pass_and_the_passes_before_it():
    _, traced = traced_model("llama-gqa-3l")
    with pytest.raises(rewriter.PassError) as err:
        rewriter.optimize(traced, passes=[LayerSkip(layers=[1]), Explodes()])
    assert "pass Explodes() failed: boom" in str(err.value)
    assert "passes before it: lift, LayerSkip(layers=[1])" in str(err.value)


def test_pass_leaving_a_broken_ir_is_caught_by_verification():
    _, traced = traced_model("llama-gqa-3l")
    with pytest.raises(rewriter.PassError, match=r"BreaksIR\(\) left an IR that does not verify"):
        rewriter.optimize(traced, passes=[BreaksIR()])


@pytest.mark.parametrize("kwargs,message", [
    (dict(speedup=0.5), "speedup must be >= 1, got 0.5"),
    (dict(speedup="fast"), "speedup must be a number"),
    (dict(), "exactly one of layers"),
    (dict(layers=[1], speedup=2.0), "exactly one of layers"),
    (dict(layers=[-1]), "non-negative integers, got -1"),
    (dict(layers=[1, 1]), "names a layer twice"),
    (dict(layers=[]), "skips nothing"),
])
def test_bad_layer_skip_parameters_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerSkip(**kwargs)


def test_layer_index_out_of_range_raises_value_error():
    _, traced = traced_model("llama-gqa-3l")
    with pytest.raises(ValueError, match=r"layer 7 is out of range; the model has layers 0..2"):
        rewriter.optimize(traced, passes=[LayerSkip(layers=[7])])


def test_skipping_every_layer_raises_value_error():
    _, traced = traced_model("llama-gqa-3l")
    with pytest.raises(ValueError, match=r"would skip every layer"):
        rewriter.optimize(traced, passes=[LayerSkip(layers=[0, 1, 2])])


def test_unknown_backend_and_non_pass_raise():
    model = make_model("llama-gqa-3l")  # a module: both are refused before it is traced
    with pytest.raises(ValueError, match="unknown backend 'tpu'; available: torch"):
        rewriter.optimize(model, backend="tpu")
    with pytest.raises(TypeError, match=r"passes\[0\] is 'layer_skip', not a rewriter Pass"):
        rewriter.optimize(model, passes=["layer_skip"])


def test_token_ids_outside_the_vocabulary_are_rejected(optimized_cache):
    _, opt = optimized_cache("llama-gqa-3l")
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        opt(torch.tensor([[1, 2, 500]]))
