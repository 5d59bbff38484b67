"""Drafts copied from the row's own text (runtime.decoding.tree.lookup): the n-gram index against a
brute-force search, the chain merged into a tree, and decoding with it (lossless, ragged
batches, EOS, the cache's end, sampling, static rounds, artifacts, refusals)."""
import random
from dataclasses import replace

import pytest
import torch

import rewriter
from rewriter.passes import HydraHeads, MedusaHeads
from rewriter.runtime.decoding.tree.lookup import (LOOKUP, NGRAM, ChainLength, Context, CopiedChains,
                                                   with_chain)
from rewriter.drafts.tree import Tree, make_tree, monotone

from conftest import assert_same_distribution, measured_costs, traced_model, varied_init
from test_draft_heads import random_heads
from test_hydra_heads import IDS, KW, RAGGED, WIDE, model_and_file, sampled
from test_tree_dynamic import refuses, triton_pair


def brute(tokens: list[int], length: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix (n <= NGRAM),
    round the loop they make again where fewer follow it."""
    for n in range(min(NGRAM, len(tokens)), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                out = []
                while len(out) < length:
                    out += tokens[start + n:]
                return out[:length]
    return []


def test_the_index_finds_what_a_search_finds_as_text_grows():
    rng = random.Random(0)
    for trial in range(40):
        text = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        c = Context(text)
        for _ in range(10):
            assert c.match(4)[1] == brute(c.tokens, 4), c.tokens
            c.extend([rng.randrange(6) for _ in range(rng.randrange(1, 4))])
    assert Context([1, 2, 3]).match(4)[1] == []  # nothing repeats
    assert Context([7, 8, 9, 7, 8]).match(4)[1] == [9, 7, 8, 9]  # the longest suffix; the loop again
    assert Context([9, 9, 9]).match(4)[1] == [9, 9, 9, 9]
    assert Context([5, 1, 2, 6, 1, 2]).match(2)[1] == [6, 1]  # latest occurrence of "1 2"


def test_the_chain_hangs_below_the_root_in_depth_order():
    tree = make_tree([[0], [1], [0, 0]], 2)
    nodes = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    merged, tokens = with_chain(tree, nodes, [[30, 31, 32], [40]], torch.tensor([99, 98]))
    assert merged.paths == ((0,), (1,), (LOOKUP,), (0, 0), (LOOKUP, LOOKUP), (LOOKUP,) * 3)
    assert tokens.tolist() == [[10, 11, 12, 30, 13, 31, 32], [20, 21, 22, 40, 23, 98, 98]]
    lay = merged.layout()
    assert lay["parent"].tolist() == [-1, 0, 0, 0, 1, 3, 5]
    assert with_chain(tree, nodes, [[], []], torch.tensor([0, 0]))[0] is tree


def optimized(tmp_path, cls, config="llama-gqa-3l", **kw):
    """(the shared trace of ``config``, an engine of ``cls`` heads over it with ``kw``)."""
    model, traced, path = model_and_file(tmp_path, config)
    if cls is MedusaHeads:
        path = random_heads(model, tmp_path / "m.safetensors")
    return traced, rewriter.optimize(traced, passes=[cls(weights=str(path), tree=WIDE, **kw)])


@pytest.mark.parametrize("cls,config", [(HydraHeads, "llama-gqa-3l"), (MedusaHeads, "qwen2-mqa-3l"),
                                        (HydraHeads, "gpt2-3l")])
def test_greedy_tokens_equal_plain_greedy_and_the_copies_are_accepted(cls, config, tmp_path):
    traced, hy = optimized(tmp_path, cls, config, lookup=4)
    plain = rewriter.optimize(traced)
    looping = [[5, 6, 7, 8] * 4, [9, 3] * 6]  # text that repeats: copies the model may accept
    for prompts in (IDS, RAGGED, looping):
        together = hy.generate(prompts, **KW)
        assert torch.equal(together, plain.generate(prompts, **KW))
        for i, row in enumerate(prompts):
            row = row.tolist() if isinstance(row, torch.Tensor) else row
            alone = hy.generate([row], **KW)[0, -24:]
            assert torch.equal(together[i, -24:], alone), i
    _, without = optimized(tmp_path, cls, config)
    without.generate(looping, **KW)
    hy.generate(looping, **KW)
    assert hy.stats["accepted"] > without.stats["accepted"]  # the chain pays on repeated text


def repeating(plain, prompts, n: int = 24) -> list[list[int]]:
    """Each prompt followed by ``n`` of plain greedy's tokens: text the model goes on
    repeating (random models loop), so the chains copied from it are accepted."""
    out = plain.generate(prompts, max_new_tokens=n, eos_token_id=[])
    return [list(p) + out[i, -n:].tolist() for i, p in enumerate(prompts)]


def test_an_end_of_sequence_and_the_cache_end_with_copied_chains():
    """Rows whose chains are accepted end at an end of sequence as plain decoding does; at
    the cache's end a round is cut to the room left (a ragged batch: the row whose text
    loops accepts more a round than the other)."""
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    plain = rewriter.optimize(traced)
    hy = rewriter.optimize(traced, passes=[HydraHeads(num_heads=2, tree=[[0], [1], [0, 0]], lookup=6)])
    ids = repeating(plain, [[5, 9, 2, 5, 9, 2, 5, 9], [7, 7, 7, 7]])
    ref = plain.generate(ids, max_new_tokens=30, eos_token_id=[])
    eos = int(ref[0, -20])  # a token the first row produces: its end of sequence
    kw = dict(max_new_tokens=30, eos_token_id=[eos], pad_token_id=0)
    assert torch.equal(hy.generate(ids, **kw), plain.generate(ids, **kw))
    assert hy.stats["copied"] > 0
    rows = repeating(plain, [[5, 9, 2, 5, 9, 2, 5, 9]], 92) + [[(i * i + 3 * i) % 47 + 1 for i in range(100)]]
    assert [len(r) for r in rows] == [100, 100]
    kw = dict(max_new_tokens=28, eos_token_id=[])  # 100 + 28 = the 128-position context
    out = hy.generate(rows, **kw)
    assert torch.equal(out, plain.generate(rows, **kw))
    assert hy.stats["accepted"] > 0 and hy.stats["copied"] > 0


def test_sampling_follows_the_model():
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    plain = rewriter.optimize(traced)
    hy = rewriter.optimize(traced, passes=[HydraHeads(num_heads=2, tree=[[0], [1], [0, 0]], lookup=3)])
    # "5 9" repeats: chains are copied, and verified (rounds left to make past the first)
    a, b = sampled(plain, hy, [5, 9, 2, 5, 9], new=6)
    assert hy.stats["accepted"] > 0 and hy.stats["copied"] > 0
    assert_same_distribution(a, b, (6, 7), 48)


def test_static_rounds_and_the_artifact_keep_it(tmp_path):
    _, hy = optimized(tmp_path, HydraHeads, lookup=3, dynamic=2)
    assert hy.ir.info["decoding"]["lookup"] == 3
    eager = hy.generate(RAGGED, **KW)
    hy.static_decode = True
    assert torch.equal(hy.generate(RAGGED, **KW), eager)
    hy.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.info["decoding"]["lookup"] == 3
    assert torch.equal(loaded.generate(RAGGED, **KW), eager)
    refuses("lookup", hy.ir.info["decoding"])


def test_the_triton_backend_gives_the_same_tokens(tmp_path):
    plain, hy = triton_pair(tmp_path, lookup=3)
    ids = repeating(plain, [[5, 6, 7, 5, 6, 7, 5], [9, 3, 9, 3]], 16)
    kw = dict(max_new_tokens=8, eos_token_id=[])
    assert torch.equal(hy.generate(ids, **kw), plain.generate(ids, **kw))
    assert hy.stats["copied"] > 0  # chain nodes went through the kernels


@pytest.mark.parametrize("dynamic", [0, 2])
def test_with_the_adaptive_tree_the_tokens_stay_greedys_and_the_heads_are_counted(dynamic, tmp_path):
    from test_tree_adapt import adaptive
    _, traced, path = model_and_file(tmp_path)
    plain = rewriter.optimize(traced)
    med = adaptive(rewriter.optimize(traced, passes=[
        HydraHeads(weights=str(path), tree=WIDE, lookup=4, dynamic=dynamic)]),
        [[0.5, 0.2, 0.1], [0.4, 0.1], [0.4, 0.1]], [[1, 0.01, [1.0 + 0.01 * s for s in range(12)]]])
    prompts = repeating(plain, RAGGED)
    assert torch.equal(med.generate(prompts, **KW), plain.generate(prompts, **KW))
    (learnt,) = med.trees.values()
    assert med.stats["copied"] > 0 and sum(learnt.trials) > 0


def test_a_round_verifies_at_most_64_tokens(monkeypatch):
    """A 63-node tree leaves no room for a chain (the Triton tree kernels take 64 tokens)."""
    import itertools
    from rewriter.runtime.decoding.tree.rounds import TreeRounds
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    plain = rewriter.optimize(traced)
    paths = [list(p) for d in (1, 2) for p in itertools.product(range(8), repeat=d)][:63]
    hy = rewriter.optimize(traced, passes=[MedusaHeads(num_heads=2, tree=paths, lookup=4)])
    sizes, chained = [], TreeRounds._chain

    def chain(self):
        chained(self)
        sizes.append(self.verified.size)
    monkeypatch.setattr(TreeRounds, "_chain", chain)
    ids = repeating(plain, [[5, 9, 2, 5, 9, 2]], 8)
    assert torch.equal(hy.generate(ids, **KW), plain.generate(ids, **KW))
    assert sizes and max(sizes) == 64


def test_a_chain_is_credited_with_what_it_adds_to_the_heads_tree():
    c = ChainLength(4)
    c.score([1, 2, 3, 4], [1, 2, 9, 9], accepted=0, order=2)  # two copies right, the tree had none
    assert c.gains[2] == [0, 1, 1, 0, 0] and c.scored == 1
    c.score([1, 2, 3, 4], [1, 2, 9, 9], accepted=1, order=2)  # the tree had the first: one gained
    assert c.gains[2] == [0, 1, 2, 0, 0]
    c.score([1, 2, 3, 4], [1, 2, 3, 4], accepted=4, order=3)  # the tree had them all
    c.score([], [], accepted=0, order=0)  # no chain: a round that gained nothing
    c.score([5, 6], [5, 6], accepted=0, order=1)  # a shorter chain, of another order
    assert c.gains[2] == [0, 1, 2, 0, 0] and c.gains[1] == [0, 1, 1, 0, 0] and c.scored == 5
    assert c.gains[0] == c.gains[3] == [0] * 5


def test_a_match_tells_its_order():
    assert Context([1, 2, 3]).match(4) == (0, [])
    assert Context([7, 8, 9, 7, 8]).match(4) == (2, [9, 7, 8, 9])
    assert Context([5, 1, 2, 6, 1, 2]).match(2) == (2, [6, 1])
    assert Context([4, 5, 6, 7, 5, 6, 7, 1]).match(3) == (0, [])
    assert Context([4, 5, 6, 7, 5, 6, 7]).match(3) == (3, [5, 6, 7])
    assert Context([3, 9, 1, 3]).match(2) == (1, [9, 1])


def test_the_chain_length_maximises_tokens_a_round_over_its_cost():
    """``choose`` against the formula evaluated at every choice of copies by order,
    written out here per round: a round verifies its highest order's copies for every row,
    and each row gains what they add (compared by rate: a tie may go either way)."""
    import itertools
    rng = random.Random(1)
    for trial in range(200):
        lookup = rng.randrange(1, 7)
        c = ChainLength(lookup)
        rounds, rows = [], []  # each round's highest order; each row-round's (order, m, accepted)
        for _ in range(rng.randrange(ChainLength.MIN, 40)):
            orders = [rng.randrange(NGRAM + 1) for _ in range(rng.randrange(1, 4))]
            h = max(orders)
            for n in orders:
                m, a = rng.randrange(lookup + 1) if n else 0, rng.randrange(3)
                c.score(list(range(lookup)) if n else [],
                        list(range(m)) + [-1] * (lookup - m), a, order=h)
                rows.append((h, m, a))
            c.count_round(h)
            rounds.append(h)
        chained = monotone([0.0] + [1 + rng.random() * 0.4 * s for s in range(rng.randrange(2, 9))])[1:]
        tokens = 1 + 2 * rng.random()
        top = min(lookup, len(chained) - 1)  # costs measured that far

        def rate(lengths):
            gain = sum(max(0, min(m, lengths[n]) - a) for n, m, a in rows) / len(rows)
            cost = sum(chained[lengths[h]] for h in rounds) / len(rounds)
            return (tokens + gain) / cost
        choices = [(0, *x) for x in itertools.product(range(top + 1), repeat=NGRAM)
                   if list(x) == sorted(x)]  # a longer match never gets fewer copies
        best = max(choices, key=lambda x: (round(rate(x), 9), [-v for v in x]))
        assert rate(c.choose(tokens, chained)) == pytest.approx(rate(best), abs=1e-9)
    fresh = ChainLength(5)
    assert fresh.choose(1.0, [1.0 + s for s in range(10)]) == (0, 5, 5, 5)  # whole until counted


def test_chains_of_short_matches_are_dropped_where_they_do_not_pay():
    """Single-token matches are right once in 5 rounds, three-token matches always: at 0.3
    of a step a copy, only the long matches' chains are verified (whole)."""
    c = ChainLength(4)
    for r in range(20):
        c.score([7, 8, 9, 10], [7 if r % 5 == 0 else 0, 0, 0, 0], accepted=0, order=1)
        c.count_round(1)
        c.score([7, 8, 9, 10], [7, 8, 9, 10], accepted=0, order=3)
        c.count_round(3)
    assert c.choose(1.0, [1.0 + 0.3 * s for s in range(5)]) == (0, 0, 0, 4)
    assert c.choose(1.0, [1.0 + 0.01 * s for s in range(5)]) == (0, 1, 1, 4)  # cheap: 1 pays


