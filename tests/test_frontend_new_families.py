"""Qwen3, Llama 3.x RoPE scaling and Phi-3 are lifted like the other families and proven
the same way: the IR's float32 logits equal Hugging Face's, greedy ``generate`` over the
KV cache gives Hugging Face's tokens, rows of a padded batch equal the rows alone.

What is new in them: Qwen3 normalises each head of q and k (``rw.head_rms_norm``) and may
window some layers (``layer_types``); Llama 3.x, linear and YaRN scaling change only the
inverse frequencies (and YaRN the cos/sin scale), which ``rw.rotary`` reads as data; Phi-3
fuses q, k, v into ``qkv_proj`` and gate, up into ``gate_up_proj``, which the lifter splits
back into separate linears. Refused by name: Phi-3's ``longrope`` (Hugging Face recomputes
its KV cache when the sequence passes the original context) and Gemma 2's attention logit
soft-capping.
"""
import operator

import pytest
import torch
import transformers as T

import rewriter
from rewriter.errors import UncacheableError
from rewriter.frontend.fused import gate_up_halves, qkv_proj_rows
from rewriter.ir.cacheable import uncacheable
from rewriter.passes import FuseQKV, FuseRoPE, FuseSwiGLU, Int4Weights

from conftest import assert_positions_mean_hf, assert_close_rel, hf_logits, optimize_once
from conftest import hf_greedy as _hf_greedy

NEW = 16
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
FAMILIES = {
    "qwen3-gqa-2l": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(
        SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "qwen3-mqa-sliding-4l": (T.Qwen3ForCausalLM, T.Qwen3Config, dict(  # layers 2, 3 windowed
        SMALL, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=24, use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "llama3-gqa-2l": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rope_scaling=LLAMA3)),
    "llama3-mqa-3l": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        SMALL, hidden_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=1,
        max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama-linear-2l": (T.LlamaForCausalLM, T.LlamaConfig, dict(
        SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-yarn-2l": (T.LlamaForCausalLM, T.LlamaConfig, dict(  # attention_scaling != 1
        SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rope_scaling={"rope_type": "yarn", "factor": 64.0,
                                                    "original_max_position_embeddings": 64})),
    "phi3-gqa-2l": (T.Phi3ForCausalLM, T.Phi3Config, dict(
        SMALL, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "phi3-mqa-partial-3l": (T.Phi3ForCausalLM, T.Phi3Config, dict(  # Phi-3-mini-4k windows
        SMALL, hidden_size=96, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, partial_rotary_factor=0.5, sliding_window=5)),
}
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the small vocabulary


def make(name, **overrides):
    cls, config_cls, kwargs = FAMILIES[name]
    torch.manual_seed(0)
    model = cls(config_cls(**{"initializer_range": 0.2, **IDS, **kwargs, **overrides})).eval()
    with torch.no_grad():  # norms initialised to 1 would hide a wrong weight
        for path, p in model.named_parameters():
            if "norm" in path:
                p.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def lifted():
    return optimize_once(make)


def hf_greedy(model, ids, new_tokens):
    return _hf_greedy(model, ids, new_tokens, attention_mask=torch.ones_like(ids))


def prompt(length, seed, vocab):
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def ours(opt, ids, new=NEW):
    return opt.generate(ids, max_new_tokens=new, eos_token_id=[])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_layer_is_lifted(lifted, name):
    model, opt = lifted(name)
    layers, counts = model.config.num_hidden_layers, opt.ir.op_counts()
    assert counts["rw.attention"] == layers and counts["rw.rope"] == 2 * layers
    assert counts.get("rw.head_rms_norm") == (2 * layers if name.startswith("qwen3") else None)
    assert "aten.scaled_dot_product_attention" not in counts and uncacheable(opt.ir.gm) == []
    assert opt.ir.info["lift_report"] == [] and opt.ir.info["unlifted_attention"] == []
    assert [s["index"] for s in opt.ir.layers] == list(range(layers))


def test_qwen3_windows_only_its_sliding_layers(lifted):
    model, opt = lifted("qwen3-mqa-sliding-4l")
    windows = [n.args[9] for n in opt.ir.ops() if n.target == torch.ops.rw.attention.default]
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert windows == [None, None, 4, 4]


def test_phi3_windows_every_layer_by_its_config(lifted):
    """Phi-3's attention passes ``config.sliding_window`` (2047 in Phi-3-mini-4k) to every
    layer, and its mask slides: each rw.attention holds that window."""
    _, opt = lifted("phi3-mqa-partial-3l")
    windows = [n.args[9] for n in opt.ir.ops() if n.target == torch.ops.rw.attention.default]
    assert windows == [5, 5, 5]


def test_phi3_fused_projections_become_separate_linears(lifted):
    """``qkv_proj`` splits into q, k, v of GQA sizes and ``gate_up_proj`` into gate and up
    (halves of its rows); the fused weights are gone from the IR."""
    model, opt = lifted("phi3-gqa-2l")
    names = set(opt.ir.gm.state_dict())
    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    w = {k[len("model.layers.0."):]: v for k, v in opt.ir.gm.state_dict().items()
         if k.startswith("model.layers.0.")}
    assert torch.equal(torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"],
                                  w["self_attn.v_proj.weight"]]), qkv)
    assert w["self_attn.k_proj.weight"].shape == (2 * 16, 64)
    assert torch.equal(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]), gate_up)
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert opt.ir.op_counts()["rw.linear"] == 2 * 7 + 1  # q, k, v, o, gate, up, down; lm_head


