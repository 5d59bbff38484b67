"""GPT-NeoX, Phi and OPT are lifted like the other families and proven the same way: the
IR's logits equal Hugging Face's, and greedy ``generate`` over the KV cache gives Hugging
Face's tokens (several prompts, a padded batch, LayerSkip, the fusion passes).

What is new in them: GPT-NeoX fuses q, k, v into one ``query_key_value`` GEMM laid out per
head (``[q_h | k_h | v_h]`` for each head); GPT-NeoX and Phi rotate only part of each head
(``rotary_pct``, ``partial_rotary_factor``: ``rw.rope`` rotates the first ``cos.shape[-1]``
features) and run attention and MLP in parallel from the layer input (GPT-NeoX's
``use_parallel_residual``, Phi always), which still leaves one residual value in and one
out of every layer; OPT scales q before attention (folded into the attention scale) and
looks its learned positions up at ``position + 2``.
"""
import copy

import pytest
import torch
import transformers as T

import rewriter
from rewriter.ir.cacheable import uncacheable
from rewriter.passes import FuseQKV, FuseRoPE, LayerSkip

from conftest import assert_positions_mean_hf, SHAPES, assert_close_rel, hf_logits, optimize_once
from conftest import hf_greedy as _hf_greedy

NEW = 20
FAMILIES = {
    "neox-parallel-3l": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.25,
        initializer_range=0.3)),
    "neox-sequential-2l": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig, dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.5,
        use_parallel_residual=False, attention_bias=False)),
    "phi-3l": (T.PhiForCausalLM, T.PhiConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=128, partial_rotary_factor=0.5)),
    "phi-gqa-2l": (T.PhiForCausalLM, T.PhiConfig, dict(
        vocab_size=100, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        partial_rotary_factor=0.4)),
    "opt-2l": (T.OPTForCausalLM, T.OPTConfig, dict(
        vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64)),
    "opt-proj-postnorm-3l": (T.OPTForCausalLM, T.OPTConfig, dict(  # OPT-350m's shape
        vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=32,
        do_layer_norm_before=False, initializer_range=0.05)),
}


def make(name, **overrides):
    cls, config_cls, kwargs = FAMILIES[name]
    torch.manual_seed(0)
    # initializer_range 0.2 (unless a config says otherwise): greedy continuations vary
    return cls(config_cls(**{"initializer_range": 0.2, **kwargs, **overrides})).eval()


@pytest.fixture(scope="module")
def lifted():
    return optimize_once(make)


def hf_greedy(model, ids, new_tokens):
    """HF greedy tokens; the explicit mask keeps HF from reading token 0 (its pad id
    here) inside a prompt as padding."""
    return _hf_greedy(model, ids, new_tokens, attention_mask=torch.ones_like(ids))


def prompt(length, seed, vocab):
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def without_layers(model, skip):
    """The Hugging Face model with ``skip`` layers deleted."""
    m = copy.deepcopy(model)
    body = m.gpt_neox if hasattr(m, "gpt_neox") else m.model
    body = body.decoder if hasattr(body, "decoder") else body  # OPT
    kept = [layer for i, layer in enumerate(body.layers) if i not in skip]
    body.layers = torch.nn.ModuleList(kept)
    for i, layer in enumerate(kept):
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = i
    m.config.num_hidden_layers = len(kept)
    return m


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_layer_is_lifted(lifted, name):
    model, opt = lifted(name)
    layers = model.config.num_hidden_layers
    counts = opt.ir.op_counts()
    assert counts["rw.attention"] == layers
    assert counts.get("rw.rope") == (None if name.startswith("opt") else 2 * layers)
    assert "aten.scaled_dot_product_attention" not in counts and uncacheable(opt.ir.gm) == []
    assert opt.ir.info["lift_report"] == []
    assert opt.ir.info["unlifted_attention"] == [] and opt.ir.info["unlifted_embeddings"] == []
    assert [s["index"] for s in opt.ir.layers] == list(range(layers))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_equal_hugging_face(lifted, name):
    model, opt = lifted(name)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    for b, s in SHAPES:
        ids = torch.randint(0, vocab, (b, s), generator=gen)
        assert_close_rel(opt(ids), hf_logits(model, ids))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_explicit_positions_mean_hf_position_ids(lifted, name):
    model, opt = lifted(name)
    ids, pos = prompt(6, 2, model.config.vocab_size).expand(2, 6), torch.arange(3, 9).expand(2, 6)
    assert_positions_mean_hf(model, opt, ids, pos)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_equals_hugging_face(lifted, name):
    model, opt = lifted(name)
    for length, seed in ((9, 1), (4, 2), (15, 3)):
        ids = prompt(length, seed, model.config.vocab_size)
        ours = opt.generate(ids, max_new_tokens=NEW, eos_token_id=[])
        assert len(set(ours[0, length:].tolist())) > 4, "degenerate continuation proves little"
        assert torch.equal(ours, hf_greedy(model, ids, NEW)), f"prompt of {length}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_padded_batch_rows_equal_hugging_face_rows_alone(lifted, name):
    model, opt = lifted(name)
    rows = [prompt(n, n, model.config.vocab_size)[0].tolist() for n in (3, 11, 7)]
    out = opt.generate(rows, max_new_tokens=NEW, eos_token_id=[])  # left-padded to 11
    for b, row in enumerate(rows):
        alone = hf_greedy(model, torch.tensor([row]), NEW)[0, len(row):]
        assert torch.equal(out[b, 11:], alone), f"row {b} ({len(row)} tokens)"


