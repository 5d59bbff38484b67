"""EAGLE's draft layer: the unrolled training form against the decoding step it trains."""
from __future__ import annotations

import pytest
import torch

from rewriter.drafts import eagle

SHAPE = eagle.Shape(hidden=32, heads=4, kv_heads=2, intermediate=48, rope_theta=500.0, eps=1e-6)


def _setup(batch: int = 2, length: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = eagle.init(SHAPE, g, norm=torch.rand(SHAPE.hidden, generator=g) + 0.5)
    p["fc.bias"] = torch.randn(SHAPE.hidden, generator=g)  # not zero: exercised
    features = torch.randn(batch, length, SHAPE.hidden, generator=g)
    embedded = torch.randn(batch, length, SHAPE.hidden, generator=g)  # e(x_{i+1}) at i
    return p, features, embedded


def _chain(p, features, embedded, t: int, depth: int) -> list:
    """Decoding as a runtime would: the model's features up to ``t`` in one step, then the
    draft's own feature fed back, one position a step."""
    cache = eagle.empty_cache(SHAPE, features.shape[0])
    out, cache = eagle.step(p, SHAPE, features[:, :t + 1], embedded[:, :t + 1], cache)
    feats = [out[:, -1]]
    for s in range(1, depth):
        i = t + s
        out, cache = eagle.step(p, SHAPE, feats[-1][:, None], embedded[:, i:i + 1], cache)
        feats.append(out[:, 0])
    assert cache[0].shape[2] == t + depth
    return feats


def test_unrolled_steps_equal_decoding_at_every_chain_start():
    p, features, embedded = _setup()
    depth = 4
    with torch.no_grad():
        outs = eagle.unroll(p, SHAPE, features, embedded, depth)
        for t in range(features.shape[1] - depth + 1):
            for s, got in enumerate(_chain(p, features, embedded, t, depth)):
                assert torch.allclose(outs[s][:, t + s], got, atol=1e-5, rtol=0), (t, s)


def test_chains_near_the_end_and_rows_shorter_than_the_chain():
    p, features, embedded = _setup(batch=1, length=3, seed=4)
    with torch.no_grad():
        outs = eagle.unroll(p, SHAPE, features, embedded, 6)  # more steps than positions
        assert len(outs) == 6 and all(o.shape == features.shape for o in outs)
        assert all(torch.isfinite(o).all() for o in outs)
        # the chains that do fit still equal decoding, the last start included
        for t in range(3):
            for s, got in enumerate(_chain(p, features, embedded, t, 3 - t)):
                assert torch.allclose(outs[s][:, t + s], got, atol=1e-5, rtol=0), (t, s)


def test_it_runs_where_its_inputs_are():
    # nothing made on the CPU behind the caller's back (a GPU run would fail there)
    p, features, embedded = _setup(length=5)
    meta = {k: v.to("meta") for k, v in p.items()}
    outs = eagle.unroll(meta, SHAPE, features.to("meta"), embedded.to("meta"), 3)
    assert all(o.device.type == "meta" and o.shape == features.shape for o in outs)
    out, (k, v) = eagle.step(meta, SHAPE, features.to("meta"), embedded.to("meta"),
                             eagle.empty_cache(SHAPE, 2, device="meta"))
    assert out.device.type == k.device.type == "meta" and k.shape[2] == 5


def test_a_step_of_many_positions_equals_one_at_a_time():
    p, features, embedded = _setup(batch=3, length=7, seed=1)
    with torch.no_grad():
        whole, (k, v) = eagle.step(p, SHAPE, features, embedded, eagle.empty_cache(SHAPE, 3))
        cache, parts = eagle.empty_cache(SHAPE, 3), []
        for i in range(7):
            out, cache = eagle.step(p, SHAPE, features[:, i:i + 1], embedded[:, i:i + 1], cache)
            parts.append(out)
    assert torch.allclose(whole, torch.cat(parts, 1), atol=1e-5, rtol=0)
    assert torch.allclose(k, cache[0], atol=1e-6) and torch.allclose(v, cache[1], atol=1e-6)
    assert k.shape == (3, SHAPE.kv_heads, 7, SHAPE.head_dim)


def test_a_later_step_depends_on_the_draft_s_own_feature():
    # step 2 must read step 1's output, not the model's feature at the next position
    p, features, embedded = _setup(length=6, seed=2)
    with torch.no_grad():
        a = eagle.unroll(p, SHAPE, features, embedded, 2)
        changed = features.clone()
        changed[:, 3] += 1.0  # the model's feature at 3: a chain from 2 never reads it
        b = eagle.unroll(p, SHAPE, changed, embedded, 2)
    assert torch.allclose(a[1][:, 3], b[1][:, 3], atol=1e-6)  # chain from t = 2, step 2
    assert not torch.allclose(a[0][:, 3], b[0][:, 3])  # step 1 at 3 reads it


def test_every_parameter_learns_from_the_deepest_step():
    p, features, embedded = _setup(length=8, seed=3)
    for t in p.values():
        t.requires_grad_(True)
    outs = eagle.unroll(p, SHAPE, features, embedded, 3)
    outs[-1][:, 2:].pow(2).sum().backward()
    for name, t in p.items():
        assert t.grad is not None and t.grad.abs().sum() > 0, name


@pytest.mark.parametrize("odd", [dict(attention_bias=True), dict(hidden_act="gelu"),
                                 dict(head_dim=16),
                                 dict(rope_scaling={"rope_type": "linear", "factor": 2.0})])
def test_a_layer_it_does_not_compute_is_refused(odd):
    from transformers import LlamaConfig
    c = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=96, **odd)
    with pytest.raises(ValueError, match="not the plain Llama layer"):
        eagle.Shape.of(c)


