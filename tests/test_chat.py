"""Tokenizer and chat template in every path: optimize(tokenizer=...), GGUF files, Hugging
Face directories, artifacts, ``Engine.chat`` and ``rewriter run --chat``."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import rewriter
from rewriter.models.checkpoints import DEFAULT_MODEL_DIR
from rewriter.cli import main
from rewriter.errors import ArtifactError, RewriterError
from artifact_tools import reseal, version_dir
from gguf_tools import write_llama_gguf

CHAT = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
QUESTION = "def f(x): return"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"),
                                   bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   chat_template=CHAT)


@pytest.fixture(scope="module")
def opt(model, hf_tokenizer):
    return rewriter.optimize(model, tokenizer=hf_tokenizer)


def hf_answer(model, tok, question: str, n: int) -> str:
    """Hugging Face's own chat path: apply_chat_template, generate, decode the new tokens."""
    ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=0, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_chat_answers_like_hugging_face_apply_chat_template(opt, model, hf_tokenizer):
    assert opt.text.chat_template == CHAT
    assert opt.text.special_tokens["bos_token"] == "<|endoftext|>"
    for question in (QUESTION, "import os\n", "hello"):
        assert opt.chat(question, max_new_tokens=12) == hf_answer(model, hf_tokenizer, question, 12)


def test_chat_takes_a_message_list(opt):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert isinstance(opt.chat(messages, max_new_tokens=4), str)
    for bad in ([], [{"role": "user"}], [{"role": 1, "content": "x"}], ["hi"]):
        with pytest.raises(ValueError, match="messages"):
            opt.chat(bad, max_new_tokens=4)


def test_a_tokenizer_without_template_cannot_chat_and_says_so(model):
    from tokenizers import Tokenizer
    traced = rewriter.trace(model)  # one trace, 3 pipelines
    plain = rewriter.optimize(traced, tokenizer=Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")))
    with pytest.raises(RewriterError, match="no chat template"):
        plain.chat("hi")
    with pytest.raises(RewriterError, match="no tokenizer"):
        rewriter.optimize(traced).chat("hi")
    with pytest.raises(TypeError, match="tokenizer must be"):
        rewriter.optimize(traced, tokenizer="gpt2")


def test_the_artifact_keeps_tokenizer_and_template(opt, tmp_path):
    opt.save(tmp_path / "art")
    engine = rewriter.load(tmp_path / "art")
    assert engine.text == opt.text
    assert engine.chat(QUESTION, max_new_tokens=8) == opt.chat(QUESTION, max_new_tokens=8)


def test_run_chat_prints_the_answer_only(opt, tmp_path, capsys):
    opt.save(tmp_path / "art")
    assert main(["run", str(tmp_path / "art"), "--chat", QUESTION, "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out == opt.chat(QUESTION, max_new_tokens=8) + "\n"
    assert "<|user|>" not in out


def test_a_gguf_files_template_reaches_the_engine_and_the_cli(model, tmp_path, capsys):
    path = write_llama_gguf(model, DEFAULT_MODEL_DIR / "tokenizer.json", tmp_path / "m.gguf",
                            chat_template=CHAT)
    opt = rewriter.from_pretrained(path)
    assert opt.text.chat_template == CHAT
    answer = opt.chat(QUESTION, max_new_tokens=8)
    assert main(["run", str(path), "--chat", QUESTION, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == answer + "\n"
    assert main(["optimize", str(path), "--out", str(tmp_path / "art")]) == 0
    assert rewriter.load(tmp_path / "art").chat(QUESTION, max_new_tokens=8) == answer


def test_a_hugging_face_directorys_template_is_read(model, hf_tokenizer, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    hf_tokenizer.save_pretrained(tmp_path / "ckpt")
    opt = rewriter.from_pretrained(tmp_path / "ckpt")
    assert opt.text.chat_template == CHAT
    assert opt.chat(QUESTION, max_new_tokens=8) == hf_answer(model, hf_tokenizer, QUESTION, 8)


@pytest.mark.parametrize("bad", [
    {"chat_template": 5}, {"chat_template": "x", "bos_token": ["<s>"]},
    {"chat_template": "x", "python": "import os"}, ["x"]])
def test_a_crafted_tokenizer_config_is_an_artifact_error(opt, tmp_path, bad):
    opt.save(tmp_path / "art")
    (version_dir(tmp_path / "art") / "tokenizer_config.json").write_text(json.dumps(bad))
    reseal(tmp_path / "art")
    with pytest.raises(ArtifactError, match="tokenizer_config.json"):
        rewriter.load(tmp_path / "art")


def test_a_template_is_rendered_in_a_sandbox_not_run(opt, tmp_path):
    opt.save(tmp_path / "art")
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (version_dir(tmp_path / "art") / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": evil}))
    reseal(tmp_path / "art")
    engine = rewriter.load(tmp_path / "art")
    with pytest.raises(RewriterError, match="chat template failed to render"):
        engine.chat("hi")


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ ('a' * 1000000000)|length }}",
    "{{ ['a'] * 100000000 }}",
    "{{ 2 ** 100000000 }}",
    "{{ 'x' }}" * 20000,
])
def test_hostile_templates_fail_to_render_by_name(opt, evil):
    """Attribute escapes raise Jinja's SecurityError or render as nothing (an unsafe
    attribute is undefined); products and powers that would take gigabytes or hours are
    refused before they are computed; so is a huge template."""
    from rewriter.runtime.chat import TextConfig, render
    try:
        out = render(TextConfig(evil), [{"role": "user", "content": "hi"}])
    except RewriterError as e:
        assert re.search("SecurityError|too large|more than", str(e)), e
    else:
        assert out == "", out


def test_ordinary_arithmetic_in_templates_still_works():
    from rewriter.runtime.chat import TextConfig, render
    text = "{{ 'ab' * 3 }} {{ 1000 * 2000 }} {{ 2 ** 10 }} {{ messages|length }}"
    assert render(TextConfig(text), [{"role": "user", "content": "hi"}]) == "ababab 2000000 1024 1"


@pytest.mark.parametrize("text, problem", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"),
                                           ('{"chat_template": 5}', "chat_template must be a string")])
def test_a_broken_tokenizer_config_in_a_checkpoint_is_named(model, hf_tokenizer, tmp_path, text, problem):
    from rewriter.errors import CheckpointError
    model.save_pretrained(tmp_path / "ckpt")
    hf_tokenizer.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "chat_template.jinja").unlink(missing_ok=True)
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=problem) as e:
        rewriter.from_pretrained(tmp_path / "ckpt")
    assert "tokenizer_config.json" in str(e.value)
