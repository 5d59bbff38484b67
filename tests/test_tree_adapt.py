"""The adaptive tree (``runtime.decoding.tree.adapt``): counts on constructed rounds, the choices
they lead to, plain rounds and their probes, and whole generations that re-choose their
tree and keep plain greedy's tokens; the record's ``adapt`` entry and hostile values."""
from collections import Counter

import pytest
import torch

import rewriter
from rewriter.decoding import TreeDecoding, check_record, strategy_of
from rewriter.passes import HydraHeads, MedusaHeads
from rewriter.runtime.decoding.tree.adapt import AdaptiveTree
from rewriter.runtime.decoding.tree.drafters import level_plan
from rewriter.runtime.decoding.tree.rounds import TreeRounds
from rewriter.runtime.decoding.tree.shape import Counts
from rewriter.drafts.tree import MAX_RANK, Tree, best_subtree, make_tree

from conftest import traced_model, varied_init
from test_draft_heads import IDS, WIDE, random_heads

PRIOR = [[0.6, 0.2, 0.1, 0.05], [0.5, 0.2], [0.5]]
CHEAP = [1.0] * 9  # verifying up to 9 tokens costs one step


def strategy(costs=((1, 0.0, tuple(CHEAP)),), prior=PRIOR):
    return TreeDecoding("medusa", depth=3, tree=tuple(map(tuple, WIDE)),
                    accuracy=tuple(map(tuple, prior)), costs=costs)


def padded(acc):
    return [a + [0.0] * (MAX_RANK - len(a)) for a in acc]


def test_counts_are_the_prior_plus_what_the_rounds_saw():
    whole = make_tree(WIDE, 3)
    a = AdaptiveTree(whole, strategy(), batch=1)
    assert all(got == pytest.approx(want) for got, want in zip(a.accuracy(), padded(PRIOR)))
    assert a.choose() == best_subtree(whole, padded(PRIOR), [0.0] + CHEAP)[0] == whole
    for _ in range(4):
        a.observe(0, 1)  # head 0's second guess was right, four times
    a.observe(0, None)  # and none of its guesses once
    a.observe(2, None)
    w = AdaptiveTree.PRIOR
    got = a.accuracy()
    assert got[0][0] == pytest.approx(w * 0.6 / (5 + w))
    assert got[0][1] == pytest.approx((4 + w * 0.2) / (5 + w))
    assert got[1] == pytest.approx(padded(PRIOR)[1]) and got[2][0] == pytest.approx(w * 0.5 / (1 + w))


def test_heads_that_miss_here_lose_their_nodes_and_ones_that_hit_win_them_back():
    whole = make_tree(WIDE, 3)
    dear = (1, 0.1, tuple(1.0 + 0.2 * s for s in range(9)))  # each token verified costs more
    a = AdaptiveTree(whole, strategy(costs=(dear,)), batch=1)
    start = a.choose()
    assert 1 < start.size
    for _ in range(200):
        a.observe(0, None)
    assert a.choose() == Tree(())  # nothing pays: plain decoding
    for _ in range(400):
        a.observe(0, 0)
        a.observe(1, 0)
    back = a.choose()
    assert back.size > 1 and all(p[0] == 0 for p in back.paths) and (0, 0) in back.paths


def test_old_counts_weigh_less_so_a_change_of_text_is_followed():
    a = AdaptiveTree(make_tree(WIDE, 3), strategy(), batch=1)
    for _ in range(5000):
        a.observe(0, None)  # code the heads cannot guess ...
    assert a.accuracy()[0][0] < 0.05 and a.trials[0] < AdaptiveTree.HALVE
    for _ in range(AdaptiveTree.HALVE):
        a.observe(0, 0)  # ... then text where head 0 is always right
    assert a.accuracy()[0][0] > 0.6


def test_costs_come_from_the_largest_measured_batch_not_above():
    costs = ((1, 0.1, tuple(CHEAP)), (4, 0.3, tuple(2.0 for _ in CHEAP)))
    s = strategy(costs=costs)
    assert s.costs_at(1) == s.costs_at(3) == (0.1, tuple(CHEAP))
    assert s.costs_at(4) == s.costs_at(64) == (0.3, tuple([2.0] * 9))
    assert TreeDecoding("medusa", depth=3, tree=((0,),)).costs_at(1) is None
    assert AdaptiveTree(make_tree(WIDE, 3), s, batch=5).heads_cost == 0.3


