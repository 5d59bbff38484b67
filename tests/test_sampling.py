"""Sampling: temperature, top-k and top-p mean what they mean in Hugging Face, the sampled
distribution is the warped softmax, and a seed makes generation reproducible."""
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from rewriter.runtime.sampling import greedy, next_token, warp
from rewriter.runtime.settings import GenerationSettings


def sampling(do_sample, temperature=1.0, top_k=50, top_p=1.0) -> GenerationSettings:
    return GenerationSettings(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)


def hf_warp(logits, temperature, top_k, top_p):
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs(None, logits.clone())


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 50, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.8, 20, 0.95), (2.0, 3, 0.5),
    (1.0, 0, 0.05)])
def test_warping_matches_hugging_face(temperature, top_k, top_p):
    logits = torch.randn(6, 97) * 3  # fresh each run
    ours = warp(logits, sampling(True, temperature, top_k, top_p))
    theirs = hf_warp(logits, temperature, top_k, top_p)
    assert torch.equal(ours.isinf(), theirs.isinf())
    torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_sampled_frequencies_follow_the_warped_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    s = sampling(True, temperature=0.8, top_k=6, top_p=0.9)
    probs = warp(logits, s).softmax(-1)[0]  # the target distribution
    n = 40_000
    tokens = next_token(logits.expand(n, -1), s, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert (freq[probs == 0] == 0).all(), "a token outside top-k/top-p was sampled"
    assert (probs == 0).sum() >= 3  # the test does exclude something
    assert 0.5 * (freq - probs).abs().sum() < 0.015  # total variation distance


def test_greedy_ignores_sampling_arguments():
    logits = torch.randn(3, 11)
    assert torch.equal(next_token(logits, sampling(False, 0.5, 2, 0.5), None), logits.argmax(-1))


def test_seeded_generation_is_reproducible(varied_cache):
    _, opt = varied_cache("llama-gqa-3l")
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=40, top_p=0.95,
              eos_token_id=[])
    a, b = opt.generate(ids, seed=0, **kw), opt.generate(ids, seed=0, **kw)
    c = opt.generate(ids, seed=1, **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("bad,match", [(dict(temperature=0.0), "temperature"),
                                       (dict(top_k=-1), "top_k"), (dict(top_p=1.5), "top_p")])
def test_bad_sampling_arguments_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        GenerationSettings(do_sample=True, **bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_ties_and_nan_included(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 4, (5, 7, 300), generator=g).to(dtype)  # many ties a row
    logits[0, 0, 11] = float("nan")  # NaN counts as the largest, as argmax counts it
    logits[0, 1, [4, 250]] = float("nan")  # the first NaN
    logits[1, 2] = float("-inf")  # a row of -inf: index 0
    logits[2, 3, :] = 3
    logits[2, 3, 299] = 4  # the very last index
    got = greedy(logits)
    assert got.dtype == torch.int64 and got.shape == (5, 7)
    assert torch.equal(got, logits.argmax(-1))
    assert got[0, 0] == 11 and got[0, 1] == 4 and got[1, 2] == 0 and got[2, 3] == 299


def test_greedy_on_a_real_vocabulary_and_a_last_position_view():
    logits = torch.zeros(3, 5, 49152, dtype=torch.bfloat16)
    logits[0, -1, [0, 49151]] = 1  # a tie at both ends: the first
    logits[1, -1, [49150, 49151]] = 2
    logits[2, -1, 7] = float("-inf")
    last = logits[:, -1]  # [B, V], a strided view as the runtime passes it
    assert torch.equal(greedy(last), last.argmax(-1))
    assert greedy(last).tolist() == [0, 49150, 0]


def _vocab_logits(kind: str, rows: int = 6, vocab: int = 5000) -> torch.Tensor:
    """Logits of a large vocabulary (the candidates are fewer than it): ``peaked`` as a
    trained model's (a nucleus of a few tokens), ``flat`` (a nucleus past the candidates),
    ``mixed`` (both in one batch), ``tied`` (integers: many ties of the k-th largest)."""
    g = torch.Generator().manual_seed({"peaked": 1, "flat": 2, "mixed": 3, "tied": 4}[kind])
    if kind == "tied":
        return torch.randint(-20, 8, (rows, vocab), generator=g).float()
    logits = torch.randn(rows, vocab, generator=g)
    peaked = logits * 4 + torch.zeros(rows, vocab).index_fill_(1, torch.arange(7), 18.0)
    if kind == "peaked":
        return peaked
    if kind == "flat":
        return logits * 0.5
    return torch.where(torch.arange(rows)[:, None] % 2 == 0, peaked, logits * 0.5)


@pytest.mark.parametrize("kind", ["peaked", "flat", "mixed", "tied"])
@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 50, 1.0), (1.0, 0, 0.9), (0.7, 50, 0.95), (1.3, 5, 0.5), (1.0, 255, 0.99),
    (1.0, 256, 0.9), (1.0, 1000, 0.9), (1.0, 0, 0.05), (1.0, 1, 0.9)])
