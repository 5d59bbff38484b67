"""Gemma 3 (text) is lifted like the other families and proven the same way: random-weight
configs (MQA and GQA, a head size that is not hidden / heads, ``query_pre_attn_scalar``
other than the head size, windows of 3 to 5 tokens with sequences well past them, 1:1 and
2:1 local:global patterns, a RoPE base of its own per kind of layer) give Hugging Face's
float32 logits and greedy tokens, alone, in padded batches, from a saved artifact and
through the Triton kernels; and each pass either keeps those tokens, or refuses by name.

Hugging Face initialises Gemma's norm weights to 0 (its scale is ``1 + w``): here they are
random, so a norm that used ``w`` instead of ``1 + w`` (or the other way round) shows.
"""
import pytest
import torch
import transformers as T

import rewriter
from rewriter.ir.cacheable import uncacheable
from rewriter.ops import REFERENCE

from conftest import assert_positions_mean_hf, SHAPES, assert_close_rel, hf_logits
from conftest import hf_greedy as _hf_greedy

NEW = 20
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def rope(local_theta, global_theta, **global_scaling):
    return {LOCAL: {"rope_type": "default", "rope_theta": local_theta},
            GLOBAL: {"rope_type": "default", "rope_theta": global_theta, **global_scaling}}


CONFIGS = {
    # Gemma 3 270M's shape in small: one KV head, 1:1 local:global
    "mqa-4l": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
                   query_pre_attn_scalar=24, layer_types=[LOCAL, GLOBAL] * 2,
                   initializer_range=0.05),
    # GQA, head_dim 24 != 48 / 4, two local layers to one global, window 3, own RoPE bases
    "gqa-3l": dict(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=24, sliding_window=3,
                   query_pre_attn_scalar=32, layer_types=[LOCAL, LOCAL, GLOBAL],
                   rope_parameters=rope(100.0, 5000.0), tie_word_embeddings=False),
    # wider heads than hidden / heads, global layer first, linear RoPE scaling on it (the
    # larger Gemma 3 models scale their global layers' RoPE so)
    "gqa-wide-6l": dict(vocab_size=112, hidden_size=40, intermediate_size=72, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        sliding_window=5, query_pre_attn_scalar=20,
                        layer_types=[GLOBAL, LOCAL, LOCAL] * 2, initializer_range=0.05,
                        rope_parameters={LOCAL: {"rope_type": "default", "rope_theta": 50.0},
                                         GLOBAL: {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 2000.0}}),
}


def make(name, **overrides):
    """The model of ``CONFIGS[name]``. Tied embeddings (Gemma's) need small weights
    (``initializer_range`` 0.05): with larger ones the stream stays near the last token's
    own embedding and greedy decoding repeats that token, which proves little."""
    torch.manual_seed(0)
    config = T.Gemma3TextConfig(**{"max_position_embeddings": 256, "initializer_range": 0.2,
                                   **CONFIGS[name], **overrides})
    model = T.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # HF's zeros would hide a wrong (1 + w)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def lifted():
    """``get(name)`` -> (hf model, its trace, OptimizedModel without passes), each once."""
    cache = {}

    def get(name):
        if name not in cache:
            model = make(name)
            traced = rewriter.trace(model)
            cache[name] = (model, traced, rewriter.optimize(traced))
        return cache[name]
    return get


def hf_greedy(model, ids, new_tokens):
    return _hf_greedy(model, ids, new_tokens, attention_mask=torch.ones_like(ids))


def prompt(length, seed, vocab):
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def generate(opt, ids, new=NEW):
    return opt.generate(ids, max_new_tokens=new, eos_token_id=[])