def chains_pass(tmp_path, monkeypatch, slope: float, lookup: int = 4, **model_kw):
    """A pass whose measured costs (set here) find that no heads' tree pays at any batch
    size (a heads call costs 5 steps), and verifying one more token costs ``slope`` steps."""
    model, traced = traced_model("llama-gqa-3l", **(model_kw or dict(
        initializer_range=varied_init("llama-gqa-3l"))))
    path = random_heads(model, tmp_path / "h.safetensors")
    measured_costs(monkeypatch, slope, heads=5.0)
    p = MedusaHeads(weights=str(path), max_nodes=6, lookup=lookup)
    return traced, p, rewriter.optimize(traced, passes=[p])


def test_where_no_tree_pays_rounds_verify_the_copied_chain_alone(tmp_path, monkeypatch):
    """Text that repeats strongly: the chain is kept and the next generation copies too."""
    # small weights and vocabulary: text that loops from the start
    traced, p, med = chains_pass(tmp_path, monkeypatch, slope=0.01, vocab_size=48,
                                initializer_range=0.08)
    record = med.ir.info["decoding"]
    assert p.report["predicted_speedup"] < 1 and record["batch_trees"] == [[1, []]]
    costs = record["adapt"]["costs"]  # at one row, a round of the tree and the chain
    assert [c[0] for c in costs] == [1, 2, 4, 8] and len(costs[0][2]) == len(record["tree"]) + 1 + 4
    assert all(len(c[2]) == 1 + 4 for c in costs[1:])  # larger batches: the chain alone
    plain = rewriter.optimize(traced)
    ids = repeating(plain, [[5, 9, 2] * 4, [7, 3] * 6, [4, 4, 8] * 3], 12)
    kw = dict(max_new_tokens=40, eos_token_id=[])
    assert torch.equal(med.generate(ids, **kw), plain.generate(ids, **kw))
    (learnt,) = med.trees.values()
    assert med.stats["head_passes"] == 0 and med.stats["accepted"] > 40
    assert sum(g[1] for g in learnt.chain.gains) > 10 and any(learnt.chain.current)
    med.stats.clear()
    assert torch.equal(med.generate(ids, **kw), plain.generate(ids, **kw))
    assert med.stats["copied"] > 0 and med.stats["forward_passes"] < 20


