"""The README's main job, ``examples/quickstart.py``: its default run shows a lossless
pipeline beside the reference, and runs end to end (the default model stands in for
SmolLM2)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"


@pytest.fixture(scope="module")
def quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", ["smollm2", "default"])
def test_the_default_run_shows_a_lossless_pipeline(quickstart, model):
    every = quickstart.pipelines(model)
    chosen = [name for name in quickstart.QUICK if name in every]
    assert chosen[:2] == ["unoptimized", "fusions (lossless)"]  # the reference, the IR shown
    assert quickstart.lossless("fusions (lossless)", model)
    if model == "smollm2":  # and the fastest lossless pipeline for the main job's model
        assert any(quickstart.lossless(name, model) for name in chosen[2:])
    assert any(not quickstart.lossless(name, model) for name in chosen[1:])  # a loss to compare
    assert len(chosen) < len(every)  # the rest behind --full


def test_only_smollm2_has_lossless_4bit_weights(quickstart):
    assert quickstart.lossless("fusions + Int4Weights, bf16", "smollm2")
    assert not quickstart.lossless("fusions + Int4Weights, bf16", "default")
    assert not quickstart.lossless("LayerSkip(speedup=1.25)", "smollm2")


@pytest.mark.slow
def test_the_default_run_end_to_end(quickstart, capsys):
    quickstart.main(["--model", "default"])
    out = capsys.readouterr().out
    every = quickstart.pipelines("default")
    chosen = [name for name in quickstart.QUICK if name in every]
    assert "# rewriter IR · llama" in out and "# ── layer 0" in out  # the IR
    assert "greedy agree" in out  # the table
    assert "measured on: perplexity, 2 chunks of 128 tokens" in out
    assert "lossless         the model's own greedy tokens" in out  # and its legend
    for name in chosen:
        assert f"\n{name} " in out  # its row
        assert f"A ({name}, " in out  # its answer
    assert "every pipeline and the full evaluation: --full" in out
