"""Sliding-window layers keep a ring of their window's slots (``runtime.window_ring``):
greedy tokens equal Hugging Face's no-cache forward past the window (a Mistral config, and
Gemma 3's sliding/full pattern), in every way a step can write the ring: a long prompt,
chunks, one token, padded rows, speculative rounds that roll back, a token tree compacted;
artifacts and the Triton backend keep it; ``kv_bytes_per_token`` counts the ring."""
from __future__ import annotations

import functools

import pytest
import torch
import transformers as T

import rewriter
from rewriter.errors import PassError
from rewriter.passes import (DuoAttention, MedusaHeads, MiniCache, PromptLookup, Quest,
                             SelfSpeculative, ShareKV, StreamingAttention, TidalDecode)
from rewriter.runtime.kv_cache import cache_table

from conftest import traced_model

KW = dict(max_new_tokens=16, eos_token_id=[])
RAGGED = [[3, 17, 42, 5, 99, 8, 64, 11, 12, 40, 41, 7, 9], [1, 2, 3], [50, 51, 52, 53, 54, 55]]


def gemma(window: int = 4) -> T.PreTrainedModel:
    """A tiny Gemma 3: sliding and full layers alternating; small weights and unit-scale
    norms so that its greedy text varies (larger ones repeat one token)."""
    cfg = T.Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=16, sliding_window=window, query_pre_attn_scalar=16,
                             max_position_embeddings=256, initializer_range=0.05,
                             layer_types=["sliding_attention", "full_attention"] * 2)
    torch.manual_seed(0)
    model = T.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 1.0)
    return model


@functools.lru_cache(maxsize=None)
def models(family: str):
    """(Hugging Face model, its trace) of one family."""
    if family == "gemma":
        model = gemma()
        return model, rewriter.trace(model)
    model, traced = traced_model("mistral-window-3l", initializer_range=0.1)  # window 5
    return model, traced


@functools.lru_cache(maxsize=None)
def plain(family: str):
    return rewriter.optimize(models(family)[1])


def hf_greedy(model, row: list[int], n: int) -> list[int]:
    """Greedy tokens from Hugging Face's forward over the whole text, no cache: its sliding
    window masks, independent of any cache."""
    x = torch.tensor([row])
    for _ in range(n):
        with torch.no_grad():
            logits = model(x, use_cache=False).logits[:, -1]
        x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    return x[0, len(row):].tolist()


def prompt(length: int = 30) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 128, (1, length))


def window_of(family: str) -> int:
    return 4 if family == "gemma" else 5


@pytest.mark.parametrize("family", ["gemma", "mistral"])
def test_greedy_equals_hugging_face_past_the_window(family):
    model, opt = models(family)[0], plain(family)
    ids = prompt()
    want = hf_greedy(model, ids[0].tolist(), KW["max_new_tokens"])
    assert len(set(want)) > 3  # a text that varies
    assert opt.generate(ids, **KW)[0, 30:].tolist() == want
    windows = {i: s.window for i, s in cache_table(opt.ir.gm).items()}
    # the sliding layers are rings of exactly the window, the full layers are whole
    assert opt._cache.spans == {i: w for i, w in windows.items() if w is not None}
    assert opt._cache.spans and opt._cache.k[next(iter(opt._cache.spans))].shape[2] == window_of(family)
    long = torch.cat([ids, ids[:, :10]], dim=1)  # 40 tokens: three chunks of 16
    chunked = opt.generate(long, prefill_chunk=16, **KW)[0, 40:].tolist()
    assert chunked == hf_greedy(model, long[0].tolist(), KW["max_new_tokens"])


@pytest.mark.parametrize("family", ["gemma", "mistral"])
def test_padded_ragged_rows_equal_hugging_face_each_alone(family):
    model, opt = models(family)[0], plain(family)
    together = opt.generate(RAGGED, **KW)
    for i, row in enumerate(RAGGED):
        assert together[i, -KW["max_new_tokens"]:].tolist() == hf_greedy(model, row, 16), i