def test_a_chain_that_costs_more_than_it_adds_is_dropped(tmp_path, monkeypatch):
    """Each verified token costs 10 steps: no chain can pay. The first rounds verify the
    whole chain; once scored, none; the next generation starts with none."""
    traced, p, med = chains_pass(tmp_path, monkeypatch, slope=10.0)
    med.fallback = False  # the chain's own rests, not the timed guard's (test_speed_guard)
    plain = rewriter.optimize(traced)
    ids = repeating(plain, RAGGED)
    kw = dict(max_new_tokens=32, eos_token_id=[])
    assert torch.equal(med.generate(ids, **kw), plain.generate(ids, **kw))
    (learnt,) = med.trees.values()
    assert med.stats["copied"] > 0 and not any(learnt.chain.current)
    looped = []  # generations of chains alone (rounds) or plain steps: the chain rests
    for _ in range(ChainLength.RETRY):
        med.stats.clear()
        assert torch.equal(med.generate(ids, **kw), plain.generate(ids, **kw))
        looped.append(med.stats["rounds"] > 0)
        assert looped[-1] or med.stats["forward_passes"] == kw["max_new_tokens"]
    assert looped == [False] * (ChainLength.RETRY - 1) + [True]  # then it tries again
    assert med.stats["copied"] > 0  # the try verifies chains until they are scored anew
    assert 0 < learnt.chain.scored  # counted anew on the try: it comes back where it pays


