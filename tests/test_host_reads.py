"""A round reads the device back once. On a GPU every read back (``tolist``, ``item``,
``bool`` of a tensor) and every copy from the host waits for the work queued before it, so
their number per round, not the ops' cost, bounds how fast rounds go there (the H100 run of
2026-11-24 timed a round's own work at 3.2 decode steps). Counted here on the CPU, where the
same calls are made: static rounds (the GPU's path, without the graphs), greedy, with an end
of sequence to watch for, over a ragged batch."""
import collections

import pytest
import torch

import rewriter
from rewriter.measure.host_reads import counting
from rewriter.passes import HydraHeads, MedusaHeads, SelfSpeculative

from conftest import make_model, measured_costs, varied_init
from test_hydra_heads import hydra_heads

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
ROWS = [[3, 17, 42, 5, 99, 8, 64, 11, 12], [1, 2, 3], [50, 51, 52, 53, 54]]


def counted(engine, rows=ROWS, **kw) -> tuple[collections.Counter, int]:
    """(read backs and host-to-device copies made by a generation, its rounds)."""
    engine.stats.clear()
    with counting() as count:
        engine.generate(rows, max_new_tokens=24, **kw)
    return count, engine.stats["rounds"]


def test_counting_counts_reads_and_copies_and_restores_torch():
    tolist, tensor = torch.Tensor.tolist, torch.tensor
    with pytest.raises(RuntimeError, match="inside"):
        with counting() as count:
            t = torch.tensor([1, 2])
            t.tolist(), bool(t[0]), int(t[1])
            t + 1  # neither a read nor a copy
            raise RuntimeError("inside")
    assert count == {"reads": 3, "copies": 1}
    assert torch.Tensor.tolist is tolist and torch.tensor is tensor


@pytest.mark.parametrize("strategy", ["self_speculative", "medusa", "hydra"])
def test_a_greedy_round_reads_the_device_back_once(strategy, tmp_path):
    model = make_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    passes = {"self_speculative": lambda: [SelfSpeculative(skip_layers=[1], threshold=0.0,
                                                           max_draft=3)],
              "medusa": lambda: [MedusaHeads(num_heads=3, tree=TREE)],
              "hydra": lambda: [HydraHeads(weights=str(hydra_heads(model, tmp_path / "h.safetensors")),
                                           tree=TREE)]}[strategy]()
    engine = rewriter.optimize(model, passes=passes)
    engine.fallback, engine.static_decode = False, True  # the rounds, as a GPU runs them
    engine.generate(ROWS, max_new_tokens=4, eos_token_id=[])  # layouts and replays made once
    count, rounds = counted(engine, eos_token_id=[7])
    assert rounds >= 5
    # the prompt's first token and the last round's columns aside: one read back a round
    assert count["reads"] <= rounds + 2, (count, rounds)
    # a round's lengths and finished rows, its K/V moves and the tokens it hands out
    assert count["copies"] <= 4 * rounds + 4, (count, rounds)


def cheap_rounds(record: dict) -> None:
    """Costs under which the heads' tree pays at every batch size, in place of the ones the
    pass timed: on a loaded machine those may find that no tree pays, and the heads would
    never draft. What is tested is the reads a drafting round makes, not the choice."""
    record.pop("batch_trees", None)
    verify = [1.0 + 0.01 * s for s in range(len(record["tree"]) + 1 + record.get("lookup", 0))]
    record["adapt"]["costs"] = [[1, 0.0, verify]]


@pytest.fixture(scope="module")
def default_trace():
    """The default model traced once, for both kinds of heads."""
    return rewriter.trace(rewriter.default_model()[0])


@pytest.mark.parametrize("cls", [MedusaHeads, HydraHeads])
def test_an_adaptive_trees_counts_come_with_the_same_read(cls, default_trace, monkeypatch):
    """The pass's defaults on the default model with its shipped heads: the tree adapts to
    the text, and the heads' guesses it counts come back with the acceptance's one read."""
    # costs set, not timed: the pass chooses its tree at once instead of timing rounds
    # (tens of seconds) whose costs cheap_rounds replaces below anyway
    measured_costs(monkeypatch, slope=0.01)
    engine = rewriter.optimize(default_trace, passes=[cls(weights="default")])
    engine.fallback, engine.static_decode = False, True
    cheap_rounds(engine.ir.info["decoding"])
    rows = [list(range(3, 40)), list(range(50, 70))]
    engine.generate(rows, max_new_tokens=4, eos_token_id=[])
    count, rounds = counted(engine, rows, eos_token_id=[7])
    assert engine.ir.info["decoding"].get("adapt") is not None
    assert rounds >= 5 and engine.stats["head_passes"] > 0  # the heads drafted
    # per generation, beside the prompt's first token: the prompts' text for prompt lookup
    assert count["reads"] <= rounds + 5, (count, rounds)