def test_rounds_rechoose_every_few_and_plain_rounds_probe_the_whole_tree():
    whole = make_tree(WIDE, 3)
    a = AdaptiveTree(whole, strategy(costs=((1, 0.1, tuple(1.0 + 0.2 * s for s in range(9))),)), 1)
    for _ in range(500):
        a.observe(0, None)  # head 0 never right: nothing pays
    trees = [a.next(whole) for _ in range(AdaptiveTree.EVERY)]
    assert trees[:-1] == [whole] * (AdaptiveTree.EVERY - 1) and trees[-1] == Tree(())
    plain = [a.next(Tree(())) for _ in range(AdaptiveTree.PROBE)]
    assert plain[:-1] == [Tree(())] * (AdaptiveTree.PROBE - 1) and plain[-1] == whole
    assert a.next(whole) == Tree(())  # the probe saw nothing better: plain again at once
    # and the next probe waits twice as long (a probe of a large tree costs steps)
    plain = [a.next(Tree(())) for _ in range(2 * AdaptiveTree.PROBE)]
    assert plain.index(whole) == 2 * AdaptiveTree.PROBE - 1
    a.next(whole)
    for _ in range(10):  # probes that change nothing: the wait doubles up to its bound
        while a.next(Tree(())) != whole:
            pass
        a.next(whole)
    assert a.wait == AdaptiveTree.MAX_PROBE
    for _ in range(1000):
        a.observe(0, 0)  # head 0 turns right: the probe's choice differs, the wait resets
    while a.next(Tree(())) != whole:
        pass
    assert a.next(whole).size > 1 and a.wait == AdaptiveTree.PROBE
    # a sub-tree that is not empty is probed too: its dropped heads get counted again
    b = AdaptiveTree(whole, strategy(), 1)
    sub = make_tree([[0], [0, 0]], 3)
    got = [b.next(sub) for _ in range(AdaptiveTree.PROBE)]
    assert got[-1] == whole and b.probing == sub  # (rounds 4, 8, 12 were re-choices)
    assert b.next(whole) == b.choose() and b.probing is None


def rounds_by_hand(tree, hydra=False, batch=3, costs=None):
    r = TreeRounds.__new__(TreeRounds)
    r.hydra, r.tree, r.budget, r.verified, r.to_head = hydra, tree, tree, tree, None
    r.ranks = [1 + max(p[-1] for p in tree.paths if len(p) == d + 1) for d in range(tree.depth)]
    r.adapt = AdaptiveTree(tree, strategy() if costs is None else strategy(costs), batch=1)
    r.counts = Counts(r.adapt, r.ranks, hydra, batch, 3)
    r.device, r.stats = torch.device("cpu"), Counter()
    r.rounds, r.chain, r.chains_only, r.read, r.guessed = 0, None, False, None, None
    return r


def test_medusa_rounds_count_every_head_down_the_accepted_path():
    tree = make_tree(WIDE, 3)  # nodes: 1 (0) 2 (1) 3 (2) 4 (3) 5 (0,0) 6 (0,1) 7 (1,0) 8 (0,0,0)
    r = rounds_by_hand(tree)
    drafted = torch.tensor([[[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]],
                            [[40, 41, 42, 43], [50, 51, 52, 53], [60, 61, 62, 63]],
                            [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]])  # [B, K, ranks]
    r.drafted = drafted
    tokens = torch.zeros(3, 9, dtype=torch.int64)
    tokens[0, 1], tokens[0, 5] = 10, 20  # row 0 accepted (0,) then (0, 0); then head 2's
    # third guess was the model's token (the bonus)
    r.observe(tokens.tolist(), [[1, 5], [], [1]], [32, 99, 1], [False, False, True])  # row 2: done
    # row 1 accepted nothing and its token (99) was none of head 0's guesses
    assert r.adapt.trials == [2, 1, 1]
    assert r.adapt.hits[0][:4] == [1, 0, 0, 0] and r.adapt.hits[1][:4] == [1, 0, 0, 0]
    assert r.adapt.hits[2][:4] == [0, 0, 1, 0]