def test_greedy_rounds_tell_the_heads_trees_own_depth_where_a_chain_wins():
    """The chain's credit is what it adds to the heads' tree: a round whose chain is
    accepted deeper than the tree still reports how deep the tree's own path went."""
    from rewriter.runtime.settings import GenerationSettings
    from rewriter.runtime.decoding.tree.rounds import TreeRounds
    r = TreeRounds.__new__(TreeRounds)
    r.s, r.device, r.chain, r.adapt = GenerationSettings(), torch.device("cpu"), ChainLength(3), None
    r.strategy = rewriter.decoding.TreeDecoding("medusa", depth=2, tree=((0,), (0, 0)))
    tree = make_tree([[0], [0, 0]], 2)
    r.verified, tokens = with_chain(tree, torch.tensor([[5, 1, 2]] * 3), [[1, 7, 8]] * 3,
                                    torch.tensor([5] * 3))
    r.to_head = [0, 1, -1, 2, -1, -1]  # nodes: root, (0,), chain 1, (0, 0), chain 2, chain 3
    assert tokens[0].tolist() == [5, 1, 1, 2, 7, 8]
    # the model's argmax after each node: row 0 follows the chain to its end (the tree's
    # path stops after "1"); row 1 follows the tree ("1 2"); row 2 accepts nothing
    wants = [[1, 9, 7, 0, 8, 4], [1, 2, 9, 6, 0, 0], [3, 0, 0, 0, 0, 0]]
    logits = torch.full((3, 6, 10), -5.0)
    for b, w in enumerate(wants):
        for i, t in enumerate(w):
            logits[b, i, t] = 5.0
    paths, bonus = r.accept(logits, tokens, r.layout(6))
    assert paths == [[2, 4, 5], [1, 3], []] and bonus == [4, 6, 3]
    assert r.tree_depth == [1, 2, 0]


