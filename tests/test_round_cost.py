"""A round's and a plain step's whole cost, timed by the runtime's measurer
(``rewriter.runtime.measurer``, ``runtime.decoding.tuning``; the model: ``rewriter.measure.round_cost``),
and the pass that weighs trees by it."""
from dataclasses import replace

import pytest
import torch

import rewriter
import rewriter.runtime.measurer as timing
from rewriter.measure import round_cost
from rewriter.runtime.decoding import tuning
from rewriter.runtime.measurer import RuntimeMeasurer
from rewriter.decoding import strategy_of
from rewriter.errors import RewriterError
from rewriter.passes import HydraHeads, MedusaHeads

from conftest import fixed_round_work, traced_model, varied_init
from test_draft_heads import random_heads


def test_program_costs_move_into_plain_steps_with_the_rounds_own_work_added():
    # a decode program takes 2 s, a plain step 2.5 s, a round's work outside programs 0.5 s
    heads, verify = round_cost.adjust(0.2, [1.0, 1.5, 3.0], {"decode": 2.0, "plain": 2.5, "fixed": 0.5})
    assert heads == pytest.approx(0.16)
    assert verify == pytest.approx([1.0, 1.4, 2.6])


@pytest.mark.parametrize("cls", [MedusaHeads, HydraHeads])
def test_both_loops_are_timed_and_the_record_is_left_as_it_was(cls, tmp_path):
    from test_hydra_heads import hydra_heads
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = (hydra_heads if cls is HydraHeads else random_heads)(model, tmp_path / "h.safetensors")
    med = rewriter.optimize(traced, passes=[cls(weights=str(path), tree=[[0], [1], [0, 0]])])
    record = med.ir.info.pop("decoding")  # as the pass has it: no record yet
    s = strategy_of({"decoding": record})
    times = tuning.round_times(med.ir, s, (1, 3), new=8)
    assert "decoding" not in med.ir.info
    assert set(times) == {1, 3}
    for t in times.values():
        assert set(t) == {"decode", "plain", "round", "fixed", "rounds"}
        assert all(v >= 0 for v in t.values()) and t["decode"] > 0 and t["plain"] > 0
        assert t["rounds"] >= 8  # whole-tree rounds, over more generations if need be
    # a sub-tree recorded for larger batches is not what is timed: the whole tree is
    sub = replace(s, batch_trees=((2, ((0,),)),))
    assert tuning.round_times(med.ir, sub, (4,), new=4)[4]["rounds"] >= 4
    med.ir.info["decoding"] = {"strategy": "plain"}
    with pytest.raises(RewriterError, match="heads"):  # a record the graph does not fit
        tuning.round_times(med.ir, replace(s, depth=s.depth + 1), (1,), new=4)
    assert med.ir.info["decoding"] == {"strategy": "plain"}
    with pytest.raises(ValueError, match="new must be"):
        tuning.round_times(med.ir, s, (1,), new=1)


def test_static_loops_time_their_programs_as_whole_replays(tmp_path, monkeypatch):
    # the path a GPU takes (there each replay is a CUDA graph): here without the graph
    from rewriter.runtime.replay import Replay
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_heads(model, tmp_path / "h.safetensors")
    med = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), tree=[[0], [1], [0, 0]])])
    s = strategy_of({"decoding": med.ir.info.pop("decoding")})
    names = []
    real = Replay.__init__
    monkeypatch.setattr(Replay, "__init__", lambda self, run, inputs, graph, name="step": (
        names.append(name), real(self, run, inputs, graph, name))[1])
    t = tuning.round_times(med.ir, s, (2,), new=8, static=True)[2]
    assert {"decode step", "verify step of 4 tokens", "heads"} <= set(names)
    assert t["rounds"] >= 8 and t["decode"] > 0 and t["plain"] > 0
    assert t["fixed"] < t["round"]  # the programs' replays were timed apart from the round
    # the programs' own costs, timed as the same replays
    names.clear()
    cost = timing.verify_cost(med.ir, 4, runs=2, static=True)
    assert len(cost) == 5 and cost[1] == 1 and all(c > 0 for c in cost[1:])
    assert timing.heads_cost(med.ir, 3, False, runs=2, static=True) > 0
    assert names == ["timed call"] * 6  # 4 verify lengths, a decode step and the heads


