"""The decoding records (rewriter.decoding): each strategy's record type round-trips through
``ir.info["decoding"]``, version-1 records (before trees were recorded with a drafter) are
read as the same strategies, and records of neither version are refused by name."""
import pytest

from rewriter.decoding import (PlainDecoding, SelfSpeculativeDecoding, TreeDecoding, check_record,
                               current, strategy_of)

TREE = ((0,), (1,), (0, 0))
HEADS = dict(depth=2, tree=TREE, draft_vocab=None, acceptance="exact",
             posterior_threshold=0.09, posterior_alpha=0.3)
V1_TREE = {"strategy": "medusa", "num_heads": 2, "tree": [[0], [1], [0, 0]], "draft_vocab": None,
           "acceptance": "exact", "posterior_threshold": 0.09, "posterior_alpha": 0.3}
STRATEGIES = [
    SelfSpeculativeDecoding((1,), (), (2,), 4, 0.5),
    SelfSpeculativeDecoding(max_draft=3, draft_weights="int4"),
    TreeDecoding("medusa", **HEADS),
    TreeDecoding("hydra", **HEADS, batch_trees=((2, ((0,),)), (4, ())), lookup=3,
                 accuracy=((0.5, 0.2), (0.4,)), costs=((1, 0.1, (1.0, 1.1, 1.2, 1.3)),)),
    TreeDecoding("eagle", **HEADS, dynamic=2),
    TreeDecoding("none", lookup=4),
    TreeDecoding("none", lookup=2, costs=((1, 0.0, (1.0, 1.5)), (4, 0.0, (1.0, 2.0, 3.0)))),
]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=repr)
def test_each_record_round_trips_and_checks(strategy):
    record = strategy.record()
    assert check_record(record) is None and record["version"] == 2
    assert strategy_of({"decoding": record}) == strategy
    assert strategy.KIND == record["strategy"]


def test_no_record_is_plain_decoding():
    assert strategy_of({}) == strategy_of({"decoding": None}) == PlainDecoding()
    assert PlainDecoding().record() is None and PlainDecoding().cache_slack() == 0


@pytest.mark.parametrize("arch", ["medusa", "hydra", "eagle"])
def test_a_version_1_tree_is_read_as_a_tree_with_its_drafter_and_depth(arch):
    old = {**V1_TREE, "arch": arch, **({"dynamic": 2} if arch == "eagle" else {})}
    assert check_record(old) is None
    assert current(old) == {**TreeDecoding(arch, **HEADS, dynamic=old.get("dynamic", 0)).record()}
    assert strategy_of({"decoding": old}) == TreeDecoding(arch, **HEADS, dynamic=old.get("dynamic", 0))


def test_version_1_chains_and_self_speculation_are_read_as_they_were_meant():
    lookup = {"strategy": "lookup", "lookup": 4, "costs": [[1, [1.0, 1.5]]]}
    assert check_record(lookup) is None
    assert strategy_of({"decoding": lookup}) == TreeDecoding("none", lookup=4,
                                                             costs=((1, 0.0, (1.0, 1.5)),))
    spec = {"strategy": "self_speculative", "skip_layers": [1], "skip_attention": [],
            "skip_mlp": [], "max_draft": 4, "threshold": 0.5}
    assert check_record(spec) is None
    assert strategy_of({"decoding": spec}) == SelfSpeculativeDecoding((1,), (), (), 4, 0.5)


@pytest.mark.parametrize("bad, why", [
    ({**V1_TREE, "arch": "hydra", "drafter": "eagle"}, "not drafter or depth"),  # versions mixed
    ({**V1_TREE, "arch": "hydra", "depth": 2}, "not drafter or depth"),
    ({**V1_TREE, "arch": "none", "lookup": 4}, "arch: one of"),  # version 1 refused it
    ({**V1_TREE, "arch": ["hydra"]}, "arch: one of"),
    ({"strategy": "lookup", "lookup": 4, "drafter": "none"}, "names no drafter"),
    ({"strategy": []}, "strategy: one of"),
    ({"version": 2, "strategy": []}, "strategy: one of"),  # unhashable: named, not a TypeError
    ({"version": 2, "strategy": {}}, "strategy: one of"),
    ({**TreeDecoding("medusa", **HEADS).record(), "version": 3}, "version"),
    ({**TreeDecoding("medusa", **HEADS).record(), "version": True}, "version"),
    ({**TreeDecoding("medusa", **HEADS).record(), "num_heads": 2}, "exactly the keys"),
    ({**TreeDecoding("medusa", **HEADS).record(), "drafter": "lookup"}, "drafter"),
    ({**TreeDecoding("medusa", **HEADS).record(), "depth": 0}, "depth"),
    ({**TreeDecoding("none", lookup=2).record(), "tree": [[0]]}, "drafter 'none'"),
    ({**TreeDecoding("none", lookup=2).record(), "lookup": 0}, "lookup"),
    ({**TreeDecoding("eagle", **HEADS, dynamic=2).record(), "dynamic": None}, "dynamic"),
    ({"version": 2, "strategy": "medusa"}, "strategy"),
    ({"strategy": "tree", "drafter": "none", "lookup": 2}, "version"),  # version 2 unmarked
    ({"strategy": "plain"}, "version"),
    ([], "version"), (None, "version"), ("tree", "version"),
])
def test_records_of_neither_version_are_refused_by_name(bad, why):
    assert why in (check_record(bad) or "")