def test_beside_no_tree_a_chain_must_beat_a_plain_step():
    """A plain round costs a plain step; a round that verifies copies also does the round's
    own work (here 0.3 of a step): copies that add 0.2 tokens a round do not pay for it,
    copies that add 0.6 do (only the first copy is ever right: one is verified)."""
    from rewriter.runtime.decoding.tree.adapt import AdaptiveTree
    from test_tree_adapt import strategy
    costs = ((1, 0.0, tuple(1.3 + 0.01 * s for s in range(12))),)
    for right, want in ((1, 0), (3, 1)):  # of 5 rounds: the first copy the text's own
        a = AdaptiveTree(make_tree(WIDE, 3), replace(strategy(costs), lookup=4), batch=1)
        for r in range(10):
            a.chain.score([7, 8, 9, 10], [7 if r % 5 < right else 0] + [0] * 3, accepted=0,
                          order=3)
            a.chain.count_round(3)
        assert a.chain_length(Tree(())) == (0, 0, 0, want)


def test_costs_recorded_only_as_far_as_the_tree_go_on_at_their_slope():
    """Artifacts from before the chain's costs were measured: every copy is right, and
    the chain is still chosen whole beside the whole tree."""
    from rewriter.runtime.decoding.tree.adapt import AdaptiveTree
    from test_tree_adapt import strategy
    whole = make_tree(WIDE, 3)
    costs = ((1, 0.0, tuple(1.0 + 0.01 * s for s in range(whole.size))),)
    a = AdaptiveTree(whole, replace(strategy(costs), lookup=4), batch=1)
    for _ in range(10):
        a.chain.score([7, 8, 9, 10], [7, 8, 9, 10], accepted=0, order=2)
        a.chain.count_round(2)
    assert a.chain_length(whole) == (0, 0, 4, 4)
    record = {"strategy": "medusa", "arch": "medusa", "num_heads": 3, "tree": WIDE,
              "draft_vocab": None, "acceptance": "exact", "posterior_threshold": 0.09,
              "posterior_alpha": 0.3, "lookup": 4,
              "adapt": {"accuracy": [[0.5], [0.4], [0.3]],
                        "costs": [[1, 0.0, [1.0] * 9], [4, 0.0, [1.0] * 5]]}}
    from rewriter.decoding import check_record
    assert check_record(record) is None  # a later batch's costs may stop short of the tree