def test_shape_of_a_llama_config():
    from transformers import LlamaConfig
    c = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=96, rms_norm_eps=1e-5, rope_theta=1e5)
    s = eagle.Shape.of(c)
    assert (s.hidden, s.heads, s.kv_heads, s.intermediate, s.head_dim) == (64, 8, 2, 96, 8)
    assert s.rope_theta == 1e5 and s.eps == 1e-5


@pytest.mark.parametrize("kwargs", [dict(hidden=30, heads=4, kv_heads=2, intermediate=8),
                                    dict(hidden=32, heads=4, kv_heads=3, intermediate=8),
                                    dict(hidden=32, heads=0, kv_heads=1, intermediate=8),
                                    dict(hidden=True, heads=1, kv_heads=1, intermediate=8),
                                    dict(hidden=32, heads=4, kv_heads=2, intermediate=8, eps=0.0),
                                    dict(hidden=32, heads=4, kv_heads=2, intermediate=8,
                                         rope_theta=float("nan"))])
def test_bad_shapes_are_refused(kwargs):
    with pytest.raises(ValueError, match="eagle.Shape"):
        eagle.Shape(**kwargs)


def test_bad_inputs_are_refused_by_name():
    p, features, embedded = _setup(length=5)
    for depth in (0, True, 2.0):
        with pytest.raises(ValueError, match="depth must be a positive int"):
            eagle.unroll(p, SHAPE, features, embedded, depth)
    with pytest.raises(ValueError, match="features and embedded_next"):
        eagle.unroll(p, SHAPE, features, embedded[:, :4], 2)
    with pytest.raises(ValueError, match="feature and embedded"):
        eagle.step(p, SHAPE, features[..., :16], embedded[..., :16], eagle.empty_cache(SHAPE, 2))
    with pytest.raises(ValueError, match="the cache must be"):
        eagle.step(p, SHAPE, features, embedded, eagle.empty_cache(SHAPE, 3))
    k, v = eagle.empty_cache(SHAPE, 2)
    for bad in ((k[..., :4], v[..., :4]), (k[0], v[0])):
        with pytest.raises(ValueError, match="the cache must be"):
            eagle.step(p, SHAPE, features, embedded, bad)
    with pytest.raises(ValueError, match="cache must be"):
        eagle.step(p, SHAPE, features, embedded, (k, None))


