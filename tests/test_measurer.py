"""The measuring protocol: passes that choose by timing ask a ``Measurer``
(``rewriter.ir.pass_manager``) that the pipeline hands them, import nothing from the
runtime, refuse to guess without one, and record where the timings were taken."""
import copy
import warnings

import pytest
import torch

import rewriter
from rewriter.cli import main
from rewriter.errors import PassError
from rewriter.ir.pass_manager import run_pipeline
from rewriter.passes import MedusaHeads, PromptLookup, SelfSpeculative
from rewriter.runtime.artifact_info import check_info
from rewriter.runtime.measurer import RuntimeMeasurer

from conftest import make_model, varied_init

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("measurer")

WHERE = {"backend": "torch", "device": "cpu", "machine": "a test's machine"}


class Flat:
    """A measurer whose every step costs one decode step: plain values, no runtime."""

    def __init__(self):
        self.asked = []

    def where(self) -> dict:
        return dict(WHERE)

    def verify_cost(self, ir, most, runs=15, batch=1):
        self.asked.append(("verify", most, batch))
        return [0.0] + [1.0] * most

    def heads_cost(self, ir, num_heads, hydra, runs=15, batch=1):
        self.asked.append(("heads", num_heads, batch))
        return 0.0

    def round_times(self, ir, record, batches, vocab=None):
        self.asked.append(("rounds", tuple(batches)))
        return {b: {"decode": 1.0, "plain": 1.0, "round": 1.0, "fixed": 0.0, "rounds": 8}
                for b in batches}


@pytest.fixture(scope="module")
def lifted():
    name = "llama-gqa-3l"
    return rewriter.optimize(make_model(name, initializer_range=varied_init(name))).ir


def test_measuring_passes_without_a_measurer_name_themselves(lifted):
    for p in (PromptLookup(tokens=3), SelfSpeculative(calibrate=[[3, 17, 42, 5, 9, 8]])):
        with pytest.raises(PassError, match=rf"{type(p).__name__}\(.*needs a measurer: "
                                            r"rewriter.optimize\(\) gives one"):
            p.run(copy.deepcopy(lifted))
        with pytest.raises(PassError, match=rf"pass {type(p).__name__}.*needs a measurer"):
            run_pipeline(copy.deepcopy(lifted), [p])
    # choices that time nothing need none, called directly or in a pipeline
    ir = copy.deepcopy(lifted)
    PromptLookup(tokens=3, adapt=False).run(ir)
    assert ir.info["decoding"]["lookup"] == 3 and "measured_on" not in ir.info
    ir = copy.deepcopy(lifted)
    run_pipeline(ir, [MedusaHeads(num_heads=2, tree=[[0], [1], [0, 0]])])
    assert "measured_on" not in ir.info


def test_the_pipeline_hands_its_measurer_over_and_the_ir_says_where_it_timed(lifted):
    flat, ir = Flat(), copy.deepcopy(lifted)
    run_pipeline(ir, [PromptLookup(tokens=3)], measurer=flat)
    assert ("rounds", (1, 2, 4, 8)) in flat.asked
    assert {b for kind, _, b in (a for a in flat.asked if a[0] == "verify")} == {1, 2, 4, 8}
    assert ir.info["decoding"]["costs"][0] == [1, [1.0] * 4]  # every round a plain step
    assert ir.info["measured_on"] == {**WHERE, "passes": ["PromptLookup"]}
    check_info({**ir.info, "passes": []})  # a key the artifact's loader knows


def test_optimize_times_on_the_models_backend_and_device_and_artifacts_keep_it(tmp_path, monkeypatch,
                                                                               capsys):
    made = []
    real = RuntimeMeasurer.__init__
    monkeypatch.setattr(RuntimeMeasurer, "__init__", lambda self, *a, **k: (
        made.append(a), real(self, *a, **k))[1])
    for name in ("verify_cost", "heads_cost", "round_times"):
        monkeypatch.setattr(RuntimeMeasurer, name, lambda self, *a, name=name, **k:
                            getattr(Flat(), name)(*a, **k))
    model = make_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    opt = rewriter.optimize(model, passes=[PromptLookup(tokens=3)])
    assert made == [("torch", torch.device("cpu"))]
    where = opt.ir.info["measured_on"]
    assert where == {**RuntimeMeasurer("torch", "cpu").where(), "passes": ["PromptLookup"]}
    assert where["machine"] and where["device"] == "cpu"
    opt.save(tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # loaded where it was measured: quiet
        assert rewriter.load(tmp_path / "a").ir.info["measured_on"] == where
    assert main(["info", str(tmp_path / "a")]) == 0
    assert f"torch backend, cpu ({where['machine']}) by PromptLookup" in capsys.readouterr().out
    monkeypatch.setattr("rewriter.measure.machine.machine", lambda: "another machine")
    with pytest.warns(RuntimeWarning, match="PromptLookup chose its decoding by timings of the "
                      "torch backend on .* this engine runs torch on another machine"):
        rewriter.load(tmp_path / "a")
    # Triton on a CPU runs in its interpreter, whose costs match no engine: torch is timed
    made.clear()
    rewriter.optimize(model, passes=[PromptLookup(tokens=3)], backend="triton")
    assert made == [("torch", torch.device("cpu"))]


@pytest.mark.parametrize("bad", [{**WHERE}, {**WHERE, "passes": "PromptLookup"},
                                 {**WHERE, "device": 0, "passes": []}, [], "cpu"])
def test_a_malformed_measured_on_is_refused_by_name(lifted, bad):
    with pytest.raises(ValueError, match="measured_on must be"):
        check_info({**lifted.info, "passes": [], "measured_on": bad})


def test_the_runtime_measurer_refuses_what_it_cannot_time(lifted):
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        RuntimeMeasurer("tpu")
    with pytest.raises(ValueError, match="static must be"):
        RuntimeMeasurer("torch", "cpu", static="yes")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="times programs on cuda, the IR's weights are on cpu"):
            RuntimeMeasurer("torch", "cuda").verify_cost(lifted, 2, runs=1)
    else:
        with pytest.raises(ValueError, match="this machine has no CUDA device"):
            RuntimeMeasurer("torch", "cuda")
    for device in ("gpu", None, 3.5):
        with pytest.raises(ValueError, match="is not a device"):
            RuntimeMeasurer("torch", device)
    for bad in ({"most": 0}, {"runs": 0}, {"batch": 1.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an int >= 1"):
            RuntimeMeasurer("torch", "cpu").verify_cost(lifted, **{"most": 2, **bad})
    cost = RuntimeMeasurer("torch", "cpu").verify_cost(lifted, 2, runs=1)
    assert len(cost) == 3 and cost[1] == 1.0



def test_a_triton_artifact_timed_with_torch_on_a_cpu_loads_here_without_a_warning(tmp_path, monkeypatch):
    """On a CPU optimize times the torch kernels for backend='triton' (its interpreter's
    costs match no engine): loading that artifact here is not "measured elsewhere"."""
    pytest.importorskip("triton")
    for name in ("verify_cost", "heads_cost", "round_times"):
        monkeypatch.setattr(RuntimeMeasurer, name, lambda self, *a, name=name, **k:
                            getattr(Flat(), name)(*a, **k))
    model = make_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    rewriter.optimize(model, passes=[PromptLookup(tokens=3)], backend="triton").save(tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert rewriter.load(tmp_path / "a").ir.info["measured_on"]["backend"] == "torch"
