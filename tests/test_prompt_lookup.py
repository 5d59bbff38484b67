"""``PromptLookup``: drafts copied from the row's own text, verified by the model alone
(no heads). Lossless (greedy tokens on three model families, ragged batches, each row
alone, an end of sequence, the cache's end; the sampled distribution), the measured costs
and the chain they choose, the record and artifacts, refusals, the Triton backend."""
import pytest
import torch

import rewriter
from rewriter.decoding import check_record
from rewriter.errors import PassError, RewriterError
from rewriter.passes import HydraHeads, PromptLookup, StreamingAttention, from_spec

from conftest import assert_same_distribution, traced_model, varied_init
from test_hydra_heads import KW, RAGGED, sampled
from test_tree_lookup import repeating


def pair(config="llama-gqa-3l", **kw):
    _, traced = traced_model(config, initializer_range=varied_init(config))
    return rewriter.optimize(traced), rewriter.optimize(traced, passes=[PromptLookup(**kw)])


def looping():
    """The trace of a model whose text loops (a small vocabulary, small weights)."""
    return traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)[1]


@pytest.mark.parametrize("config", ["llama-gqa-3l", "qwen2-mqa-3l", "gpt2-3l"])
@pytest.mark.parametrize("adapt", [False, True])
def test_greedy_tokens_equal_plain_greedy_and_copies_are_accepted(config, adapt):
    plain, pl = pair(config, adapt=adapt)
    assert pl.ir.info["decoding"]["drafter"] == "none"
    assert ("costs" in pl.ir.info["decoding"]) == adapt
    ids = repeating(plain, RAGGED)  # random models loop: their text repeats
    together = pl.generate(ids, **KW)
    assert torch.equal(together, plain.generate(ids, **KW))
    for i, row in enumerate(ids):
        assert torch.equal(together[i, -24:], pl.generate([row], **KW)[0, -24:]), i
    assert pl.stats["copied"] > 0  # (adapt: until the first rounds' copies are scored)
    assert pl.stats["accepted"] > 0 or adapt  # a loop that set in late may be left to plain rounds
    assert "head_passes" not in pl.stats  # no heads: nothing but the model runs


def test_an_end_of_sequence_inside_a_copied_chain_and_the_cache_end():
    traced = looping()
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup(tokens=6, adapt=False)])
    ids = repeating(plain, [[5, 9, 2, 5, 9, 2, 5, 9], [7, 7, 7, 7]])
    eos = int(plain.generate(ids, max_new_tokens=30, eos_token_id=[])[0, -20])
    kw = dict(max_new_tokens=30, eos_token_id=[eos], pad_token_id=0)
    assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    rows = repeating(plain, [[5, 9, 2, 5, 9, 2, 5, 9]], 92) + [[(i * i + 3 * i) % 47 + 1 for i in range(100)]]
    kw = dict(max_new_tokens=28, eos_token_id=[])  # 100 + 28 = the 128-position context
    assert torch.equal(pl.generate(rows, **kw), plain.generate(rows, **kw))
    assert pl.stats["copied"] > 0


def test_sampling_follows_the_model():
    traced = looping()
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup(tokens=3, adapt=False)])
    a, b = sampled(plain, pl, [5, 9, 2, 5, 9], new=6)  # "5 9" repeats: a chain is copied
    assert pl.stats["accepted"] > 0 and pl.stats["copied"] > 0
    assert_same_distribution(a, b, (6, 7), 48)