# ------------------------------------------------------------------------------ the model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_layer_is_lifted(lifted, name):
    model, _, opt = lifted(name)
    layers = model.config.num_hidden_layers
    counts = opt.ir.op_counts()
    assert counts["rw.attention"] == layers and counts["rw.head_rms_norm"] == 2 * layers
    assert counts["rw.rope"] == 2 * layers
    assert counts["rw.rms_norm"] == 4 * layers + 1  # four per layer and the final one
    assert not [op for op in counts if op.startswith("aten.") and op not in ("aten.add", "aten.mul")]
    assert uncacheable(opt.ir.gm) == [] and opt.ir.info["lift_report"] == []
    assert opt.ir.info["unlifted_attention"] == [] and opt.ir.info["unlifted_embeddings"] == []
    norms = [n for n in opt.ir.ops() if n.target in (torch.ops.rw.rms_norm.default,
                                                      torch.ops.rw.head_rms_norm.default)]
    assert all(n.args[-1] is True for n in norms)  # every Gemma norm scales by (1 + w)
    (emb,) = [n for n in opt.ir.ops() if n.target == torch.ops.rw.embedding.default]
    embed_scale = model.model.embed_tokens.embed_scale
    assert emb.args[2] == embed_scale.item() and embed_scale.item() != 1.0
    # one table per kind, in one order in every process (ranks compare their graphs)
    tables = [n.args[1].target for n in opt.ir.ops() if n.target == torch.ops.rw.rotary.default]
    assert tables == [f"model.rotary_emb.{kind}_inv_freq" for kind in (LOCAL, GLOBAL)]
    windows = [n.args[9] for n in opt.ir.ops() if n.target == torch.ops.rw.attention.default]
    want = [model.config.sliding_window if t == LOCAL else None for t in model.config.layer_types]
    assert windows == want


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_hugging_face(lifted, name):
    model, _, opt = lifted(name)
    gen = torch.Generator().manual_seed(1)
    for b, s in SHAPES:  # up to 32 tokens: several windows long
        ids = torch.randint(0, model.config.vocab_size, (b, s), generator=gen)
        assert_close_rel(opt(ids), hf_logits(model, ids))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_explicit_positions_mean_hf_position_ids(lifted, name):
    model, _, opt = lifted(name)
    ids, pos = prompt(9, 2, model.config.vocab_size).expand(2, 9), torch.arange(3, 12).expand(2, 9)
    assert_positions_mean_hf(model, opt, ids, pos)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_hugging_face(lifted, name):
    model, _, opt = lifted(name)
    for length, seed in ((9, 1), (4, 2), (15, 3)):
        ids = prompt(length, seed, model.config.vocab_size)
        ours = generate(opt, ids)
        assert len(set(ours[0, length:].tolist())) > 4, "degenerate continuation proves little"
        assert torch.equal(ours, hf_greedy(model, ids, NEW)), f"prompt of {length}"


@pytest.mark.parametrize("name", ["mqa-4l", "gqa-3l"])
def test_padded_batch_rows_equal_hugging_face_rows_alone(lifted, name):
    model, _, opt = lifted(name)
    rows = [prompt(n, n, model.config.vocab_size)[0].tolist() for n in (3, 11, 7)]
    out = generate(opt, rows)  # left-padded to 11: the padding sits inside some windows
    for b, row in enumerate(rows):
        alone = hf_greedy(model, torch.tensor([row]), NEW)[0, len(row):]
        assert torch.equal(out[b, 11:], alone), f"row {b} ({len(row)} tokens)"


def test_saved_artifact_generates_the_same_tokens(lifted, tmp_path):
    model, _, opt = lifted("gqa-3l")
    opt.save(tmp_path / "a")
    engine = rewriter.load(tmp_path / "a")
    ids = torch.cat([prompt(6, 4, model.config.vocab_size), prompt(6, 5, model.config.vocab_size)])
    assert torch.equal(generate(engine, ids), generate(opt, ids))
    assert torch.equal(generate(engine, ids[:1]), hf_greedy(model, ids[:1], NEW))
    assert str(engine.ir) == str(opt.ir)