def test_phi3_rotates_part_of_each_head(lifted):
    """``partial_rotary_factor`` 0.5 of 24-wide heads: 12 features rotated, 6 frequencies."""
    model, opt = lifted("phi3-mqa-partial-3l")
    (rotary,) = [n for n in opt.ir.ops() if n.target == torch.ops.rw.rotary.default]
    inv_freq = opt.ir.gm.state_dict()[rotary.args[1].target]
    assert torch.equal(inv_freq, model.model.rotary_emb.inv_freq) and inv_freq.numel() == 6


def test_fused_layouts_other_than_phi3s_are_left_fused():
    """The slices read must be Phi-3's ``[q | k | v]`` bounds, the halves ``chunk(2, -1)``."""
    aten = torch.ops.aten

    def graph_of(*users):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        for target, args in users:
            g.call_function(target, (x, *args))
        return x

    phi3 = [(aten.slice.Tensor, (2, 0, 64)), (aten.slice.Tensor, (2, 64, 96)),
            (aten.slice.Tensor, (2, 96, 2**63 - 1))]
    assert [r.tolist() for r in qkv_proj_rows(graph_of(*phi3), 128, 4, 2, 16)] == \
        [list(range(64)), list(range(64, 96)), list(range(96, 128))]
    assert qkv_proj_rows(graph_of(*phi3), 128, 2, 4, 16) is None  # other head counts
    assert qkv_proj_rows(graph_of(*phi3[:2]), 128, 4, 2, 16) is None
    interleaved = phi3[:2] + [(aten.slice.Tensor, (2, 96, 128, 2))]
    assert qkv_proj_rows(graph_of(*interleaved), 128, 4, 2, 16) is None
    x = graph_of((aten.chunk.default, (2, -1)))
    (chunk,) = x.users
    halves = [x.graph.call_function(operator.getitem, (chunk, i)) for i in (0, 1)]
    assert gate_up_halves(x) == tuple(halves)
    assert gate_up_halves(graph_of((aten.chunk.default, (3, -1)))) is None
    assert gate_up_halves(graph_of((aten.chunk.default, (2, 0)))) is None


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logits_equal_hugging_face(lifted, name):
    model, opt = lifted(name)
    gen = torch.Generator().manual_seed(1)
    for b, s in ((1, 1), (2, 7), (1, 24)):
        ids = torch.randint(0, model.config.vocab_size, (b, s), generator=gen)
        assert_close_rel(opt(ids), hf_logits(model, ids))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_explicit_positions_mean_hf_position_ids(lifted, name):
    """Positions in the thousands: far past the original context of the scaled RoPEs."""
    model, opt = lifted(name)
    start = 3000 if model.config.max_position_embeddings > 3000 else 200
    ids = prompt(6, 2, model.config.vocab_size).expand(2, 6)
    pos = torch.stack([torch.arange(start, start + 6), torch.arange(5, 11)])
    assert_positions_mean_hf(model, opt, ids, pos)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_equals_hugging_face(lifted, name):
    model, opt = lifted(name)
    for length, seed in ((9, 1), (3, 2)):
        ids = prompt(length, seed, model.config.vocab_size)
        got = ours(opt, ids)
        assert len(set(got[0, length:].tolist())) > 3, "degenerate continuation proves little"
        assert torch.equal(got, hf_greedy(model, ids, NEW)), f"prompt of {length}"


