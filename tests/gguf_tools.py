"""Write a Llama checkpoint as a GGUF file, the way llama.cpp's converter lays it out, so
the GGUF path is tested without downloading one (the ``gguf`` package writes the file)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# HF parameter name (layer part as {i}) -> GGUF tensor name
NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair ([h, 2, d/2] -> [h, d/2, 2])."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model, tokenizer_json: Path, path: Path, quant: str = "F32",
                     chat_template: str | None = None, blocks: dict | None = None) -> Path:
    """``model`` (a LlamaForCausalLM) and its ``tokenizer.json`` (byte-level BPE) as GGUF.
    ``quant``: ``F32`` or a ggml block type (``Q8_0``, ``Q4_1``, ...) for the 2-d matrices.
    ``blocks``: GGUF tensor name -> (ggml type name, uint8 rows ``[out, bytes]``) written as
    they are instead (``block_linears`` makes them; q and k rows permuted as llama.cpp's)."""
    import gguf
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    _add_tokenizer(w, json.loads(Path(tokenizer_json).read_text()), c, chat_template)
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, t in _gguf_tensors(model):
        data = t.detach().float().numpy()
        if blocks and name in blocks:
            kind, rows = blocks[name]
            w.add_tensor(name, _permuted(name, rows, c), raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        elif quant != "F32" and data.ndim == 2 and data.shape[1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _permuted(name: str, rows: np.ndarray, c) -> np.ndarray:
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(name.split(".")[-2])
    return permute(rows, heads) if heads else rows


# where a block's fp16 scale(s) lie, in bytes; every other byte of a block may be anything
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, out: int, width: int, seed: int) -> np.ndarray:
    """uint8 rows ``[out, bytes]`` of ``kind`` (a K-quant) blocks for a ``[out, width]``
    matrix: random bytes, with the fp16 scales set to small positive numbers as a quantizer
    would write them (``gguf`` writes no K-quants itself)."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, kind)]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (out, width // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        scale = (np.abs(rng.standard_normal((out, width // block))) * 2e-3 + 1e-4).astype(np.float16)
        raw[..., at:at + 2] = scale.view(np.uint8).reshape(out, width // block, 2)
    return raw.reshape(out, -1)


def dequantized(kind: str, rows: np.ndarray) -> torch.Tensor:
    """``gguf``'s own float32 reading of ``kind`` rows."""
    import gguf
    return torch.from_numpy(gguf.quants.dequantize(rows, getattr(gguf.GGMLQuantizationType, kind)))


def block_linears(model, kind: str, seed: int = 0) -> dict:
    """Set every linear of ``model`` (not the LM head) whose in-features are a multiple of
    256 to ``gguf``'s reading of random ``kind`` blocks; those blocks by GGUF tensor name,
    for ``write_llama_gguf(blocks=...)``."""
    names = {hf: gg for hf, gg in _names(model)}
    head = model.get_output_embeddings()
    found = {}
    with torch.no_grad():
        for i, (hf, m) in enumerate(model.named_modules()):
            if isinstance(m, torch.nn.Linear) and m is not head and m.in_features % 256 == 0:
                rows = random_blocks(kind, m.out_features, m.in_features, seed + i)
                m.weight.copy_(dequantized(kind, rows))
                found[names[hf + ".weight"]] = (kind, rows)
    return found


def _names(model):
    for hf, _ in model.named_parameters():
        parts = hf.split(".")
        key = hf if "layers" not in parts else ".".join(parts[:2] + ["{i}"] + parts[3:])
        if key in NAMES:
            yield hf, NAMES[key].format(i=parts[2] if "layers" in parts else "")


def _gguf_tensors(model):
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    for hf, name in _names(model):
        if hf in params:
            yield name, torch.from_numpy(_permuted(name, params[hf].detach().numpy(), model.config))


def _add_tokenizer(w, tok: dict, config, chat_template) -> None:
    vocab = tok["model"]["vocab"]  # token -> id
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    if chat_template:
        w.add_chat_template(chat_template)