def test_triton_backend_generates_the_same_tokens(lifted):
    """The (1 + w) norms, the head norms and windowed attention through the Triton kernels
    (interpreted on a CPU)."""
    from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU
    model, traced, _ = lifted("mqa-4l")
    passes = [FuseQKV(), FuseRoPE(), FuseAddRMSNorm(), FuseSwiGLU()]
    opt = rewriter.optimize(traced, passes=passes, backend="triton")
    ids = prompt(7, 1, model.config.vocab_size)  # past the window of 4
    assert torch.equal(generate(opt, ids, 5), hf_greedy(model, ids, 5))


# ------------------------------------------------------------------------------ the ops


def _hf_norm(dim, weight):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    norm = Gemma3RMSNorm(dim, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def test_unit_offset_norms_equal_gemma3_rms_norm_bit_for_bit_in_bfloat16():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, 4 * 24, generator=gen) * 3).to(torch.bfloat16)
    w = torch.randn(4 * 24, generator=gen).to(torch.bfloat16)
    wh = torch.randn(24, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        want = _hf_norm(96, w)(x)
        want_heads = _hf_norm(24, wh)(x.view(2, 5, 4, 24)).reshape(2, 5, 96)
    got = torch.ops.rw.rms_norm(x, w, 1e-6, True)
    got_heads = torch.ops.rw.head_rms_norm(x, wh, 1e-6, 24, True)
    assert got.dtype == got_heads.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(got_heads, want_heads)
    assert not torch.equal(torch.ops.rw.rms_norm(x, w, 1e-6), want)  # w alone differs


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 7, 96), (1, 13, 200)])
def test_triton_unit_offset_norm_equals_the_reference(shape):
    pytest.importorskip("triton")
    from rewriter.codegen import norm
    x, r, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    out, total = norm.add_rms_norm(x, r, w, 1e-6, unit_offset=True)
    want_out, want_total = REFERENCE["add_rms_norm"](x, r, w, 1e-6, True)
    torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6, True), REFERENCE["rms_norm"](x, w, 1e-6, True),
                               rtol=1e-6, atol=1e-6)
    xb, rb, wb = (t.to(torch.bfloat16) for t in (x, r, w))
    got = norm.add_rms_norm(xb, rb, wb, 1e-6, True)[0]
    want = REFERENCE["add_rms_norm"](xb, rb, wb, 1e-6, True)[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------ the passes

# Every pass on Gemma 3, and what it does there (docs: the Gemma 3 paragraph). Lossless
# passes give Hugging Face's (or plain greedy's) tokens; lossy ones run, with their cost
# measured; the rest refuse by name.
POLICY = {
    "fuse_qkv": "lossless", "fuse_rope": "lossless", "fuse_add_rms_norm": "lossless",
    "fuse_swiglu": "lossless (GeGLU: gate and up one GEMM, the GELU on the gate's half)",
    "layer_skip": "lossless (the layer-deleted model's tokens)",
    "self_speculative": "lossless", "prompt_lookup": "lossless",
    "medusa_heads": "lossless", "hydra_heads": "lossless", "eagle_draft": "lossless",
    "int4_weights": "lossy, measured",
    "streaming_attention": "global layers only; naming a local layer is refused",
    "quest": "global layers only", "tidal_decode": "global layers only; calibration refused",
    "duo_attention": "refused (local layers' windows)",
    "share_kv": "refused between a local and a global layer",
    "minicache": "refused between a local and a global layer",
    "tensor_parallel": "lossless (whole heads per rank, the QK-norm weight whole)",
    "fuse_all_reduce_rms_norm": "no site (a sum feeds a post-norm, not an add)",
}


def test_every_pass_has_a_policy_on_gemma3():
    from rewriter.passes import PASSES
    assert set(POLICY) == set(PASSES)


def optimized(lifted, name, passes, **kw):
    model, traced, _ = lifted(name)
    return model, rewriter.optimize(traced, passes=passes, **kw)


@pytest.mark.parametrize("name", ["mqa-4l", "gqa-3l"])
def test_fusions_keep_hugging_faces_logits_and_tokens(lifted, name):
    """FuseQKV reads through the QK-norm (the head norms read their parts of the fused
    projection), FuseRoPE moves the rotation after the norm into attention, FuseAddRMSNorm
    carries (1 + w); FuseSwiGLU makes GeGLU's gate and up one GEMM, its tanh-GELU reading
    the gate's half (rw.swiglu is SiLU's)."""
    from rewriter.passes import FuseAddRMSNorm, FuseQKV, FuseRoPE, FuseSwiGLU
    model, opt = optimized(lifted, name, [FuseQKV(), FuseRoPE(), FuseAddRMSNorm(), FuseSwiGLU()])
    layers = model.config.num_hidden_layers
    assert opt.ir.info["fusions"] == {"FuseQKV": layers, "FuseRoPE": layers,
                                      "FuseAddRMSNorm": 2 * layers - 1, "FuseSwiGLU": layers}
    counts = opt.ir.op_counts()
    assert "rw.rope" not in counts and counts["rw.head_rms_norm"] == 2 * layers
    assert "rw.swiglu" not in counts and counts["rw.gelu"] == layers
    assert counts["rw.linear"] == 4 * layers + 1  # qkv, o, gate_up, down; the LM head
    assert all(n.args[-1] is True for n in opt.ir.ops() if n.target == torch.ops.rw.add_rms_norm.default)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    assert_close_rel(opt(ids), hf_logits(model, ids))
    ids = prompt(9, 1, model.config.vocab_size)
    assert torch.equal(generate(opt, ids), hf_greedy(model, ids, NEW))


def test_layer_skip_generates_like_the_layer_deleted_model(lifted):
    from conftest import drop_layers
    from rewriter.passes import LayerSkip
    model, opt = optimized(lifted, "gqa-3l", [LayerSkip(layers=[1])])
    ids = prompt(7, 1, model.config.vocab_size)
    assert torch.equal(generate(opt, ids), hf_greedy(drop_layers(model, {1}), ids, NEW))


@pytest.mark.parametrize("spec", ["self_speculative:skip_layers=[1]",
                                  "prompt_lookup:tokens=3,adapt=false"])
def test_speculative_strategies_give_hugging_faces_tokens(lifted, spec):
    from rewriter.passes import from_spec
    model, opt = optimized(lifted, "mqa-4l", [from_spec(spec)])
    rows = [prompt(9, 1, model.config.vocab_size)[0].tolist() * 2, prompt(5, 2, 128)[0].tolist()]
    out = generate(opt, rows)  # a repeated prompt: prompt lookup finds its copies
    for b, row in enumerate(rows):
        alone = hf_greedy(model, torch.tensor([row]), NEW)[0, len(row):]
        assert torch.equal(out[b, -NEW:], alone), f"row {b}"


def test_a_speculative_tree_as_deep_as_a_local_window_is_refused_by_name(lifted):
    """A verify step of ``depth`` drafted tokens needs every window longer than that (the
    runtime's check): the small model's window of 4 takes at most 3."""
    from rewriter.errors import RewriterError
    from rewriter.passes import PromptLookup
    model, opt = optimized(lifted, "mqa-4l", [PromptLookup(tokens=4, adapt=False)])
    with pytest.raises(RewriterError, match="depth 4 needs attention windows longer"):
        generate(opt, prompt(9, 1, model.config.vocab_size))


def test_hydra_heads_embed_their_path_with_the_model_scale(lifted, tmp_path):
    """The draft heads' path embeddings are the model's: Gemma's (scaled by sqrt(hidden)),
    here against Hugging Face's own embedding module; and the heads stay lossless."""
    from rewriter.drafts import heads as heads_file
    from rewriter.passes import HydraHeads
    from test_hydra_heads import hydra_heads
    model, traced, plain = lifted("mqa-4l")
    path = hydra_heads(model, tmp_path / "h.safetensors")
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=[[0], [1], [0, 0]])])
    ids = prompt(7, 1, model.config.vocab_size).expand(2, 7).clone()
    _, draft = hy.ir.gm(ids, torch.arange(7).expand(2, 7))
    heads = heads_file.load(path, "hydra")
    with torch.no_grad():
        h = model(ids, output_hidden_states=True).hidden_states[-1]
        e = model.get_input_embeddings()(torch.ops.rw.next_tokens(ids, 3))  # [B, S, K, H]
        want = heads_file.apply_hydra(h, e, heads.w, heads.b) @ model.lm_head.weight.t()
    assert_close_rel(draft, want, rel=1e-4)
    assert torch.equal(generate(hy, ids[:1]), generate(plain, ids[:1]))
    # what draft training embeds with (train_heads, the EAGLE layer's data): the same rows
    assert torch.equal(heads_file.model_embedding(model)[ids], model.get_input_embeddings()(ids))