def test_hydra_rounds_count_a_head_only_where_it_ran_on_the_path():
    tree = make_tree(WIDE, 3)
    r = rounds_by_hand(tree, hydra=True)
    levels = level_plan(tree.layout(), tree.depth)
    parents = [lv[0] for lv in levels]
    assert [p.tolist() for p in parents] == [[0], [1, 2], [5]]
    ids = [torch.tensor([[[10, 11, 12, 13]]]),  # [B, P, ranks]
           torch.tensor([[[20, 21], [25, 26]]]), torch.tensor([[[30]]])]
    r.drafted = list(zip([p.tolist() for p in parents], ids))  # parents on the host
    tokens = torch.zeros(1, 9, dtype=torch.int64)
    tokens[0, 2], tokens[0, 7] = 11, 26  # (1,) then (1, 0): head 1 on node 2's path, rank 1
    r.observe(tokens.tolist(), [[2, 7]], [5], [False])  # node 7 has no children: head 2 never ran
    assert r.adapt.trials == [1, 1, 0]
    assert r.adapt.hits[0][:2] == [0, 1] and r.adapt.hits[1][:2] == [0, 1]
    # a sub-tree numbers its own nodes: 1 (0), 2 (1), 3 (0, 0); (1,) has no children in it
    sub = make_tree([[0], [1], [0, 0]], 3)
    r = rounds_by_hand(make_tree(WIDE, 3), hydra=True)
    r.tree = sub
    levels = level_plan(sub.layout(), sub.depth)
    assert [lv[0].tolist() for lv in levels] == [[0], [1]]
    r.drafted = list(zip([lv[0].tolist() for lv in levels],
                         [torch.tensor([[[10, 11, 12, 13]]] * 2).view(2, 1, 4),
                          torch.tensor([[[20, 21]]] * 2).view(2, 1, 2)]))
    tokens = torch.zeros(2, 4, dtype=torch.int64)
    tokens[:, 1], tokens[:, 2], tokens[:, 3] = 10, 11, 20
    r.observe(tokens.tolist(), [[1, 3], [2]], [7, 8], [False, False])  # head 1 ran on node 1's path only
    assert r.adapt.trials == [2, 1, 0]
    assert r.adapt.hits[0][:2] == [1, 1] and r.adapt.hits[1][:1] == [1]


def test_rows_past_their_end_of_sequence_are_not_counted():
    from rewriter.runtime.settings import GenerationSettings
    tree = make_tree(WIDE, 3)
    r = rounds_by_hand(tree, batch=2)
    r.s, r.ended = GenerationSettings(eos_token_id=[2]), [False, False]
    r.drafted = torch.tensor([[[10, 11, 12, 13]] * 3] * 2)  # [B, K, ranks]
    tokens = torch.zeros(2, 9, dtype=torch.int64)
    r._adapt(tokens.tolist(), [[], []], [2, 10], [False, False], [[2], [10]], [9, 9])  # row 0 ends here
    assert r.ended == [True, False] and r.adapt.trials == [2, 0, 0]
    r._adapt(tokens.tolist(), [[], []], [10, 10], [False, False], [[10], [10]], [10, 10])
    assert r.adapt.trials == [3, 0, 0] and r.adapt.hits[0][0] == 2  # row 1 alone
    assert r.counts.row_trials == [[1, 0, 0], [2, 0, 0]] and r.counts.row_hits[1][0][0] == 2


def test_in_a_batch_the_lagging_rows_counts_choose_the_tree():
    """Head 0 always right on row 0, never on row 1; pooled, it is right half the time.
    The row with the fewest tokens decides: the batch ends when it does."""
    from rewriter.runtime.settings import GenerationSettings
    whole = make_tree(WIDE, 3)
    dear = ((1, 0.1, tuple(1.0 + 0.15 * s for s in range(9))),)

    def choice(length, done=(False, False), right=(True, False), made=None):
        batch = len(length)
        r = rounds_by_hand(whole, batch=batch, costs=dear)
        r.s, r.ended, r.drafted = GenerationSettings(eos_token_id=[2]), [False] * batch, None
        for _ in range(200):
            r.adapt.observe(0, 0)
            r.adapt.observe(0, None)
        for row, hit in enumerate(right):
            r.counts.row_trials[row][0] = 200
            r.counts.row_hits[row][0][0] = 200 if hit else 0
        r.adapt.rounds = AdaptiveTree.EVERY - 1  # this round re-chooses
        made = made or [[5]] * batch  # this round's tokens per row (2 ends a row)
        r._adapt([[0] * 9] * batch, [[]] * batch, [m[-1] for m in made],
                 list(done), made, length)
        return r.tree

    assert choice([100, 90]) == Tree(())  # row 1 lags: for it nothing pays
    assert choice([90, 100]).size > 1  # row 0 lags: its guesses pay
    assert choice([100, 90], done=(False, True)).size > 1  # row 1 has all its tokens
    assert choice([100, 90], made=[[5], [2]]).size > 1  # row 1's text has ended
    assert choice([90], done=(False,), right=(False,)).size > 1  # one row: the pooled counts


