"""Checkpoint directories are read as they are or refused by name: transformers fills a
missing or mis-shaped weight with random values and carries on; rewriter does not."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import rewriter
from rewriter.models.checkpoints import cast, load_hf_model, load_model, load_tokenizer
from rewriter.errors import CheckpointError, RewriterError

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(tie: bool = False, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "tie_word_embeddings": tie, **overrides})).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A good untied checkpoint (with the default model's tokenizer) to copy and break."""
    path = tmp_path_factory.mktemp("ckpt") / "good"
    tiny_llama().save_pretrained(path)
    shutil.copy(rewriter.models.checkpoints.DEFAULT_MODEL_DIR / "tokenizer.json", path)
    return path


@pytest.fixture
def copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def refused(path, *fragments):
    with pytest.raises(CheckpointError) as e:
        rewriter.from_pretrained(path)
    assert isinstance(e.value, RewriterError) and isinstance(e.value, ValueError)
    for fragment in fragments:
        assert fragment in str(e.value)
    return str(e.value)


# ------------------------------------------------------------------ good checkpoints load

@pytest.mark.parametrize("tie", [False, True])
def test_a_tiny_checkpoint_loads_tied_or_not(tie, tmp_path):
    model = tiny_llama(tie)
    model.save_pretrained(tmp_path)
    loaded = load_hf_model(tmp_path)
    ids = torch.tensor([[1, 5, 9]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_the_shipped_default_model_loads():
    model, tokenizer = rewriter.default_model()
    assert model.config.tie_word_embeddings  # its lm_head is tied: not a missing weight
    opt = rewriter.from_pretrained("default")
    assert opt.generate([[1, 2, 3]], max_new_tokens=2).shape == (1, 5)


def test_a_model_cast_to_bfloat16_keeps_its_rotary_frequencies_in_float32(tmp_path):
    # as a checkpoint loaded in bfloat16 has them (model.to would round them too: at 8k
    # positions the angles would be off by radians), on every path that casts a built model
    tiny_llama().save_pretrained(tmp_path)
    loaded = load_hf_model(tmp_path, torch.bfloat16)
    for model in (cast(tiny_llama(), torch.bfloat16), loaded, load_model("default", "bfloat16")[0]):
        freqs = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
        assert freqs and all(b.dtype == torch.float32 for b in freqs.values())
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    want = loaded.model.rotary_emb.inv_freq
    assert torch.equal(cast(tiny_llama(), torch.bfloat16).model.rotary_emb.inv_freq, want)


# ------------------------------------------------------------------ weights unlike the config

def test_a_config_naming_more_layers_than_the_weights_hold_is_refused(copy):
    """The issue's: 4 layers in config.json, 2 in the weights; layers 2 and 3 were random."""
    edit_config(copy, num_hidden_layers=4)
    message = refused(copy, f"{copy}: weights do not match config.json",
                      "missing from the checkpoint: model.layers.2.")
    assert "(and 15 more)" in message


def test_weights_for_more_layers_than_the_config_names_are_refused(copy):
    edit_config(copy, num_hidden_layers=1)
    refused(copy, "in the checkpoint but not in the model: model.layers.1.")


def test_a_stray_tensor_in_the_weights_is_refused(copy):
    weights = load_file(copy / "model.safetensors")
    save_file({**weights, "model.extra.weight": torch.zeros(2)}, copy / "model.safetensors",
              metadata={"format": "pt"})
    refused(copy, "in the checkpoint but not in the model: model.extra.weight")


def test_a_weight_missing_from_the_file_is_refused(copy):
    weights = load_file(copy / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    refused(copy, "missing from the checkpoint: model.norm.weight")


@pytest.mark.parametrize("change,named", [
    (dict(intermediate_size=48), "model.layers.0.mlp.down_proj.weight is [32, 64] in the checkpoint, [32, 48]"),
    (dict(vocab_size=80), "lm_head.weight is [64, 32] in the checkpoint, [80, 32]"),
    (dict(num_key_value_heads=4), "model.layers.0.self_attn.k_proj.weight is [16, 32] in the checkpoint, [32, 32]"),
])
def test_weights_shaped_unlike_the_config_are_refused(copy, change, named):
    edit_config(copy, **change)
    refused(copy, "shaped unlike config.json", named)


# ------------------------------------------------------------------ files that are not what they claim

def test_pickled_weights_are_refused(copy):
    (copy / "model.safetensors").unlink()
    torch.save(tiny_llama().state_dict(), copy / "pytorch_model.bin")
    refused(copy, f"{copy / 'pytorch_model.bin'}: pickled weights are refused")


def test_pickled_weights_under_another_name_are_refused(copy):
    (copy / "model.safetensors").unlink()
    torch.save({}, copy / "weights.pt")
    refused(copy, "weights.pt: pickled weights are refused")


def test_a_directory_without_weights_is_refused(copy):
    (copy / "model.safetensors").unlink()
    refused(copy, f"{copy}: no weights")


@pytest.mark.parametrize("damage", ["truncated", "empty", "huge header", "garbage header"])
def test_broken_safetensors_files_are_refused_by_name(copy, damage):
    f = copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[:len(data) // 2], "empty": b"",
                   "huge header": (2 ** 40).to_bytes(8, "little") + data[8:],
                   "garbage header": data[:8] + b"\xff" * 64 + data[72:]}[damage])
    refused(copy, f"{f}: not a valid safetensors file")


@pytest.mark.parametrize("text,reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"model_type": "no-such-model"}', "model_type 'no-such-model' is not a model type"),
    ('{"hidden_size": 32}', "model_type None is not a model type"),
    (b"\xff\xfe{}", "not valid JSON"),
])
def test_a_broken_config_json_is_refused_by_name(copy, text, reason):
    f = copy / "config.json"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(copy, f"{f}: {reason}")


@pytest.mark.parametrize("change,reason", [
    (dict(num_hidden_layers="2"), "expected int, got str"),
    (dict(max_position_embeddings=float("nan")), "expected int, got float (value: nan)"),
    (dict(eos_token_id=True), "'eos_token_id' with value True"),
    (dict(num_attention_heads=5), "not a multiple of the number of attention heads"),
    (dict(dtype="float77"), "float77"),
])
def test_config_values_transformers_refuses_are_named(copy, change, reason):
    edit_config(copy, **change)
    refused(copy, f"{copy / 'config.json'}: not a valid llama config", reason)


def test_a_config_whose_model_cannot_be_built_is_refused(copy):
    edit_config(copy, vocab_size=-5)
    refused(copy, f"{copy}: cannot load the checkpoint", "negative dimension")


def test_an_eos_id_in_the_config_outside_the_vocabulary_is_named_at_generate(copy):
    edit_config(copy, eos_token_id=9999)
    opt = rewriter.from_pretrained(copy)
    with pytest.raises(ValueError, match=r"eos_token_id \(from the model config\) 9999 is outside"):
        opt.generate([[1, 2]], max_new_tokens=2)


def test_a_config_of_a_model_that_is_not_a_causal_lm_is_refused(copy):
    (copy / "config.json").write_text(json.dumps({"model_type": "vit"}))
    refused(copy, f"{copy}: cannot load the checkpoint")


@pytest.mark.parametrize("text", ["{not json", "{}", '{"model": {"type": "BPE"}}', ""])
def test_a_broken_tokenizer_json_is_refused_by_name(copy, text):
    f = copy / "tokenizer.json"
    f.write_text(text)
    with pytest.raises(CheckpointError, match=f"{f}: not a valid tokenizer file"):
        load_tokenizer(copy)
    refused(copy, f"{f}: not a valid tokenizer file")