def test_a_rows_chain_is_scored_against_the_text_after_its_root():
    """The chain proposed after the root (the text's last token, not yet in the cache) is
    scored once the text has grown past it, against the tokens that followed the root."""
    r = CopiedChains(3, ChainLength(3), 1)
    r.chain, r.contexts = r.length, [Context([1, 2, 3, 1, 2])]  # root: the last 2
    r.proposed = [(5, *r.contexts[0].match(3)[::-1])]
    r.order = max((p[2] for p in r.proposed if p[1]), default=0)  # propose's
    assert r.proposed == [(5, [3, 1, 2], 2)]  # after the earlier "1 2"
    r.contexts[0].extend([3])  # a plain round: the model's token after the root
    r.score([[]], [True], [5], None, None)
    assert r.chain.scored == 0 and len(r.pending[0]) == 1  # its text is not known yet
    r.proposed = None
    r.contexts[0].extend([1, 9])
    r.score([[]], [True], [5], None, None)
    assert r.chain.scored == 1 and r.chain.gains[2] == [0, 1, 1, 0]  # "3 1" were the text's
    assert r.chain.highest == [0, 0, 1, 0] and r.chain.rounds == 1  # one round, of order 2


def test_a_rows_gain_counts_under_its_rounds_highest_order():
    """A round of two rows whose longest match is 3 tokens verifies that order's copies for
    both rows: the single-token match's right copies count as order 3's gain."""
    r = CopiedChains(3, ChainLength(3), 2)
    r.chain = r.length
    r.contexts = [Context([1, 2, 3, 9, 1, 2, 3]), Context([8, 7, 1, 8])]  # orders 3 and 1
    r.proposed = [(len(c.tokens), *c.match(3)[::-1]) for c in r.contexts]
    r.order = max((p[2] for p in r.proposed if p[1]), default=0)  # propose's
    assert [p[2] for p in r.proposed] == [3, 1]
    r.contexts[0].extend([4, 4, 4])  # row 0's copies were wrong, row 1's (7 1 8) right
    r.contexts[1].extend([7, 1, 8])
    r.score([[], []], [True, True], [10, 10], [0, 0], None)  # rows at one length: both lag
    assert r.chain.highest == [0, 0, 0, 1] and r.chain.scored == 2
    assert r.chain.gains[3] == [0, 1, 1, 1] and r.chain.gains[1] == [0] * 4


