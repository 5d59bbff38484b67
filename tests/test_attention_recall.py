"""rewriter.measure.attention_recall: the attention a TidalDecode selection keeps, and the selection
layers chosen within a KV-bytes budget."""
import pytest
import torch

import rewriter
from rewriter.measure.attention_recall import (Recorded, attention_rows, best_selection_layers,
                                       kept_mass, selections)
from rewriter.ops import REFERENCE
from rewriter.passes import FuseQKV, FuseRoPE, TidalDecode

from conftest import make_model


def ir_of(model, passes=()):
    return rewriter.optimize(model, passes=list(passes)).ir


@pytest.mark.parametrize("passes", [(), (FuseQKV(), FuseRoPE())])
def test_rows_are_the_models_own_attention_weights(passes):
    model = make_model("llama-gqa-3l", initializer_range=0.2)
    ids = torch.randint(1, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    layers = attention_rows(ir_of(model, passes), ids, queries=5)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        eager = model(ids, output_attentions=True)
    assert len(layers) == len(eager.attentions) == 3
    for mine, theirs in zip(layers, eager.attentions):  # theirs [B, Hq, T, T]
        torch.testing.assert_close(mine.weights, theirs[:, :, -5:], rtol=1e-4, atol=1e-6)
        assert mine.q.shape[:3] == (2, 4, 5) and mine.k.shape[:3] == (2, 2, 24)  # Hq 4, Hkv 2
        assert mine.q.shape[3] == mine.k.shape[3]


def test_rows_refuse_bad_shapes_and_sparse_attention_by_name():
    model = make_model("llama-gqa-3l")
    ir = ir_of(model)
    with pytest.raises(ValueError, match="queries"):
        attention_rows(ir, torch.ones(1, 4, dtype=torch.long), queries=4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        attention_rows(ir, torch.ones(4, dtype=torch.long), queries=1)
    tidal = ir_of(model, [TidalDecode(selection_layers=[0], top_k=2)])
    with pytest.raises(ValueError, match=r"^attention_rows: layer 1's attention has select"):
        attention_rows(tidal, torch.ones(1, 8, dtype=torch.long), queries=2)


@pytest.mark.parametrize("top_k,recent", [(1, 0), (3, 0), (2, 3), (8, 3)])
def test_selections_are_the_ops_own(top_k, recent):
    """The positions each KV head's group gets are those rw.select_tokens picks (plus the
    query itself, which attention always reads); (8, 3) leaves -1 entries for the first
    queries, which have fewer than 8 keys before their window."""
    g = torch.Generator().manual_seed(1)
    b, t, hq, hkv, d, q = 2, 12, 4, 2, 8, 6
    qs, ks = torch.randn(b, t, hq * d, generator=g), torch.randn(b, t, hkv * d, generator=g)
    qh = qs.view(b, t, hq, d).transpose(1, 2)[:, :, -q:]  # [B, Hq, Q, D]
    kh = ks.view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
    got = selections(Recorded(torch.zeros(b, hq, q, t), qh, kh), top_k, recent)  # [B, Hkv, Q, T]
    op = REFERENCE["select_tokens"](qs, ks, 0, hq, hkv, d, top_k, recent)[:, :, -q:]  # [B, Hkv, Q, k]
    if top_k == 8:
        assert (op[:, :, 0] < 0).any()  # the padding path is exercised
    want = torch.zeros(b, hkv, q, t + 1, dtype=torch.bool)
    want.scatter_(-1, torch.where(op < 0, t, op), True)
    want = want[..., :t]
    want[..., torch.arange(q), torch.arange(t - q, t)] = True
    assert torch.equal(got, want)


def test_a_selection_covering_every_token_keeps_everything():
    model = make_model("llama-gqa-3l", initializer_range=0.2)
    ids = torch.randint(1, 100, (1, 20), generator=torch.Generator().manual_seed(2))
    layers = attention_rows(ir_of(model), ids, queries=6)
    whole = kept_mass(layers, top_k=20, recent=0)
    assert torch.allclose(whole.triu(), torch.ones(3, 3).triu(), atol=1e-5)
    assert (whole.tril(-1) == 0).all()
    small = kept_mass(layers, top_k=2, recent=1)
    upper = torch.ones(3, 3, dtype=torch.bool).triu()
    assert (small[upper] < 0.99).all() and (small[upper] > 0).all()


def test_layers_whose_heads_differ_are_refused():
    a = Recorded(torch.zeros(1, 4, 2, 5), torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 5, 8))
    b = Recorded(torch.zeros(1, 4, 2, 5), torch.zeros(1, 4, 2, 8), torch.zeros(1, 1, 5, 8))
    with pytest.raises(ValueError, match="KV heads"):
        kept_mass([a, b], 2, 0)


def test_the_best_selection_layers_within_a_budget():
    # 6 layers; layer 1's selection serves every later layer well, layer 0's poorly
    kept = torch.full((6, 6), 0.2).triu()
    kept[1, 2:] = 0.9
    kept[3, 4:] = 0.95
    # 1000 tokens, 99 + 0 + 1 read by a sparse layer: 0.1 of a dense layer
    one = best_selection_layers(kept, 1000, 99, 0, budget=(1 + 1 + 4 * 0.1) / 6)
    assert one.selection_layers == [1]  # layer 0 dense, 1 selects, 2..5 read its choice
    assert one.bytes_read == pytest.approx(2.4 / 6)
    assert one.kept == pytest.approx((2 + 4 * 0.9) / 6)
    two = best_selection_layers(kept, 1000, 99, 0, budget=(3 + 3 * 0.1) / 6)
    assert two.selection_layers == [1, 3]  # [0, 1, 3] keeps as much with one more selection
    assert two.kept == pytest.approx((2 + 0.9 + 1 + 2 * 0.95) / 6)
    only_first = best_selection_layers(kept, 1000, 99, 0, budget=(1 + 5 * 0.1) / 6)
    assert only_first.selection_layers == [0]
    assert best_selection_layers(kept, 1000, 99, 0, budget=0.05) is None  # nothing fits
    # no budget: the last layer never selects (nothing would read it), so it reads a
    # selection; layer 3's serves 4 and 5 best, and needs no other selection layer
    everything = best_selection_layers(kept, 1000, 99, 0, budget=1.0)
    assert everything.selection_layers == [3]
    assert everything.kept == pytest.approx((4 + 2 * 0.95) / 6)
    assert everything.bytes_read == pytest.approx((4 + 2 * 0.1) / 6)


def _score(kept, sel, own=False) -> float:
    """Kept mass summed over layers for selection layers ``sel`` (dense before the first; a
    selection layer keeps its own top-k's mass with ``own``, everything without)."""
    score, cur = 0.0, None
    for layer in range(kept.shape[0]):
        cur = layer if layer in sel else cur
        if cur is None or (layer in sel and not own):
            score += 1.0
        else:
            score += float(kept[cur, layer])
    return score


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("tokens", [100, 5])  # 5: a sparse layer reads the whole cache
def test_the_programme_equals_a_search_of_every_set(tokens, own):
    """On random matrices (some with ties), for 2 to 7 layers, the dynamic programme finds
    the best of every selection set that fits (brute force over all subsets), with its
    bytes within the budget, as few selection layers as any equal set, and its score.
    With ``own`` (select_own) a selection layer reads every key and its selection's values
    and keeps its own top-k's mass, and the last layer may select."""
    import itertools
    g = torch.Generator().manual_seed(3)
    k = 9  # with tokens=100 a sparse layer reads 0.1 of a dense one
    sparse = min(1.0, (k + 1) / tokens)
    chooser = (1 + sparse) / 2 if own else 1.0

    def read(sel):
        dense, chosen = sel[0], len(sel)
        return (dense + chosen * chooser + (n - dense - chosen) * sparse) / n

    for trial in range(40):
        n = 2 + trial % 6
        kept = torch.rand(n, n, generator=g).triu()
        if trial % 3 == 0:
            kept = (kept * 4).round() / 4  # ties
        budget = 0.2 + 0.1 * (trial % 9)
        best = None  # (score, -selections)
        choosable = range(n) if own else range(n - 1)
        for size in range(1, len(choosable) + 1):
            for sel in itertools.combinations(choosable, size):
                if read(sel) > budget + 1e-12:
                    continue
                cand = (_score(kept, sel, own), -size)
                if best is None or cand[0] > best[0] + 1e-9 or (
                        abs(cand[0] - best[0]) <= 1e-9 and cand[1] > best[1]):
                    best = cand
        got = best_selection_layers(kept, tokens, k, 0, budget, select_own=own)
        assert (got is None) == (best is None)
        if got is None:
            continue
        sel = got.selection_layers
        assert got.kept * n == pytest.approx(best[0]) == pytest.approx(_score(kept, sel, own))
        assert len(sel) == -best[1] and sel == sorted(set(sel))
        assert own or sel[-1] < n - 1  # without select_own the last layer never selects
        assert got.bytes_read == pytest.approx(read(sel))
        assert got.bytes_read <= budget + 1e-12


def test_with_select_own_the_layer_that_keeps_little_from_others_selects_for_itself():
    # 4 layers: layer 0's selection serves 1 and 2 well, layer 3 (a retrieval layer) keeps
    # little of it but much of its own top-k
    kept = torch.zeros(4, 4)
    kept[0] = torch.tensor([0.7, 0.9, 0.9, 0.2])
    kept[3, 3] = 0.8
    kept[1, 1] = kept[2, 2] = 0.5
    # 1000 tokens, a sparse layer 0.1, a selecting one 0.55: [0, 3] reads (2 * 0.55 + 0.2) / 4
    got = best_selection_layers(kept, 1000, 99, 0, budget=1.3 / 4, select_own=True)
    assert got.selection_layers == [0, 3]
    assert got.kept == pytest.approx((0.7 + 0.9 + 0.9 + 0.8) / 4)
    assert got.bytes_read == pytest.approx(1.3 / 4)
    # the paper's TidalDecode cannot afford two layers reading everything at that budget
    paper = best_selection_layers(kept, 1000, 99, 0, budget=1.3 / 4)
    assert paper.selection_layers == [0]
    assert paper.kept == pytest.approx((1 + 0.9 + 0.9 + 0.2) / 4)


def test_one_layer_has_nothing_to_select_for():
    assert best_selection_layers(torch.ones(1, 1), 100, 9, 0, budget=1.0) is None
