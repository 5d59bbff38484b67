"""What a decode step reads from the KV cache (``engine.kv_read_bytes``), counted by hand.

The 3-layer test model has 2 KV heads of 16 in float32: one token of one head is 128
bytes of K and V, so a whole layer at 100 tokens reads 2 * 128 * 100 = 25600 bytes.
"""
import pytest
import torch

import rewriter
from rewriter.measure.attention_recall import best_selection_layers
from rewriter.passes import DuoAttention, Quest, StreamingAttention, TidalDecode

from conftest import make_model

T = 100
LAYER = 2 * 128 * T  # a whole cache
TOKEN = 2 * 128  # one token, both KV heads


@pytest.fixture(scope="module")
def model():
    return make_model("llama-gqa-3l", initializer_range=0.2)


def reads(model, *passes, tokens=T):
    return rewriter.optimize(model, passes=list(passes)).kv_read_bytes(tokens)


def test_dense_reads_every_token_of_every_layer(model):
    assert reads(model) == 3 * LAYER
    opt = rewriter.optimize(model)
    assert opt.kv_read_bytes() == opt.kv_bytes_per_token() * opt.max_len


def test_tidal_decode_reads_its_selection_and_select_own_scores_every_key(model):
    # the paper's: layer 0 attends fully, 1 and 2 read top_k 9 + the query
    assert reads(model, TidalDecode(selection_layers=[0], top_k=9)) == LAYER + 2 * 10 * TOKEN
    # select_own: layer 0 reads every key (half a token's bytes) and 10 tokens' values
    own = reads(model, TidalDecode(selection_layers=[0], top_k=9, select_own=True))
    assert own == TOKEN // 2 * (T + 10) + 2 * 10 * TOKEN
    # the calibration's cost model says the same fraction of dense: layer 0's selection
    # keeping everything everywhere, the programme chooses [0] alone
    kept = torch.ones(3, 3).triu()
    choice = best_selection_layers(kept, T, 9, 0, budget=1.0, select_own=True)
    assert choice.selection_layers == [0]
    assert choice.bytes_read == pytest.approx(own / (3 * LAYER))
    # recent widens the selection; a cache shorter than it reads everything
    assert reads(model, TidalDecode(selection_layers=[0], top_k=9, recent=5)) == LAYER + 2 * 15 * TOKEN
    assert reads(model, TidalDecode(selection_layers=[0], top_k=9), tokens=5) == 3 * 5 * TOKEN


def test_quest_reads_its_pages_and_every_pages_bounds(model):
    got = reads(model, Quest(page=4, budget=8, dense_layers=1))
    bounds = TOKEN // 2 * 2 * (T // 4)  # max and min keys of 25 pages, both KV heads
    assert got == LAYER + 2 * (9 * TOKEN + bounds)
    # 102 tokens: 26 pages, the last one partial; a budget of 10 is 2 whole pages
    got = reads(model, Quest(page=4, budget=10, dense_layers=0, recent=3), tokens=102)
    assert got == 3 * ((8 + 3 + 1) * TOKEN + TOKEN // 2 * 2 * 26)
    # in bfloat16 every byte halves
    bf16 = make_model("llama-gqa-3l", initializer_range=0.2).to(torch.bfloat16)  # not the shared one
    half = rewriter.optimize(bf16, passes=[Quest(page=4, budget=8, dense_layers=1)])
    assert half.kv_read_bytes(T) == (LAYER + 2 * (9 * TOKEN + TOKEN // 2 * 2 * (T // 4))) // 2


def test_a_ring_reads_its_slots_and_a_split_layer_both_parts(model):
    assert reads(model, StreamingAttention(sinks=4, window=8)) == 3 * 12 * TOKEN
    assert reads(model, StreamingAttention(sinks=4, window=8), tokens=7) == 3 * 7 * TOKEN
    # layer 0 keeps KV head 0 whole and rings head 1; layer 1 rings both; layer 2 keeps both
    duo = reads(model, DuoAttention(gates=[[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], sinks=2, window=6))
    head = TOKEN // 2  # one KV head's K and V of one token
    assert duo == head * T + head * 8 + 2 * head * 8 + LAYER


def test_a_sliding_window_reads_its_window():
    mistral = make_model("mistral-window-3l")  # every layer sees its last 5 tokens
    opt = rewriter.optimize(mistral)
    per_token = opt.kv_bytes_per_token(3)  # shorter than the window: every token is held
    assert opt.kv_read_bytes(T) == 5 * per_token
    assert opt.kv_read_bytes(3) == 3 * per_token
    # and what is held is the window's ring, not the text (runtime.window_ring)
    assert opt.kv_bytes_per_token(T) == 5 * per_token // T


def test_bad_lengths_are_refused(model):
    opt = rewriter.optimize(model)
    for bad in (0, -3, 1.5, True, "100"):
        with pytest.raises(ValueError, match="tokens must be an integer >= 1"):
            opt.kv_read_bytes(bad)