def test_opt_learned_positions_are_read_with_their_offset(lifted):
    """OPT's ``OPTLearnedPositionalEmbedding`` looks up ``position + 2``: the IR reads
    ``positions + 2`` (explicit positions then mean HF ``position_ids``, tested above)."""
    _, opt = lifted("opt-2l")
    (emb,) = [n for n in opt.ir.ops() if n.target == torch.ops.rw.embedding.default
              and n.args[1].target == "model.decoder.embed_positions.weight"]
    index = emb.args[0]
    assert index.target == torch.ops.aten.add.Tensor
    assert index.args == (opt.ir.node("positions"), 2)


@pytest.mark.parametrize("name", ["neox-parallel-3l", "phi-3l", "opt-proj-postnorm-3l"])
def test_layer_skip_generates_like_the_layer_deleted_model(name):
    model = make(name)
    opt = rewriter.optimize(model, passes=[LayerSkip(layers=[1])])
    ids = prompt(7, 1, model.config.vocab_size)
    theirs = hf_greedy(without_layers(model, {1}), ids, NEW)
    assert torch.equal(opt.generate(ids, max_new_tokens=NEW, eos_token_id=[]), theirs)


@pytest.mark.parametrize("name", ["neox-parallel-3l", "phi-gqa-2l"])
def test_fused_qkv_and_rope_generate_the_same_tokens(name):
    model = make(name)
    opt = rewriter.optimize(model, passes=[FuseQKV(), FuseRoPE()])
    assert opt.ir.op_counts().get("rw.rope") is None  # rotation moved into attention
    ids = prompt(9, 1, model.config.vocab_size)
    assert torch.equal(opt.generate(ids, max_new_tokens=NEW, eos_token_id=[]),
                       hf_greedy(model, ids, NEW))


@pytest.mark.parametrize("name", ["neox-parallel-3l", "phi-gqa-2l", "opt-proj-postnorm-3l"])
def test_triton_backend_generates_the_same_tokens(name):
    """Partial rotary, biases and LayerNorm through the Triton kernels (interpreted on a CPU)."""
    model = make(name)
    opt = rewriter.optimize(model, passes=[FuseQKV(), FuseRoPE()], backend="triton")
    ids = prompt(5, 1, model.config.vocab_size)
    assert torch.equal(opt.generate(ids, max_new_tokens=6, eos_token_id=[]),
                       hf_greedy(model, ids, 6))


# A ``sliding_window`` key that the model's attention never reads (the Llama and
# GPT-NeoX; Phi and OPT built the same way) must not window the lifted attention. Hugging
# Face's own ``generate`` with its cache disagrees with its forward here (its DynamicCache
# reads the stray key and drops old tokens), so the reference is HF without a cache.
STRAY_WINDOW = {
    "llama": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "neox": FAMILIES["neox-parallel-3l"],
    "phi": FAMILIES["phi-3l"],
    "opt": FAMILIES["opt-2l"],
}


@pytest.mark.parametrize("name", sorted(STRAY_WINDOW))
def test_a_stray_sliding_window_in_the_config_changes_nothing(name):
    cls, config_cls, kwargs = STRAY_WINDOW[name]
    torch.manual_seed(0)
    model = cls(config_cls(**{"initializer_range": 0.2, **kwargs, "sliding_window": 4})).eval()
    opt = rewriter.optimize(model)
    windows = [n.args[9] for n in opt.ir.gm.graph.nodes if n.target == torch.ops.rw.attention.default]
    assert windows and windows == [None] * len(windows)
    ids = prompt(20, 3, model.config.vocab_size)  # 20 tokens: five times the stray window
    assert_close_rel(opt(ids), hf_logits(model, ids))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=False)
    assert torch.equal(opt.generate(ids, max_new_tokens=16, eos_token_id=[]), want)