def test_warping_a_large_vocabulary_matches_hugging_face(kind, temperature, top_k, top_p):
    """Top-k and top-p look among the largest logits first, and sort the whole vocabulary
    only for the rows (or settings) where what they keep may reach past those: the same
    tokens kept as Hugging Face's warpers, ties of the k-th included."""
    logits = _vocab_logits(kind)
    ours = warp(logits, sampling(True, temperature, top_k, top_p))
    theirs = hf_warp(logits, temperature, top_k, top_p)
    for a, b in zip(ours, theirs):  # the same logits kept (ties at top-p's cut: as many)
        assert torch.equal(a[a.isfinite()].sort().values, b[b.isfinite()].sort().values)
    if kind != "tied":  # which of tied tokens top-p keeps is its sort's order, in theirs too
        assert torch.equal(ours.isinf(), theirs.isinf())
        torch.testing.assert_close(ours.softmax(-1), theirs.softmax(-1))


def test_both_ways_of_warping_are_exercised(monkeypatch):
    """The large-vocabulary cases above reach both the candidates' way and the whole sort
    (a test that always took one of them could not tell a wrong other)."""
    from rewriter.runtime import sampling as sampling_module
    whole_rows = []
    real = sampling_module._whole
    monkeypatch.setattr(sampling_module, "_whole",
                        lambda x, k, p: whole_rows.append(len(x)) or real(x, k, p))
    warp(_vocab_logits("peaked"), sampling(True, 1.0, 0, 0.9))
    assert whole_rows == []  # every row's nucleus among the candidates
    warp(_vocab_logits("mixed"), sampling(True, 1.0, 0, 0.9))
    assert whole_rows == [3]  # the flat rows only
    warp(_vocab_logits("tied"), sampling(True, 1.0, 50, 0.99))
    assert whole_rows == [3]  # the 50th's ties (about 180 of each value) among them
    warp(_vocab_logits("tied"), sampling(True, 1.0, 200, 0.99))
    assert len(whole_rows) == 2 and whole_rows[-1] > 0  # the 200th's ties reach past them
    warp(_vocab_logits("peaked"), sampling(True, 1.0, 50, 1.0))
    assert len(whole_rows) == 3 and whole_rows[-1] == 6  # top-k alone: no sort to save


def test_logits_already_excluded_stay_excluded():
    logits = _vocab_logits("peaked")
    logits[:, 3] = float("-inf")
    logits[0, :] = float("-inf")
    logits[0, 42] = 0.0  # one token left in a row
    ours = warp(logits, sampling(True, 1.0, 0, 0.9))
    assert torch.equal(ours.isinf(), hf_warp(logits, 1.0, 0, 0.9).isinf())
    assert ours[0].isfinite().nonzero().flatten().tolist() == [42]


def test_off_the_cpu_the_whole_vocabulary_is_sorted():
    """A GPU sorts fast, and choosing rows to sort would read the device back every step."""
    from rewriter.runtime.sampling import _among_candidates
    logits = torch.empty(2, 5000, device="meta")
    assert _among_candidates(logits, 50, 0.9) == (None, None)
    assert warp(logits, sampling(True, 0.7, 50, 0.9)).shape == (2, 5000)


def test_draws_follow_the_distribution_and_never_pick_a_token_without_mass():
    from rewriter.runtime.sampling import draw
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0],  # rows need not sum to 1:
                          [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])  # scaled as multinomial scales
    n = 40_000
    g = torch.Generator().manual_seed(0)
    tokens = torch.stack([draw(probs, g) for _ in range(n)])  # [n, 2]
    assert tokens.dtype == torch.int64 and tokens.shape == (n, 2)
    freq = torch.bincount(tokens[:, 0], minlength=6).float() / n
    assert (freq[probs[0] == 0] == 0).all()
    assert 0.5 * (freq - probs[0]).abs().sum() < 0.015
    assert (tokens[:, 1] == 5).all()


@pytest.mark.parametrize("u", [0.0, 1.0 - 2 ** -53, 1.0])
def test_a_draw_at_either_end_of_the_unit_interval_has_mass(monkeypatch, u):
    """The uniform draw times the row's total may round up to the total: the token drawn
    is still one with mass (the last one here has none)."""
    from rewriter.runtime import sampling as sampling_module
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.9, 0.0, 0.0]])
    monkeypatch.setattr(sampling_module.torch, "rand",
                        lambda shape, generator=None, dtype=None, **kw: torch.full(shape, u, dtype=dtype, **kw))
    assert sampling_module.draw(probs, None).tolist() == [1 if u == 0.0 else 3]


@pytest.mark.parametrize("bad", [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5], [0.5, float("inf"), 0.0],
                                 [1.5, -0.5, 0.0]])
def test_a_distribution_that_is_no_distribution_is_refused(bad):
    from rewriter.runtime.sampling import draw
    with pytest.raises(RuntimeError, match="probabilities"):
        draw(torch.tensor([[0.2, 0.3, 0.5], bad]), None)


def test_a_draw_takes_rows_of_probabilities():
    from rewriter.runtime.sampling import draw
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        draw(torch.tensor([0.5, 0.5]), None)