@pytest.mark.parametrize("name", ["llama3-gqa-2l", "llama-yarn-2l"])
def test_greedy_past_the_original_context_equals_hugging_face(lifted, name):
    model, opt = lifted(name)
    ids = prompt(70, 4, model.config.vocab_size)  # the original context is 64
    assert torch.equal(ours(opt, ids, 8), hf_greedy(model, ids, 8))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_padded_batch_rows_equal_hugging_face_rows_alone(lifted, name):
    model, opt = lifted(name)
    rows = [prompt(n, n, model.config.vocab_size)[0].tolist() for n in (3, 10, 6)]
    out = opt.generate(rows, max_new_tokens=8, eos_token_id=[])  # left-padded to 10
    for b, row in enumerate(rows):
        alone = hf_greedy(model, torch.tensor([row]), 8)[0, len(row):]
        assert torch.equal(out[b, 10:], alone), f"row {b} ({len(row)} tokens)"


@pytest.mark.parametrize("name", ["qwen3-mqa-sliding-4l", "llama3-gqa-2l", "phi3-gqa-2l"])
def test_artifact_generates_the_same_tokens(lifted, name, tmp_path):
    model, opt = lifted(name)
    opt.save(tmp_path / "a")
    engine = rewriter.load(tmp_path / "a")
    ids = prompt(7, 5, model.config.vocab_size)
    assert torch.equal(ours(engine, ids), hf_greedy(model, ids, NEW))


@pytest.mark.parametrize("name", ["qwen3-gqa-2l", "llama3-mqa-3l", "phi3-mqa-partial-3l"])
def test_fusions_generate_the_same_tokens(name):
    model = make(name)
    opt = rewriter.optimize(model, passes=[FuseQKV(), FuseRoPE(), FuseSwiGLU()])
    counts = opt.ir.op_counts()
    assert counts.get("rw.rope") is None and counts.get("rw.swiglu") == model.config.num_hidden_layers
    ids = prompt(9, 1, model.config.vocab_size)
    assert torch.equal(ours(opt, ids), hf_greedy(model, ids, NEW))


@pytest.mark.parametrize("name", ["qwen3-gqa-2l", "phi3-gqa-2l"])
def test_triton_backend_generates_the_same_tokens(name):
    """QK-norm and split projections through the Triton kernels (interpreted on a CPU)."""
    model = make(name)
    opt = rewriter.optimize(model, passes=[FuseQKV(), FuseRoPE()], backend="triton")
    ids = prompt(6, 1, model.config.vocab_size)
    assert torch.equal(ours(opt, ids, 6), hf_greedy(model, ids, 6))