@pytest.mark.parametrize("config,key", [("llama-gqa-3l", "max_position_embeddings"),
                                        ("gpt2-3l", "n_positions")])  # a learned position table
def test_short_contexts_time_shorter_prompts_or_name_the_problem(config, key, tmp_path, monkeypatch):
    from rewriter.errors import PassError
    # the programs' own timings, at short contexts, and their errors
    model, traced = traced_model(config, initializer_range=varied_init(config), **{key: 40})
    ir = rewriter.optimize(traced).ir
    assert len(timing.verify_cost(ir, 33, runs=1)) == 34  # positions 7 .. 39
    with pytest.raises(PassError, match="a step of 40 tokens needs a context of more than 40"):
        timing.verify_cost(ir, 40, runs=1)
    # cheap programs: the pass chooses all 6 nodes, whose timed rounds need more than 40
    monkeypatch.setattr(RuntimeMeasurer, "verify_cost",
                        lambda self, ir, most, runs=15, batch=1: [0.0] + [1.0] * most)
    monkeypatch.setattr(RuntimeMeasurer, "heads_cost", lambda *a, **k: 0.0)
    path = random_heads(model, tmp_path / "h.safetensors")
    with pytest.raises(PassError, match="needs a context of more than .* the model has 40"):
        rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), max_nodes=6)])
    # 80 positions: the timed prompts are cut short of 64 tokens to fit
    model, traced = traced_model(config, initializer_range=varied_init(config), **{key: 80})
    path = random_heads(model, tmp_path / "h80.safetensors")
    med = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), max_nodes=6)])
    ids = torch.tensor([[3, 17, 42, 5]])
    kw = dict(max_new_tokens=8, eos_token_id=[])
    assert torch.equal(med.generate(ids, **kw), rewriter.optimize(traced).generate(ids, **kw))


def test_timings_past_the_records_bounds_are_clamped():
    heads, verify = round_cost.adjust(1e6, [1.0, 2.0], {"decode": 1.0, "plain": 1e-9, "fixed": 0.0})
    assert heads == round_cost.LIMIT and verify == [round_cost.LIMIT] * 2


def _fake_costs(monkeypatch, fixed: float):
    """Programs that cost: verifying s tokens 1 + 0.02 s decode programs, a heads call 0.05;
    a plain step is one decode program; a round spends ``fixed`` more."""
    monkeypatch.setattr(RuntimeMeasurer, "verify_cost",
                        lambda self, ir, most, runs=15, batch=1: [0.0] + [1 + 0.02 * s for s in range(most)])
    monkeypatch.setattr(RuntimeMeasurer, "heads_cost", lambda *a, **k: 0.05)
    return fixed_round_work(monkeypatch, fixed)


def test_a_rounds_own_work_that_eats_the_gain_makes_the_pass_decode_plainly(monkeypatch, tmp_path):
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_heads(model, tmp_path / "h.safetensors")
    calls = _fake_costs(monkeypatch, fixed=0.0)
    cheap = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), max_nodes=8)])
    record = cheap.ir.info["decoding"]
    assert len(record["tree"]) >= 2 and record["batch_trees"][0][0] == 2
    assert [b for _, b in calls] == [(1,), (2, 4, 8)]  # then the chosen tree at every batch
    assert record["adapt"]["costs"][0][2][:3] == pytest.approx([1.0, 1.02, 1.04])

    calls = _fake_costs(monkeypatch, fixed=1.5)  # heads guessing .5/.3 cannot pay for that
    dear = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), max_nodes=8)])
    record = dear.ir.info["decoding"]
    assert record["batch_trees"] == [[1, []]]
    assert record["adapt"]["costs"][0][2][0] == pytest.approx(2.5)
    assert dear.ir.info["medusa"]["report"]["round_overhead"] == {"round": 1.5, "plain_step": 1.0}
    assert [b for _, b in calls] == [(1,)]  # nothing pays at one row: no batch is measured
    ids = torch.tensor([[3, 17, 42, 5]])
    assert torch.equal(dear.generate(ids, max_new_tokens=6, eos_token_id=[]),
                       rewriter.optimize(traced).generate(ids, max_new_tokens=6, eos_token_id=[]))