def test_costs_are_measured_per_batch_and_a_chain_that_cannot_pay_is_dropped():
    plain, pl = pair(tokens=3)
    record = pl.ir.info["decoding"]
    assert [b for b, _ in record["costs"]] == [1, 2, 4, 8]
    # a round of 1 .. 1 + 3 tokens in plain steps: the programs and the round's own work
    assert all(len(c) == 4 and 1.0 <= c[0] <= c[-1] * 1.5 for _, c in record["costs"])
    ids = repeating(plain, RAGGED)
    record["costs"] = [[1, [1.0, 11.0, 21.0, 31.0]]]  # a copy costs 10 steps: none pays
    pl.trees.clear()  # the counts learnt so far, by batch size and strategy
    pl.generate(ids, **KW)
    pl.stats.clear()
    assert torch.equal(pl.generate(ids, **KW), plain.generate(ids, **KW))
    assert pl.stats["copied"] == 0 and pl.stats["forward_passes"] == KW["max_new_tokens"]


def test_the_artifact_keeps_it_and_bad_records_are_refused(tmp_path):
    plain, pl = pair(tokens=5)
    ids = repeating(plain, RAGGED)
    eager = pl.generate(ids, **KW)
    pl.static_decode = True
    assert torch.equal(pl.generate(ids, **KW), eager)
    pl.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.info["decoding"] == pl.ir.info["decoding"]
    assert torch.equal(loaded.generate(ids, **KW), eager)
    good = pl.ir.info["decoding"]
    assert check_record(good) is None
    for bad in ({**good, "lookup": 0}, {**good, "lookup": 17}, {**good, "lookup": True},
                {**good, "extra": 1}, {**good, "costs": []}, {**good, "costs": [[2, [1.0, 1.1]]]},
                {**good, "costs": [[1, [1.0]]]}, {**good, "costs": [[1, [1.0, float("nan")]]]},
                {**good, "costs": [[1, [1.0, 1.1]], [1, [1.0, 1.1]]]}):
        assert check_record(bad) is not None, bad


def test_bad_parameters_and_conflicts_are_named():
    assert from_spec("prompt_lookup:tokens=6,adapt=false").tokens == 6
    for bad in (0, 17, 2.0, True, "4"):
        with pytest.raises(ValueError, match="tokens"):
            PromptLookup(tokens=bad)
    with pytest.raises(ValueError, match="adapt"):
        PromptLookup(adapt="yes")
    _, traced = traced_model("llama-gqa-3l")
    with pytest.raises(PassError, match="already has a decoding strategy"):
        rewriter.optimize(traced, passes=[HydraHeads(num_heads=2, tree=[[0]]), PromptLookup()])
    with pytest.raises(RewriterError, match="sink"):
        rewriter.optimize(traced, passes=[StreamingAttention(sinks=2, window=8),
                                         PromptLookup(adapt=False)])


def test_the_triton_backend_gives_the_same_tokens():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2, num_hidden_layers=2)
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup(tokens=3, adapt=False)], backend="triton")
    ids = repeating(plain, [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3]], 16)
    kw = dict(max_new_tokens=8, eos_token_id=[])
    assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    assert pl.stats["copied"] > 0  # chain nodes went through the kernels


def test_on_text_that_loops_the_chain_is_kept_and_where_it_cannot_pay_it_rests():
    traced = looping()
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup()])
    pl.fallback = False  # the chain's own rests, not the timed guard's (test_speed_guard)
    # what verifying 1-5 tokens costs, fixed: the pass's timings at optimize() follow the
    # machine's load (a busy CI machine measured chains that paid less)
    pl.ir.info["decoding"]["costs"] = [[1, [1.0, 1.04, 1.08, 1.12, 1.16]]]
    ids = repeating(plain, [[5, 9, 2] * 4, [7, 3] * 6, [4, 4, 8] * 3], 12)
    kw = dict(max_new_tokens=40, eos_token_id=[])
    assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    (learnt,) = pl.trees.values()
    assert any(learnt.chain.current) and sum(g[1] for g in learnt.chain.gains) > 10
    pl.stats.clear()
    assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    assert pl.stats["copied"] > 0 and pl.stats["forward_passes"] < 20
    pl.ir.info["decoding"]["costs"] = [[1, [1.0, 11.0, 21.0, 31.0, 41.0]]]  # no copy pays
    pl.trees.clear()
    looped = []
    for _ in range(9):
        pl.stats.clear()
        assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
        looped.append(pl.stats["rounds"] > 0)
    assert looped == [True] + [False] * 7 + [True]  # rests 7 generations, then tries again