def test_int4_weights_quantize_phi3s_split_linears_exactly():
    """Rows split from a fused weight keep its groups of in-features: on a 4-bit grid
    (a Q4_1 GGUF file's weights) every split linear is quantized without loss."""
    from test_int4 import on_grid
    model = on_grid(make("phi3-gqa-2l"))
    opt = rewriter.optimize(model, passes=[Int4Weights()])
    assert opt.ir.info["int4"]["linears"] == 7 * 2  # q k v o gate up down, 2 layers
    assert opt.ir.info["int4"]["max_abs_error"] == 0.0
    ids = prompt(9, 1, model.config.vocab_size)
    assert torch.equal(ours(opt, ids), hf_greedy(model, ids, NEW))


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_phi3_and_qwen3_on_two_ranks_match_one_process(tp_ranks):
    """Phi-3's split projections column- and row-parallel, Qwen3's QK-norm per head, on two
    gloo ranks: the same tokens as one process."""
    from tp_tools import same_as_one_process
    same_as_one_process(tp_ranks, ["phi3", "qwen3"])


def refused(model):
    opt = rewriter.optimize(model)
    with pytest.raises(UncacheableError, match="self_attn"):
        ours(opt, prompt(4, 1, model.config.vocab_size), 2)
    return opt.ir.info


def test_phi3_longrope_is_refused_by_name():
    torch.manual_seed(0)
    config = T.Phi3Config(**{**SMALL, **IDS, "max_position_embeddings": 64}, num_hidden_layers=2,
                          num_attention_heads=4, rope_scaling={
                              "type": "longrope", "short_factor": [1.0] * 8,
                              "long_factor": [4.0] * 8, "original_max_position_embeddings": 16})
    info = refused(T.Phi3ForCausalLM(config).eval())
    assert any("'longrope' is not lifted" in r for r in info["lift_report"])
    assert len(info["unlifted_attention"]) == 2


def test_gemma2_soft_capping_is_refused_by_name():
    torch.manual_seed(0)
    config = T.Gemma2Config(**{**SMALL, **IDS}, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=16, sliding_window=4,
                            query_pre_attn_scalar=16)
    info = refused(T.Gemma2ForCausalLM(config).eval())
    assert info["lift_report"] == ["model.layers.0.self_attn: attention logit soft-capping "
                                   "(attn_logit_softcapping=50.0) is not lifted: rw.attention "
                                   "has no cap on its scores"]


def test_olmo2_norms_over_the_whole_projection_are_not_head_norms():
    """OLMo 2's q_norm/k_norm carry the child names of Qwen3's but normalise the whole
    projection (weight ``[H*D]``): left as traced, by name, its logits still HF's."""
    torch.manual_seed(0)
    config = T.Olmo2Config(**SMALL, **IDS, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, initializer_range=0.2)
    model = T.Olmo2ForCausalLM(config).eval()
    info = refused(model)
    assert any("q_norm normalises more than one head" in r for r in info["lift_report"])
    ids = prompt(7, 3, 128)
    assert_close_rel(rewriter.optimize(model)(ids), hf_logits(model, ids))


def _norm_after_rope(self, hidden_states, position_embeddings, attention_mask, cache=None,
                     **kwargs):
    """Qwen3's attention with the QK-norm moved after RoPE (no such model ships; the
    lifter must notice the order, not assume it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3 import modeling_qwen3 as mq
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k, v = (p(hidden_states).view(shape).transpose(1, 2)  # [B, H, S, D]
               for p in (self.q_proj, self.k_proj, self.v_proj))
    q, k = mq.apply_rotary_pos_emb(q, k, *position_embeddings)
    q, k = self.q_norm(q), self.k_norm(k)
    out, _ = sdpa_attention_forward(self, q, k, v, attention_mask, dropout=0.0,
                                       scaling=self.scaling, **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


def test_a_qk_norm_after_rope_is_not_moved_before_it(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3 as mq
    monkeypatch.setattr(mq.Qwen3Attention, "forward", _norm_after_rope)
    model = make("qwen3-gqa-2l")
    info = refused(model)
    assert any("q_norm does not normalise its own projection before RoPE" in r
               for r in info["lift_report"])
    ids = prompt(7, 3, model.config.vocab_size)
    assert_close_rel(rewriter.optimize(model)(ids), hf_logits(model, ids))