def test_eagle_draft_embeds_with_the_model_scale_and_stays_lossless(lifted, tmp_path):
    from conftest import random_draft
    from rewriter.passes import EagleDraft
    model, traced, plain = lifted("mqa-4l")
    path = random_draft(model, tmp_path / "d.safetensors")
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=str(path), nodes=6, expand=2, depth=3)])
    scales = [n.args[2] for n in opt.ir.ops() if n.target == torch.ops.rw.embedding.default]
    assert scales == [model.model.embed_tokens.embed_scale.item()] * 2  # the model's, the draft's
    rows = [prompt(9, 1, model.config.vocab_size)[0].tolist(), prompt(4, 2, 128)[0].tolist()]
    out = generate(opt, rows)
    for b, row in enumerate(rows):
        assert torch.equal(out[b, -NEW:], generate(plain, [row])[0, len(row):]), f"row {b}"


def test_int4_weights_run_and_their_cost_is_measured(lifted):
    """Lossy: what it costs on this random model, float32 logits against Hugging Face's
    (measured 2026-12-07: largest error 0.38 of the largest logit, 71% of 48 positions
    with the same top token; tiny random models quantise badly, a trained one far less)."""
    from rewriter.passes import Int4Weights
    model, opt = optimized(lifted, "mqa-4l", [Int4Weights(group_size=32)])
    assert opt.ir.op_counts()["rw.linear_int4"] == 7 * model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    ours, theirs = opt(ids), hf_logits(model, ids)
    err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert 0 < err < 0.5 and agree > 0.6, (err, agree)