def test_the_window_matters_so_a_wrong_ring_would_show():
    """The same weights with a window longer than the text give other tokens: the ring's
    masks are what the tests above compare."""
    wide = gemma(window=64)
    wide.load_state_dict(models("gemma")[0].state_dict())
    row = prompt()[0].tolist()
    assert hf_greedy(wide, row, 16) != hf_greedy(models("gemma")[0], row, 16)


@pytest.mark.parametrize("family", ["gemma", "mistral"])
def test_self_speculative_rounds_that_roll_back_equal_plain_greedy(family):
    spec = rewriter.optimize(models(family)[1], passes=[SelfSpeculative(skip_layers=[1],
                                                                       max_draft=3, threshold=0.0)])
    assert torch.equal(spec.generate(RAGGED, **KW), plain(family).generate(RAGGED, **KW))
    s = spec.stats
    assert 0 < s["accepted"] < s["drafted"]  # drafts accepted and rejected: rolled back
    slack = 2 * (3 + 1)  # the strategy's cache_slack(): 2 (max_draft + 1)
    assert set(spec._cache.spans.values()) == {window_of(family) + slack}


@pytest.mark.parametrize("slack, same", [(2, True), (1, False)])
def test_a_rolled_back_round_needs_window_plus_its_tokens_less_two_slots(slack, same, monkeypatch):
    """The rule in ``runtime.window_ring``: rounds writing ``T`` = 4 tokens (3 drafts and
    the accepted one) need ``R >= window + T - 2``; one slot fewer loses keys a later query
    sees. (The engine gives the strategy's ``cache_slack()``, 8 here.)"""
    from rewriter.runtime import kv_cache
    made = kv_cache.KVCache.__init__

    def exact(self, table, batch, max_len, dtype, device, slack_=0):
        made(self, table, batch, max_len, dtype, device, slack if slack_ else 0)
    monkeypatch.setattr(kv_cache.KVCache, "__init__", exact)
    spec = rewriter.optimize(models("gemma")[1], passes=[SelfSpeculative(skip_layers=[1],
                                                                       max_draft=3, threshold=0.0)])
    got = spec.generate(RAGGED, **KW)
    assert set(spec._cache.spans.values()) == {4 + slack}
    assert torch.equal(got, plain("gemma").generate(RAGGED, **KW)) == same


def test_static_decode_steps_read_the_start_on_the_device():
    """The CUDA-graph step's form (the start a device tensor), plain and in rounds."""
    opt = rewriter.optimize(models("gemma")[1])
    spec = rewriter.optimize(models("gemma")[1], passes=[SelfSpeculative(skip_layers=[1],
                                                                       max_draft=3, threshold=0.0)])
    opt.static_decode = spec.static_decode = True
    want = plain("gemma").generate(RAGGED, **KW)
    assert torch.equal(opt.generate(RAGGED, **KW), want)
    assert torch.equal(spec.generate(RAGGED, **KW), want)


def test_prompt_lookup_chains_equal_plain_greedy():
    pl = rewriter.optimize(models("gemma")[1], passes=[PromptLookup(tokens=3, adapt=False)])
    ids = [row * 3 for row in RAGGED[1:]]  # text that repeats: chains to copy
    assert torch.equal(pl.generate(ids, **KW), plain("gemma").generate(ids, **KW))
    assert pl.stats["copied"] > 0 and pl.stats["accepted"] < pl.stats["copied"]


def test_a_medusa_tree_compacted_in_the_ring_equals_plain_greedy():
    torch.manual_seed(3)
    med = rewriter.optimize(models("gemma")[1],
                            passes=[MedusaHeads(num_heads=2, tree=[[0], [1], [2], [0, 0], [1, 0]])])
    assert torch.equal(med.generate(RAGGED, **KW), plain("gemma").generate(RAGGED, **KW))
    assert med.stats["rounds"] > 0 and med.stats.get("kv_moves", 0) > 0 or med.stats["accepted"] == 0