def test_a_tree_level_equals_each_node_decoded_along_its_own_path():
    # three levels: two nodes below the root, three below them, two below those; each
    # against step() along the node's own path. Queries and keys are scaled up so that
    # attention is far from uniform: a key at the wrong RoPE position changes the output.
    p, features, embedded = _setup(batch=1, length=7, seed=3)
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        p[name] = p[name] * 15
    g = torch.Generator().manual_seed(5)
    tokens = torch.randn(7, SHAPE.hidden, generator=g)  # embeddings of drafted tokens
    with torch.no_grad():
        out, cache = eagle.step(p, SHAPE, features, embedded, eagle.empty_cache(SHAPE, 1))
        root = out[0, -1]  # [H] the draft's feature after the text
        f1, k1, v1 = eagle.tree_step(p, SHAPE, root.expand(2, -1), tokens[:2], cache, None, 7)
        up2 = torch.tensor([0, 0, 1])  # level 2: tokens 2, 3 below node 0; 4 below node 1
        f2, k2, v2 = eagle.tree_step(p, SHAPE, f1[up2], tokens[2:5], cache,
                                     (k1[up2], v1[up2]), 8)
        up3 = torch.tensor([0, 2])  # level 3: token 5 below (0, 2); token 6 below (1, 4)
        path3 = (torch.cat([k1[up2][up3], k2[up3]], 2), torch.cat([v1[up2][up3], v2[up3]], 2))
        f3, _, _ = eagle.tree_step(p, SHAPE, f2[up3], tokens[5:], cache, path3, 9)
        got = {(0,): f1[0], (1,): f1[1], (0, 2): f2[0], (0, 3): f2[1], (1, 4): f2[2],
               (0, 2, 5): f3[0], (1, 4, 6): f3[1]}
        for nodes, feature in got.items():
            f, grown = root[None, None], cache
            for t in nodes:
                out, grown = eagle.step(p, SHAPE, f, tokens[t][None, None], grown)
                f = out
            torch.testing.assert_close(feature, f[0, 0])
        assert cache[0].shape[2] == 7  # the shared cache is left as it was


def test_rows_of_different_lengths_draft_a_level_together():
    """``tree_level`` over a padded batch (rows of 5, 1 and 11 positions, the padding large
    and finite) equals ``tree_step`` on each row's own cache, with and without ancestors."""
    p, _, _ = _setup(batch=1, length=3, seed=7)
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        p[name] = p[name] * 15  # attention far from uniform: padding read would show
    g = torch.Generator().manual_seed(8)
    lengths, n, kv, d = [5, 1, 11], 3, SHAPE.kv_heads, SHAPE.head_dim
    keys = torch.randn(3, kv, 12, d, generator=g) * 100  # past each length: padding
    values = torch.randn(3, kv, 12, d, generator=g) * 100
    feature, embedded = torch.randn(3, n, SHAPE.hidden, generator=g), torch.randn(3, n, SHAPE.hidden, generator=g)
    path = (torch.randn(3, n, kv, 2, d, generator=g), torch.randn(3, n, kv, 2, d, generator=g))
    for ancestors in (None, path):
        with torch.no_grad():
            got = eagle.tree_level(p, SHAPE, feature, embedded, keys, values, torch.tensor(lengths),
                                   ancestors)
            for r, length in enumerate(lengths):
                cache = (keys[r:r + 1, :, :length], values[r:r + 1, :, :length])
                row_path = None if ancestors is None else (ancestors[0][r], ancestors[1][r])
                want = eagle.tree_step(p, SHAPE, feature[r], embedded[r], cache, row_path,
                                       length + (0 if ancestors is None else 2))
                for a, b in zip(got, want):
                    torch.testing.assert_close(a[r], b)


