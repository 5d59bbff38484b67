"""The IR as text: a golden dump of a 2-layer Llama after lifting, and the dump files.

Regenerate the golden file after an intended change with
``REWRITER_UPDATE_GOLDEN=1 pytest tests/test_ir_text.py``, and read the diff.
"""
import json
import os
from pathlib import Path

import torch

import rewriter
from conftest import make_model
from rewriter.passes import LayerSkip

GOLDEN = Path(__file__).parent / "golden" / "llama_2layer_lifted.txt"


def test_lifted_two_layer_llama_prints_as_the_golden_text():
    model = make_model("llama-gqa-3l", num_hidden_layers=2)
    text = str(rewriter.optimize(model).ir)
    if os.environ.get("REWRITER_UPDATE_GOLDEN"):
        GOLDEN.write_text(text + "\n")
    assert text + "\n" == GOLDEN.read_text()


def test_every_line_names_op_shape_and_layer():
    model = make_model("llama-gqa-3l", num_hidden_layers=2)
    lines = str(rewriter.optimize(model).ir).splitlines()
    attn = [ln for ln in lines if "rw.attention(" in ln]
    assert len(attn) == 2
    assert "layer=1" in attn[1] and "f32[B, S, 64]" in attn[1] and "# L1 attn" in attn[1]


def test_dump_writes_text_dot_and_diff_for_every_pass(tmp_path):
    model = make_model("llama-gqa-3l")
    opt = rewriter.optimize(model, passes=[LayerSkip(layers=[1])])
    opt.dump(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["00_lift.diff.txt", "00_lift.dot", "00_lift.txt",
                     "01_LayerSkip.diff.txt", "01_LayerSkip.dot", "01_LayerSkip.txt",
                     "programs", "summary.json"]
    # the code the runtime runs, and the caches it allocates (by layer id: 1 was skipped)
    assert sorted(p.name for p in (tmp_path / "programs").iterdir()) == \
        ["caches.json", "decode.py", "prefill.py"]
    assert "cached_attention" in (tmp_path / "programs" / "decode.py").read_text()
    caches = json.loads((tmp_path / "programs" / "caches.json").read_text())
    assert [c["id"] for c in caches["caches"]] == [0, 2] and caches["dtype"] == "float32"
    lift_text = (tmp_path / "00_lift.txt").read_text()
    skip_text = (tmp_path / "01_LayerSkip.txt").read_text()
    assert "# L1 attn" in lift_text and "# L1" not in skip_text  # dumps are per pass
    assert (tmp_path / "01_LayerSkip.dot").read_text().startswith("strict digraph")
    diff = (tmp_path / "01_LayerSkip.diff.txt").read_text()
    assert "rw.attention: -1" in diff and "rw.linear: -7" in diff
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["pass"] for s in summary] == ["lift", "LayerSkip"]
    assert summary[1]["diff"]["rw.attention"] == {"removed": 1}
    assert summary[1]["layers"] == [0, 2]


def test_rewriter_dump_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("REWRITER_DUMP", str(tmp_path / "d"))
    rewriter.optimize(make_model("gpt2-3l"), passes=[LayerSkip(speedup=1.5)])
    assert (tmp_path / "d" / "01_LayerSkip.txt").exists()