def test_in_a_batch_only_the_lagging_rows_chain_is_scored():
    """A batch takes as many rounds as its slowest row: a chain that speeds up a row ahead
    is not counted; the row behind's (wrong) chain is."""
    r = CopiedChains(3, ChainLength(3), 2)
    r.chain = r.length
    r.contexts = [Context([1, 2, 3, 9, 1, 2, 3]), Context([8, 7, 1, 8])]
    r.proposed = [(len(c.tokens), *c.match(3)[::-1]) for c in r.contexts]
    r.order = max((p[2] for p in r.proposed if p[1]), default=0)  # propose's
    r.contexts[0].extend([9, 1, 2])  # row 0's copies right, row 1's wrong
    r.contexts[1].extend([4, 4, 4])
    r.score([[], []], [True, True], [12, 10], [0, 0], None)  # row 0 is 2 tokens ahead
    assert r.chain.scored == 1 and sum(map(sum, r.chain.gains)) == 0 and r.chain.highest[3] == 1
    r.proposed = [(len(c.tokens), *c.match(3)[::-1]) for c in r.contexts]
    r.order = max((p[2] for p in r.proposed if p[1]), default=0)  # propose's
    r.contexts[0].extend([5, 5, 5])
    r.contexts[1].extend(r.proposed[1][1])  # now row 1 is ahead, row 0 behind and wrong
    r.score([[], []], [True, True], [15, 16], [0, 0], None)
    assert r.chain.scored == 2 and sum(map(sum, r.chain.gains)) == 0


def test_the_counts_halve_together():
    """At ``HALVE`` rounds every count halves at once: the same ratios, the same choice as
    counts that never halve."""
    class Unhalved(ChainLength):
        HALVE = 10 ** 9
    c, u = ChainLength(4), Unhalved(4)
    rng = random.Random(3)
    for _ in range(ChainLength.HALVE):
        h, m = rng.randrange(NGRAM + 1), rng.randrange(5)
        for x in (c, u):
            x.score([1, 2, 3, 4] if h else [], [1, 2, 3, 4][:m] + [0] * (4 - m), 0, order=h)
            x.count_round(h)
    assert c.rounds == u.rounds / 2 == ChainLength.HALVE / 2 and c.scored == u.scored / 2
    assert c.highest == [h / 2 for h in u.highest]
    assert c.gains == [[g / 2 for g in row] for row in u.gains]
    for slope in (0.01, 0.2, 0.5):
        costs = [1.0 + slope * s for s in range(5)]
        assert c.choose(1.2, costs) == u.choose(1.2, costs)


def test_a_round_verifies_as_many_copies_as_its_longest_match_was_given_for_every_row():
    """Copies by order (0, 0, 0, 3): a round where one row matched 3 tokens verifies 3
    copies, and a row of a single-token match fills them from its own chain (paid for
    already); a round of single-token matches alone verifies none."""
    from rewriter.drafts.tree import MAX_NODES
    r = CopiedChains(4, ChainLength(4), 2)
    r.copy = (0, 0, 0, 3)
    r.contexts = [Context([1, 2, 3, 9, 1, 2, 3]), Context([8, 7, 1, 8])]  # orders 3 and 1
    verified, nodes, _ = r.propose(Tree(()), torch.tensor([[5], [6]]), None, [False, False],
                                   MAX_NODES - 1)
    assert [p[2] for p in r.proposed] == [3, 1]
    assert verified.size == 4 and nodes.tolist() == [[5, 9, 1, 2], [6, 7, 1, 8]]
    r.contexts = [Context([1, 2, 3, 4]), Context([8, 7, 1, 8])]  # no match, and order 1
    verified, nodes, _ = r.propose(Tree(()), torch.tensor([[5], [6]]), None, [False, False],
                                   MAX_NODES - 1)
    assert verified.size == 1 and nodes.tolist() == [[5], [6]]
    assert r.proposed[1][1] == [7, 1, 8, 7]  # proposed whole all the same: it is scored