def test_the_default_model_and_an_int4_lm_head():
    from rewriter.models.checkpoints import default_model
    from rewriter.passes import Int4Weights
    model, tok = default_model()
    traced = rewriter.trace(model)  # one trace, 2 pipelines
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup()])  # its text loops with a period of 2
    encoded = tok.encode("def fibonacci(n):")
    ids = [getattr(encoded, "ids", encoded)]
    assert torch.equal(pl.generate(ids, **KW), plain.generate(ids, **KW))
    _, small = traced_model("llama-gqa-3l")
    for passes in ([Int4Weights(lm_head=True), PromptLookup(adapt=False)],
                   [PromptLookup(adapt=False), Int4Weights(lm_head=True)]):
        with pytest.raises(PassError, match="LM head"):
            rewriter.optimize(small, passes=passes)


def one_row_ends():
    """Plain and ``PromptLookup(adapt=False)`` engines on a model whose text loops, two rows,
    the padded width, the rows' free text ``[2, width + 40]``, the tokens row 1 writes, and
    an end of sequence that row 0 writes soon and row 1 never."""
    traced = looping()
    plain = rewriter.optimize(traced)
    pl = rewriter.optimize(traced, passes=[PromptLookup(adapt=False)])
    ids = repeating(plain, [[5, 9, 2] * 4, [7, 3] * 6], 12)
    width = max(map(len, ids))
    free = plain.generate(ids, max_new_tokens=40, eos_token_id=[])
    later = set(free[1, width:].tolist())
    eos = next(t for t in free[0, width + 1:width + 8].tolist() if t not in later)
    return plain, pl, ids, width, free, later, eos


def test_a_row_past_its_end_does_not_hold_the_batch_to_a_token_a_round():
    """Past its end of sequence a row's output is padding: the rounds go at the pace of
    the row still writing (a row copying nothing past its end would hold every column of
    the batch to one token a round), and the output is plain decoding's."""
    plain, pl, ids, width, free, later, eos = one_row_ends()
    kw = dict(max_new_tokens=40, eos_token_id=[eos])
    assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    together = pl.stats["rounds"]
    pl.stats.clear()
    pl.generate([ids[1]], **kw)
    alone = pl.stats["rounds"]
    assert alone < 25 and together <= alone + 1, (together, alone)  # the ended row is done (13 before)
    # a row whose very first token (from the prompt's prefill) is its end
    first = int(free[0, width])
    assert first not in later
    kw["eos_token_id"] = [first]
    pl.stats.clear()
    assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    # done from the prefill on: no round ever runs it (one row a round: row 1's)
    assert pl.stats["row_rounds"] == pl.stats["rounds"] <= alone + 1


def test_a_row_whose_text_ended_copies_no_chain_without_adapt(monkeypatch):
    """With ``adapt=False`` too, a row whose accepted text holds its end of sequence is
    marked ended in that round, so it proposes no copied chain from the next round on
    (it had proposed one more)."""
    from rewriter.runtime.decoding.tree import rounds as tree_decoding
    plain, pl, ids, width, free, later, eos = one_row_ends()
    seen, real = [], tree_decoding.TreeRounds._chain

    def spy(self):
        real(self)
        proposed = self.chains.proposed
        seen.append((self.ended[0], proposed[0] if proposed else None))
    monkeypatch.setattr(tree_decoding.TreeRounds, "_chain", spy)
    kw = dict(max_new_tokens=40, eos_token_id=[eos])
    assert torch.equal(pl.generate(ids, **kw), plain.generate(ids, **kw))
    after = [proposed for ended, proposed in seen if ended]
    assert after and all(p is None for p in after), seen
    assert any(p is not None for ended, p in seen if not ended)  # it copied before its end
