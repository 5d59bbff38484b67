"""The KV-cache runtime: greedy generation equals Hugging Face token for token, batches of
different lengths equal their rows run alone, EOS ends rows, bad requests fail early."""
import pytest
import torch

import rewriter
from rewriter.passes import LayerSkip

from conftest import CONFIGS, drop_layers, hf_greedy, make_model, varied_init

NEW = 24


def prompt(batch, length, vocab=100, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def varied(ids):
    """Greedy continuations worth comparing: not one token repeated."""
    return len(set(ids[0].tolist())) > 4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_hugging_face(varied_cache, name):
    model, opt = varied_cache(name)
    ids = prompt(1, 9)
    ours = opt.generate(ids, max_new_tokens=NEW, eos_token_id=[])
    theirs = hf_greedy(model, ids, NEW)
    assert varied(ours[:, 9:]), "continuation degenerate: the test would prove little"
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", ["llama-gqa-3l", "gpt2-3l"])
def test_layer_skip_generates_like_the_layer_deleted_model(name):
    model = make_model(name, initializer_range=varied_init(name))
    opt = rewriter.optimize(model, passes=[LayerSkip(layers=[1])])
    ids = prompt(1, 7)
    theirs = hf_greedy(drop_layers(model, {1}), ids, NEW)
    assert torch.equal(opt.generate(ids, max_new_tokens=NEW, eos_token_id=[]), theirs)


@pytest.mark.parametrize("name", ["llama-gqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_padded_batch_rows_equal_rows_alone(varied_cache, name):
    model, opt = varied_cache(name)
    rows = [prompt(1, n, seed=n)[0].tolist() for n in (3, 11, 7)]
    out = opt.generate(rows, max_new_tokens=NEW, eos_token_id=[])  # [3, 11 + NEW]
    assert out.shape == (3, 11 + NEW)
    for b, row in enumerate(rows):
        alone = hf_greedy(model, torch.tensor([row]), NEW)[0, len(row):]
        assert torch.equal(out[b, 11:], alone), f"row {b} ({len(row)} tokens)"
        assert out[b, 11 - len(row):11].tolist() == row  # left-padded prompt comes back


def test_attention_mask_marks_padding_on_either_side(varied_cache):
    _, opt = varied_cache("qwen2-mqa-3l")
    a, b = prompt(1, 5, seed=2)[0], prompt(1, 8, seed=3)[0]
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros(2, 8, dtype=torch.long)
    ids[0, :5], mask[0, :5] = a, 1  # right-padded
    ids[1], mask[1] = b, 1
    out = opt.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(out[:, :8], ids)  # the caller's ids come back as given, like HF
    assert torch.equal(out[0, 8:], opt.generate(a[None], max_new_tokens=8, eos_token_id=[])[0, 5:])
    assert torch.equal(out[1, 8:], opt.generate(b[None], max_new_tokens=8, eos_token_id=[])[0, 8:])


def test_rows_stop_at_eos_and_are_padded(varied_cache):
    _, opt = varied_cache("llama-gqa-3l")
    ids = prompt(2, 6)
    free = opt.generate(ids, max_new_tokens=NEW, eos_token_id=[])[:, 6:]
    eos = int(free[0, 3])  # row 0 produces this at step 3 (or earlier)
    first = [int((row == eos).nonzero()[0]) if (row == eos).any() else NEW for row in free]
    out = opt.generate(ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=-1)[:, 6:]
    assert out.shape[1] == min(NEW, max(first) + 1)  # stops once every row has ended
    for b, stop in enumerate(first):
        assert torch.equal(out[b, :stop + 1], free[b, :stop + 1])
        assert (out[b, stop + 1:] == -1).all()


def test_stream_yields_the_generated_tokens(varied_cache):
    _, opt = varied_cache("mistral-hd12-2l")
    ids = prompt(2, 5)
    steps = list(opt.stream(ids, max_new_tokens=10, eos_token_id=[]))
    assert len(steps) == 10 and steps[0].shape == (2,)
    assert torch.equal(torch.stack(steps, 1), opt.generate(ids, max_new_tokens=10, eos_token_id=[])[:, 5:])


def test_too_many_tokens_fail_before_any_work(varied_cache):
    _, opt = varied_cache("llama-gqa-3l")  # max_position_embeddings=128
    with pytest.raises(ValueError, match=r"120 .* \+ max_new_tokens \(9\) = 129 exceeds the KV cache of 128"):
        opt.generate(prompt(1, 120), max_new_tokens=9)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        opt.generate(torch.tensor([[5, 128]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one token"):
        opt.generate([[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        opt.generate(prompt(1, 4), do_sample=True, top_p=0.0)


def test_the_cache_is_sized_to_the_request(varied_cache):
    _, opt = varied_cache("llama-gqa-3l")
    opt.generate(prompt(1, 4), max_new_tokens=4)
    cache = opt._cache
    assert cache.max_len == 128 and len(cache.k) == 3  # min(context 128, 256)
    assert cache.k[0].shape == (1, 2, 128, 16)  # [B, Hkv, max_len, D]
    assert opt.kv_bytes_per_token() == 3 * 2 * 2 * 16 * 4  # layers * (K,V) * Hkv * D * fp32


def test_interleaved_streams_do_not_share_a_cache(varied_cache):
    _, opt = varied_cache("llama-gqa-3l")
    a, b = prompt(1, 6, seed=4), prompt(1, 9, seed=5)
    kw = dict(max_new_tokens=10, eos_token_id=[])
    want_a = opt.generate(a, **kw)[0, 6:].tolist()
    want_b = opt.generate(b, **kw)[0, 9:].tolist()
    s1, s2 = opt.stream(a, **kw), opt.stream(b, **kw)  # both handed out before either runs
    got_a = [int(next(s1)[0])]
    assert opt.generate(b, **kw)[0, 9:].tolist() == want_b  # a whole call in between
    got_b = []
    for t1, t2 in zip(s1, s2):
        got_a.append(int(t1[0]))
        got_b.append(int(t2[0]))
    got_b += [int(t[0]) for t in s2]
    assert got_a == want_a and got_b == want_b


def test_greedy_ignores_sampling_settings_like_hugging_face(varied_cache):
    _, opt = varied_cache("llama-gqa-3l")
    ids = prompt(1, 5)
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert torch.equal(opt.generate(ids, temperature=0.0, top_p=0.0, **kw), opt.generate(ids, **kw))


@pytest.mark.parametrize("name", ["llama-gqa-3l", "gpt2-3l"])
def test_bfloat16_greedy_equals_hugging_face(name):
    model = make_model(name, initializer_range=varied_init(name)).to(torch.bfloat16)
    opt = rewriter.optimize(model)
    ids = prompt(1, 9)
    ours = opt.generate(ids, max_new_tokens=NEW, eos_token_id=[])
    assert opt._cache.k[0].dtype == torch.bfloat16
    assert torch.equal(ours, hf_greedy(model, ids, NEW))


@pytest.mark.parametrize("name", ["llama-gqa-3l", "mistral-window-3l"])
def test_static_decode_steps_give_the_same_tokens(varied_cache, name):
    """The CUDA-graph decode path (device-side write position, whole-cache masks), run
    without capture: same tokens as the ordinary path, padding and windows included."""
    _, opt = varied_cache(name)
    rows = [prompt(1, n, seed=n)[0].tolist() for n in (3, 11, 7)]
    kw = dict(max_new_tokens=NEW, eos_token_id=[])
    want = opt.generate(rows, **kw)
    opt.static_decode = True
    try:
        assert torch.equal(opt.generate(rows, **kw), want)
        assert torch.equal(opt.generate(rows[1:2], **kw), opt.generate(rows[1:2], **kw))
    finally:
        opt.static_decode = None
