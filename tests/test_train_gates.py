"""DuoAttention's calibration: the gated graph, the gates file it writes, resuming, the CLI."""
import json

import pytest
import torch

import rewriter
from rewriter.drafts import duo_gates
from rewriter.cli import main
from rewriter.passes import DuoAttention, StreamingAttention
from rewriter.training.train_gates import _inputs, gated_program, train_gates

from conftest import make_model

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("train_gates")


@pytest.fixture(scope="module")
def default():
    model, tok = rewriter.default_model()
    return rewriter.optimize(model, tokenizer=tok), tok


@pytest.fixture(scope="module")
def gqa():
    """A small GQA model with large weights (its gates matter) and its engine, traced once."""
    model = make_model("llama-gqa-3l", initializer_range=0.2)
    return model, rewriter.optimize(model)


def _hidden(opt, ids):
    """The whole-sequence graph's LM-head input for ``ids``."""
    return gated_program(opt.ir)(*_inputs(opt.ir, ids))


def test_binary_gates_give_the_model_duo_attention_makes(gqa):
    model, opt = gqa
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    gates = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    gated = gated_program(opt.ir, sinks=2, window=4, gates=gates)
    split = rewriter.optimize(model, passes=[DuoAttention(gates.tolist(), sinks=2, window=4)])
    torch.testing.assert_close(gated(gates, *_inputs(opt.ir, ids)), _hidden(split, ids))


def test_a_bfloat16_model_calibrates(default, tmp_path):
    model, tok = rewriter.default_model()
    opt = rewriter.optimize(model.to(torch.bfloat16), tokenizer=tok)
    record = train_gates(opt, tok, tmp_path / "g.json", steps=1, sinks=4, window=8,
                         lengths=(96,), progress=False)
    assert record["steps"] == 1 and duo_gates.load(tmp_path / "g.json").model["layers"] == 8


def test_gates_at_one_give_the_full_model_and_at_zero_the_streaming_one(gqa):
    model, opt = gqa
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    inputs = _inputs(opt.ir, ids)
    gated = gated_program(opt.ir, sinks=2, window=4, gates=torch.ones(3, 2))
    torch.testing.assert_close(gated(torch.ones(3, 2), *inputs), _hidden(opt, ids))
    streaming = rewriter.optimize(model, passes=[StreamingAttention(sinks=2, window=4)])
    torch.testing.assert_close(gated(torch.zeros(3, 2), *inputs), _hidden(streaming, ids))
    assert not torch.allclose(_hidden(streaming, ids), _hidden(opt, ids))


def test_calibration_writes_gates_that_load_and_resumes(default, tmp_path):
    opt, tok = default
    kw = dict(sinks=4, window=16, lengths=(96, 128), seed=3, progress=False)
    record = train_gates(opt, tok, tmp_path / "g.json", steps=3, **kw)
    gates = duo_gates.load(tmp_path / "g.json")
    assert (gates.sinks, gates.window) == (4, 16) and gates.calibration["steps"] == 3
    assert len(gates.gates) == 8 and all(len(r) == 2 for r in gates.gates)
    assert all(0 <= g <= 1 for r in gates.gates for g in r)
    assert any(g < 1 for r in gates.gates for g in r)  # the L1 term moved them off their start
    assert record["seed"] == 3
    # three more steps resume from the checkpoint: the same gates as six in one go
    assert train_gates(opt, tok, tmp_path / "g.json", steps=6, **kw)["resumed_at"] == 3
    assert train_gates(opt, tok, tmp_path / "h.json", steps=6, **kw)["resumed_at"] == 0
    assert duo_gates.load(tmp_path / "g.json").gates == duo_gates.load(tmp_path / "h.json").gates
    assert duo_gates.load(tmp_path / "g.json").gates != gates.gates
    engine = rewriter.optimize(rewriter.default_model()[0],
                               passes=[DuoAttention(str(tmp_path / "g.json"), sparsity=0.5)])
    assert sum(len(s) for s in DuoAttention(str(tmp_path / "g.json"), sparsity=0.5).full_heads()) == 8
    assert "full_heads" in str(engine.ir) or "sinks=4" in str(engine.ir)


@pytest.mark.parametrize("kwargs,match", [({"sinks": -1}, "sinks"), ({"window": 0}, "window"),
                                          ({"steps": 0}, "steps"), ({"lr": float("nan")}, "lr"),
                                          ({"lengths": (4096,)}, "lengths"),
                                          ({"lengths": ()}, "lengths"),
                                          ({"sinks": 64, "window": 64, "lengths": (128,)},
                                           "shortest length"),
                                          ({"positions": "middle"}, "positions")])
def test_bad_settings_name_themselves(default, tmp_path, kwargs, match):
    opt, tok = default
    with pytest.raises(ValueError, match=match):
        train_gates(opt, tok, tmp_path / "g.json", progress=False, **kwargs)


def test_the_output_must_be_a_file_in_a_directory(default, tmp_path):
    opt, tok = default
    with pytest.raises(ValueError, match="existing directory"):
        train_gates(opt, tok, tmp_path, steps=1, progress=False)
    with pytest.raises(ValueError, match="existing directory"):
        train_gates(opt, tok, tmp_path / "no" / "g.json", steps=1, progress=False)


def test_the_cli_calibrates(default, tmp_path, capsys, monkeypatch):
    """The command calibrates the default model (traced once for the file, not again)."""
    monkeypatch.setattr(rewriter.api.optimized, "optimize", lambda model, **kw: default[0])
    out = tmp_path / "g.json"
    assert main(["train-gates", "default", "--out", str(out), "--steps", "1", "--lengths", "96",
                 "--sinks", "4", "--window", "8"]) == 0
    assert json.loads(out.read_text())["format"] == "rewriter-duo-gates"
    assert "saved" in capsys.readouterr().out