def attention_by_layer(opt) -> dict:
    from rewriter.ir.nodes import attention_args
    return {a["layer"]: a for a in (attention_args(n) for n in opt.ir.ops()
                                    if n.target == torch.ops.rw.attention.default)}


def test_streaming_attention_goes_on_the_global_layers_only(lifted):
    """The local layers keep their own window (no sinks); the global ones get sinks and a
    window, and the ring runtime gives the masked whole-sequence graph's tokens."""
    from conftest import reference_greedy
    from rewriter.errors import PassError
    from rewriter.passes import StreamingAttention
    model, opt = optimized(lifted, "mqa-4l", [StreamingAttention(sinks=1, window=6)])
    attn = attention_by_layer(opt)
    assert [(attn[i]["window"], attn[i]["sinks"]) for i in range(4)] == [(4, None), (6, 1)] * 2
    rows = [prompt(12, 1, model.config.vocab_size)[0].tolist(), [5, 6, 7]]
    out = generate(opt, rows, 14)
    for b, row in enumerate(rows):
        assert torch.equal(out[b, -len(row) - 14:], reference_greedy(opt, row, 14)), b
    with pytest.raises(PassError, match=r"layer 2 is a local layer .* global layers \[1, 3\]"):
        optimized(lifted, "mqa-4l", [StreamingAttention(sinks=1, window=6, layers=[1, 2])])