def test_a_tree_level_refuses_inconsistent_inputs():
    p, features, embedded = _setup(batch=1, length=3)
    _, cache = eagle.step(p, SHAPE, features, embedded, eagle.empty_cache(SHAPE, 1))
    f, e = features[0, :2], embedded[0, :2]
    kv = torch.zeros(2, SHAPE.kv_heads, 1, SHAPE.head_dim)
    with pytest.raises(ValueError, match="position 5 must be"):
        eagle.tree_step(p, SHAPE, f, e, cache, (kv, kv), 5)
    with pytest.raises(ValueError, match="position 4.0 must be"):
        eagle.tree_step(p, SHAPE, f, e, cache, (kv, kv), 4.0)
    with pytest.raises(ValueError, match="path must be two"):
        eagle.tree_step(p, SHAPE, f, e, cache, (kv, torch.zeros(2, SHAPE.kv_heads, 2, SHAPE.head_dim)), 4)
    with pytest.raises(ValueError, match="path must be two"):
        eagle.tree_step(p, SHAPE, f, e, cache, (kv[:1], kv[:1]), 4)
    with pytest.raises(ValueError, match="path must be \\(keys, values\\)"):
        eagle.tree_step(p, SHAPE, f, e, cache, kv, 4)
    with pytest.raises(ValueError, match="cache must be two"):
        eagle.tree_step(p, SHAPE, f, e, (cache[0], cache[1][..., :2]), None, 3)
    with pytest.raises(ValueError, match="cache must be \\(keys, values\\)"):
        eagle.tree_step(p, SHAPE, f, e, (cache[0], None), None, 3)
    with pytest.raises(ValueError, match="feature and embedded"):
        eagle.tree_step(p, SHAPE, f[0], e[0], cache, None, 3)


def test_a_rope_base_too_large_for_a_float_is_refused():
    with pytest.raises(ValueError, match="rope_theta must be a positive finite number"):
        eagle.Shape(hidden=32, heads=4, kv_heads=2, intermediate=48, rope_theta=10 ** 400)
    assert eagle.Shape(hidden=32, heads=4, kv_heads=2, intermediate=48, rope_theta=500).rope_theta == 500.0


def test_a_one_position_bfloat16_step_takes_the_fast_attention(monkeypatch):
    # a catch-up of one position over a long cache: rewriter.maths.sdpa's grouped float32 path
    # (on a machine where ATen's CPU kernel is slow there: taken as measured so),
    # equal to the float32 step to bfloat16's precision
    import rewriter.maths.sdpa as sdpa_module
    monkeypatch.setattr(sdpa_module, "_PAYS", {torch.bfloat16: True})
    monkeypatch.delenv(sdpa_module.ENV, raising=False)
    p, features, embedded = _setup(batch=2, length=161, seed=2)
    half = {k: v.to(torch.bfloat16) for k, v in p.items()}
    exact = {k: v.float() for k, v in half.items()}  # the same rounded weights, in float32
    with torch.no_grad():
        _, cache = eagle.step(exact, SHAPE, features[:, :160], embedded[:, :160],
                              eagle.empty_cache(SHAPE, 2))
        want, _ = eagle.step(exact, SHAPE, features[:, 160:], embedded[:, 160:], cache)
        aten, calls = sdpa_module.F.scaled_dot_product_attention, []
        monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention",
                            lambda *a, **kw: calls.append(a) or aten(*a, **kw))
        got, _ = eagle.step(half, SHAPE, features[:, 160:].bfloat16(), embedded[:, 160:].bfloat16(),
                            tuple(c.bfloat16() for c in cache))
    assert calls == []  # 2 rows x 4 heads x 161 keys: the grouped path, not the kernel
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 0.01 * want.abs().max()  # 0.004 measured


def test_fused_products_give_the_separate_ones_values():
    # the runtime's weights (eagle.fused: q/k/v and gate/up stacked) against the file's
    p, features, embedded = _setup(batch=2, length=9, seed=3)
    f = eagle.fused(p)
    assert f["qkv.weight"].shape == (SHAPE.hidden + 2 * SHAPE.kv_heads * SHAPE.head_dim, SHAPE.hidden)
    assert "self_attn.k_proj.weight" not in f and "mlp.up_proj.weight" not in f  # not kept twice
    with torch.no_grad():
        want, (wk, wv) = eagle.step(p, SHAPE, features, embedded, eagle.empty_cache(SHAPE, 2))
        got, (gk, gv) = eagle.step(f, SHAPE, features, embedded, eagle.empty_cache(SHAPE, 2))
        for a, b in ((got, want), (gk, wk), (gv, wv)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        lengths = torch.tensor([9, 6])
        path = (torch.randn(2, 3, SHAPE.kv_heads, 1, SHAPE.head_dim),
                torch.randn(2, 3, SHAPE.kv_heads, 1, SHAPE.head_dim))
        level = [eagle.tree_level(w, SHAPE, features[:, :3], embedded[:, :3], wk, wv, lengths, path)
                 for w in (p, f)]
        for a, b in zip(*level):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