def adaptive(med, prior, costs):
    """Give ``med``'s record an ``adapt`` entry (the pass measures one with tree="auto")."""
    record = med.ir.info["decoding"]
    record["adapt"] = {"accuracy": prior, "costs": costs}
    assert check_record(record) is None
    return med


@pytest.mark.parametrize("arch", ["medusa", "hydra"])
def test_a_tree_that_does_not_pay_on_this_text_is_dropped_and_the_tokens_stay_greedys(arch, tmp_path):
    from test_hydra_heads import hydra_heads
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = (hydra_heads if arch == "hydra" else random_heads)(model, tmp_path / "h.safetensors")
    cls = HydraHeads if arch == "hydra" else MedusaHeads
    plain = rewriter.optimize(traced)
    fixed = rewriter.optimize(traced, passes=[cls(weights=str(path), tree=WIDE)])
    kw = dict(max_new_tokens=48, eos_token_id=[])
    ref = plain.generate(IDS, **kw)
    assert torch.equal(fixed.generate(IDS, **kw), ref)
    sure = [[1.0], [1.0], [1.0]]  # the prior promises every guess; verifying costs a lot
    med = adaptive(rewriter.optimize(traced, passes=[cls(weights=str(path), tree=WIDE)]), sure,
                   [[1, 0.2, [1.0 + 0.3 * s for s in range(9)]]])
    med.stats.clear()
    assert torch.equal(med.generate(IDS, **kw), ref)
    s, f = med.stats, fixed.stats
    assert s["tree_changes"] >= 1 and s["head_passes"] < s["rounds"]  # plain rounds came
    # the engine keeps what it learnt: the next generation starts plain, drafting only in
    # its probes and a few rounds after one (the first one right after the prompt)
    (learnt,) = med.trees.values()
    assert learnt.current == Tree(())
    med.stats.clear()
    assert torch.equal(med.generate(IDS, **kw), ref)
    assert med.stats["head_passes"] <= 1 + med.stats["rounds"] // 8
    med.trees.clear()  # back to the pass's tree
    med.stats.clear()
    med.generate(IDS, max_new_tokens=12, eos_token_id=[])
    assert med.stats["drafted"] >= len(WIDE) * IDS.shape[0]  # its first round: the whole tree
    assert s["drafted"] / s["row_rounds"] < f["drafted"] / f["row_rounds"]


def test_heads_that_guess_right_here_keep_the_nodes_a_doubtful_prior_would_drop(monkeypatch):
    """Right guesses on the all-rank-0 chain (an oracle in place of the heads), a prior
    that doubts every head, verifying that costs: the counts keep the chain and drop the
    rest; with no counting the prior would have chosen plain rounds."""
    from conftest import oracle_drafts
    from test_draft_heads import KW, RAGGED, pair
    plain, med = pair("llama-gqa-3l")
    ref = plain.generate(RAGGED, **KW)
    oracle_drafts(monkeypatch, ref[:, -24:].tolist(), 128)
    doubt = [[0.05, 0.01, 0.01, 0.01], [0.05, 0.01], [0.05]]
    costs = [[1, 0.1, [1.0 + 0.1 * s for s in range(9)]]]
    assert best_subtree(make_tree(WIDE, 3), padded(doubt), [0.0] + costs[0][2], 0.1)[0] == Tree(())
    med = adaptive(med, doubt, costs)
    med.stats.clear()
    assert torch.equal(med.generate(RAGGED, **KW), ref)
    s = med.stats
    assert s["tree_changes"] >= 1 and s["accepted"] / s["row_rounds"] > 2


def test_the_pass_records_accuracies_and_costs_and_artifacts_keep_them(tmp_path, monkeypatch):
    from test_round_cost import _fake_costs
    _fake_costs(monkeypatch, fixed=0.1)  # timings that never say "no tree pays"
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_heads(model, tmp_path / "h.safetensors")
    med = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), max_nodes=6)])
    record = med.ir.info["decoding"]
    adapt = record["adapt"]
    assert [c[0] for c in adapt["costs"]] == [1, 2, 4, 8]
    assert all(len(c[2]) >= len(record["tree"]) + 1 for c in adapt["costs"])
    assert adapt["accuracy"][0][:3] == pytest.approx([0.5, 0.2, 0.1])
    s = strategy_of(med.ir.info)
    assert s.costs_at(1)[1][0] == pytest.approx(1.1)  # the program and the round's own work
    med.save(tmp_path / "a")
    assert rewriter.load(tmp_path / "a").ir.info["decoding"] == record
    off = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), max_nodes=6, adapt=False)])
    assert "adapt" not in off.ir.info["decoding"]
    with pytest.raises(ValueError, match="adapt must be True or False"):
        MedusaHeads(weights=str(path), adapt="yes")