def test_the_artifact_keeps_the_rings(tmp_path):
    spec = rewriter.optimize(models("gemma")[1], passes=[SelfSpeculative(skip_layers=[1],
                                                                        max_draft=2, threshold=0.0)])
    spec.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert cache_table(loaded.ir.gm) == cache_table(spec.ir.gm)
    assert torch.equal(loaded.generate(RAGGED, **KW), plain("gemma").generate(RAGGED, **KW))
    assert loaded._cache.spans == {0: 4 + 6, 2: 4 + 6}


def test_the_triton_backend_gives_the_same_tokens():
    tri = rewriter.optimize(models("gemma")[1], backend="triton")
    kw = dict(max_new_tokens=8, eos_token_id=[])
    rows = [RAGGED[0], RAGGED[2]]
    assert torch.equal(tri.generate(rows, **kw), plain("gemma").generate(rows, **kw))
    assert tri._cache.spans == {0: 4, 2: 4}


def test_kv_bytes_per_token_counts_the_window_slots():
    cfg = models("gemma")[0].config
    per_slot = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    opt = plain("gemma")
    for tokens in (3, 4, 5, 100, 256):
        local = min(tokens, cfg.sliding_window)  # ring slots, or the text where shorter
        want = (2 * local + 2 * tokens) * per_slot // tokens  # 2 sliding, 2 full layers
        assert opt.kv_bytes_per_token(tokens) == want, tokens
        # a decode step reads the window of a sliding layer, the text of a full one
        assert opt.kv_read_bytes(tokens) == (2 * local + 2 * tokens) * per_slot, tokens
    cfg = models("mistral")[0].config
    per_slot = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert plain("mistral").kv_bytes_per_token(100) == 3 * 5 * per_slot // 100


def no_cache_greedy(opt, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy tokens from the IR's own forward over the whole text (its reference ops)."""
    x = ids
    for _ in range(n):
        x = torch.cat([x, opt(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


# each pass on a model whose sliding layers already hold a window: rings where the
# layer's cache keeps plain windows, whole caches where a selection reads positions
COMPOSED = {
    # StreamingAttention sinks the global layers only: the local ones keep their rings
    "streaming": ([StreamingAttention(sinks=2, window=6)], {0: 4, 2: 4}),
    "duo": ([DuoAttention([[1.0], [0.0], [0.0], [1.0]], sinks=2, window=4)], {}),
    "share_sliding": ([ShareKV(sources={2: 0})], {0: 4}),
    "share_global_reads_sliding": ([ShareKV(sources={1: 0})], {2: 4}),
    "share_sliding_reads_global": ([ShareKV(sources={2: 1})], {0: 4}),
}


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_sparse_passes_on_window_layers_equal_their_no_cache_forward(name):
    passes, rings = COMPOSED[name]
    try:
        opt = rewriter.optimize(models("gemma")[1], passes=passes)
    except PassError as refused:  # the pass's own policy: refused, naming the window
        assert "window" in str(refused)
        return
    ids = prompt()
    assert torch.equal(opt.generate(ids, max_new_tokens=12, eos_token_id=[]),
                       no_cache_greedy(opt, ids, 12))
    assert opt._cache.spans == rings


@pytest.mark.parametrize("passes", [[Quest(page=4, budget=8, dense_layers=1)],
                                    [TidalDecode(selection_layers=[1], top_k=4)],
                                    [MiniCache(start=2)]], ids=["quest", "tidal", "minicache"])
def test_passes_that_read_cache_positions_keep_those_caches_whole(passes):
    try:
        opt = rewriter.optimize(models("gemma")[1], passes=passes)
    except PassError as refused:  # the pass's own policy: refused, naming the window
        assert "window" in str(refused)
        return
    table = cache_table(opt.ir.gm)
    opt.generate(prompt(), max_new_tokens=12, eos_token_id=[])
    for i, span in opt._cache.spans.items():  # a ring only where no selection reads it
        assert table[i].page is None and table[i].merge is None and span == table[i].window