def test_quest_and_tidal_decode_select_on_the_global_layers_only(lifted):
    """Global layers 0 and 3 of six: Quest selects on layer 3 (layer 0 dense), TidalDecode
    selects on 0 for 3; the local layers keep their windows. Decode steps equal the
    whole-sequence graph, which selects at every position."""
    from conftest import reference_greedy
    from rewriter.passes import Quest, TidalDecode
    for p in (Quest(page=2, budget=4, dense_layers=1), TidalDecode(selection_layers=[0], top_k=3)):
        model, opt = optimized(lifted, "gqa-wide-6l", [p])
        attn = attention_by_layer(opt)
        assert [attn[i]["select"] is not None for i in range(6)] == [False, False, False, True, False, False]
        assert [attn[i]["window"] for i in range(6)] == [None, 5, 5] * 2
        rows = [[5], [17]]  # one token: every later step is a decode step
        out = generate(opt, rows, 16)
        for b, row in enumerate(rows):
            assert torch.equal(out[b], reference_greedy(opt, row, 16)), (p, b)


def test_sparse_passes_refuse_local_layers_by_name(lifted):
    from rewriter.errors import PassError
    from rewriter.passes import DuoAttention, TidalDecode
    cases = [
        (TidalDecode(selection_layers=[1], top_k=3), "layer 1 is a local layer"),
        (TidalDecode(top_k=3, calibrate=[list(range(40))]),
         r"calibration .* layers \[1, 2, 4, 5\] are local"),
        (DuoAttention([[0.9, 0.1]] * 6, sinks=1, window=4), "has a sliding window"),
    ]
    for p, message in cases:
        with pytest.raises(PassError, match=message):
            optimized(lifted, "gqa-wide-6l", [p])


def test_kv_sharing_between_a_local_and_a_global_layer_is_refused_by_name(lifted):
    """A local layer's cache is a window, a global one's the whole context, and each kind
    rotates by its own RoPE base: they cannot hold one cache. Two local layers can."""
    from rewriter.errors import PassError
    from rewriter.passes import MiniCache, ShareKV
    for p in (ShareKV(sources={1: 0}), MiniCache(start=0)):
        with pytest.raises(PassError, match="window|rotate"):
            optimized(lifted, "mqa-4l", [p])
    model, opt = optimized(lifted, "gqa-3l", [ShareKV(sources={1: 0})])  # both local
    assert attention_by_layer(opt)[1]["kv_source"] == 0
    out = generate(opt, [prompt(9, 1, model.config.vocab_size)[0].tolist()])
    assert out.shape == (1, 9 + NEW)  # lossy (layer 1's own K/V are gone): it runs


@pytest.mark.slow
@pytest.mark.xdist_group("tp")
def test_tensor_parallel_splits_whole_heads_on_two_ranks(tp_ranks):
    """Two ranks (gloo), each with one KV group of two heads, the QK-norms' weights whole;
    then with the fusions and FuseAllReduceRMSNorm, which finds no site in Gemma's layer:
    tokens equal one process's, log-probabilities within float32 rounding."""
    from tp_tools import same_as_one_process
    ranks = same_as_one_process(tp_ranks, ["gemma3", "gemma3_fused"])
    assert set(ranks[0]) >= {"gemma3.tokens", "gemma3_fused.tokens"}


def test_tensor_parallel_plan_and_its_refusals(lifted):
    from rewriter.errors import PassError
    from rewriter.ir.shard import plan, row_projections
    from rewriter.passes import FuseAllReduceRMSNorm, TensorParallel
    _, traced, opt = lifted("gqa-3l")
    ir = opt.ir
    for rank in (0, 1):
        p = plan(ir, row_projections(ir), rank, 2)
        assert "model.layers.0.self_attn.q_norm.weight" not in p.weights  # whole on each rank
        assert p.weights["model.layers.0.self_attn.q_proj.weight"] == (0, ((rank * 48, rank * 48 + 48),))
    split = rewriter.optimize(traced, passes=[TensorParallel(2), FuseAllReduceRMSNorm()])
    assert split.ir.info["fusions"]["FuseAllReduceRMSNorm"] == 0
    _, mqa, _ = lifted("mqa-4l")
    with pytest.raises(PassError, match="has 1 KV heads; each of 2 ranks needs a whole one"):
        rewriter.optimize(mqa, passes=[TensorParallel(2)])
