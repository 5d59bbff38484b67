"""The command line and checkpoint loading: optimize a checkpoint directory into an
artifact, inspect it, run it; bad input is one line on stderr and exit status 2."""
import subprocess
import sys

import pytest
import torch

import rewriter
from rewriter.cli import main

from artifact_tools import artifact_files
from conftest import hf_greedy, make_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Hugging Face checkpoint directory (config.json + safetensors) and its model."""
    model = make_model("qwen2-mqa-3l", initializer_range=0.2)
    path = tmp_path_factory.mktemp("ckpt") / "qwen"
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "art"
    assert main(["optimize", str(checkpoint[0]), "--pass", "layer_skip:layers=[1]", "--out", str(out)]) == 0
    return out


def test_from_pretrained_generates_like_the_checkpoint(checkpoint):
    path, model = checkpoint
    opt = rewriter.from_pretrained(path)
    ids = torch.tensor([[5, 9, 2, 77, 31]])
    assert torch.equal(opt.generate(ids, max_new_tokens=16, eos_token_id=[]), hf_greedy(model, ids, 16))


def test_optimize_writes_an_artifact_with_the_pass(artifact, capsys):
    assert main(["info", str(artifact)]) == 0
    out = capsys.readouterr().out
    assert "LayerSkip(layers=[1])" in out and "qwen2, 2 layers" in out
    assert main(["ir", str(artifact)]) == 0
    assert "rw.attention" in capsys.readouterr().out


def test_run_prints_the_engines_tokens(artifact, capsys):
    expect = rewriter.load(artifact).generate([[1, 2, 3]], max_new_tokens=5)[0].tolist()
    for extra in ([], ["--no-stream"], ["--prefill-chunk", "16"]):
        assert main(["run", str(artifact), "--ids", "1,2,3", "--max-new-tokens", "5", *extra]) == 0
        assert capsys.readouterr().out.split() == [str(t) for t in expect]


def test_run_with_the_default_model_and_a_text_prompt(capsys):
    assert main(["run", "default", "--prompt", "import os", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("import os")


@pytest.mark.parametrize("argv,message", [
    (["optimize", "no/such/dir", "--out", "X"], "no/such/dir: no such checkpoint directory"),
    (["optimize", "default", "--pass", "layer_drop", "--out", "X"], "unknown pass 'layer_drop'"),
    (["optimize", "default", "--pass", "layer_skip:speedup=0.5", "--out", "X"], "speedup must be >= 1"),
    (["optimize", "default", "--pass", "layer_skip:layers=[9]", "--out", "X"], "layer 9 is out of range"),
    (["run", "no/such/dir", "--ids", "1"], "no such artifact or checkpoint"),
    (["info", "no/such/dir"], "no such artifact directory"),
])
def test_bad_input_is_one_line_and_status_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in err if line.startswith("rewriter:")]
    assert errors == [err[-1]] and errors[0].startswith("rewriter: error: ") and message in errors[0]
    assert not (tmp_path / "X").exists()  # nothing half-written


def test_corrupt_artifact_is_reported(artifact, tmp_path, capsys):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)
    with open(artifact_files(bad)["weights.safetensors"], "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    assert main(["run", str(bad), "--ids", "1"]) == 2
    assert "weights.safetensors: checksum mismatch" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["optimize", "run", "ir", "info"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0 and "usage: rewriter " + command in capsys.readouterr().out


def test_the_installed_command_exits_nonzero_on_bad_input():
    r = subprocess.run([sys.executable, "-m", "rewriter", "info", "missing-dir"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "rewriter: error: missing-dir: no such artifact directory"