GOOD = {"accuracy": PRIOR, "costs": [[1, 0.1, CHEAP], [4, 0.2, CHEAP]]}


@pytest.mark.parametrize("bad", [
    "x", {"accuracy": PRIOR}, {**GOOD, "extra": 1},
    {**GOOD, "accuracy": PRIOR[:2]},  # a head short
    {**GOOD, "accuracy": [[0.9, 0.9]] + PRIOR[1:]},  # ranks summing past 1
    {**GOOD, "accuracy": [[float("nan")]] + PRIOR[1:]},
    {**GOOD, "accuracy": [[0.1] * (MAX_RANK + 1)] + PRIOR[1:]},
    {**GOOD, "costs": []}, {**GOOD, "costs": [[2, 0.1, CHEAP]]},  # not from batch 1
    {**GOOD, "costs": [[1, 0.1, CHEAP], [1, 0.1, CHEAP]]},
    {**GOOD, "costs": [[1, 0.1, CHEAP[:5]]]},  # shorter than the tree
    {**GOOD, "costs": [[1, float("inf"), CHEAP]]}, {**GOOD, "costs": [[1, -1, CHEAP]]},
    {**GOOD, "costs": [[1, 0.1, [0.0] * 9]]}, {**GOOD, "costs": [[True, 0.1, CHEAP]]},
    {**GOOD, "costs": [[1, 0.1, CHEAP + ["x"]]]}, {**GOOD, "costs": [[1, 0.1]]},
])
def test_bad_adapt_entries_are_refused(bad):
    record = strategy().record()
    assert record["adapt"] == {"accuracy": PRIOR, "costs": [[1, 0.0, CHEAP]]}
    assert check_record({**record, "adapt": GOOD}) is None
    assert "adapt" in check_record({**record, "adapt": bad})


def test_hydra_rounds_do_not_count_past_a_copied_chains_node_or_an_unkept_path():
    """A chain copied from the text (``lookup``) is no head's guess, and a re-grown tree's
    expanded paths that were not kept (-1 in ``drafted``) ran no head on the accepted path:
    a path through either stops the counting there."""
    tree = make_tree([[0], [1], [0, 0]], 3)  # drafted: 1 (0), 2 (1), 3 (0, 0)
    r = rounds_by_hand(tree, hydra=True)
    # verified: 1 (0), 2 (1), 3 (chain), 4 (0, 0), 5 (chain, chain)
    r.verified = Tree(((0,), (1,), (10,), (0, 0), (10, 10)))
    r.to_head = [0, 1, 2, -1, 3, -1]
    # level 1 expanded node 1 and a path that was not kept (-1)
    r.drafted = [([0], torch.tensor([[[10, 11]]])), ([1, -1], torch.tensor([[[20, 21], [25, 26]]]))]
    tokens = torch.tensor([[0, 10, 11, 10, 20, 25]])
    r.observe(tokens.tolist(), [[3, 5]], [7], [False])  # the chain's two tokens were the model's
    assert r.adapt.trials == [1, 0, 0] and r.adapt.hits[0][:2] == [1, 0]  # head 0's rank 0


def test_hydras_plan_made_on_the_host_numbers_nodes_as_the_layout_does():
    """Hydra's level plan is made from the tree's paths alone (no read back mid-generation):
    the same parents, depths and ranks as the device layout."""
    from rewriter.runtime.decoding.tree.verify import host_layout
    for paths in (WIDE, [[0], [1], [0, 0]], [[0], [0, 0], [0, 0, 0], [1], [1, 0], [2]]):
        tree = make_tree(paths, 3)
        lay = tree.layout()
        host = host_layout(tree)
        for key in ("parent", "depth", "rank"):
            assert host[key] == lay[key].tolist(), key
        for a, b in zip(level_plan(host, tree.depth, torch.device("cpu")), level_plan(lay, tree.depth)):
            assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                       for x, y in zip(a, b))
