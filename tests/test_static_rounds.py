"""Speculative and tree rounds on fixed buffers (``runtime.replay``): the path every round
takes on CUDA, where each fixed-shape call is replayed from a CUDA graph. Run here without
the graph (``static_decode = True`` on a CPU): the same tokens as the eager rounds and as
plain greedy decoding, one replay per program and shape, and the replays a generation keeps
bounded."""
import pytest
import torch

import rewriter
from rewriter.passes import HydraHeads, MedusaHeads, SelfSpeculative
from rewriter.runtime.decoding import speculative
from rewriter.runtime.replay import Replay

from conftest import traced_model, varied_init
from test_hydra_heads import hydra_heads

RAGGED = [[3, 17, 42, 5, 99, 8, 64, 11, 12], [1, 2, 3], [50, 51, 52, 53, 54]]
KW = dict(max_new_tokens=20, eos_token_id=[])
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]

# One xdist worker runs this module (``--dist loadgroup``, pyproject.toml):
# its shared traces are built once.
pytestmark = pytest.mark.xdist_group("static_rounds")


def engines(config, tmp_path):
    """{name: optimized model} for plain decoding and each round-based strategy: engines of
    the test's own, optimized from copies of the config's one trace."""
    model, traced = traced_model(config, initializer_range=varied_init(config))
    hydra = hydra_heads(model, tmp_path / "hydra.safetensors")
    return {"plain": rewriter.optimize(traced),
            "self_speculative": rewriter.optimize(traced, passes=[
                SelfSpeculative(skip_layers=[1], threshold=0.0, max_draft=3)]),
            "medusa": rewriter.optimize(traced, passes=[MedusaHeads(num_heads=3, tree=TREE)]),
            "hydra": rewriter.optimize(traced, passes=[HydraHeads(weights=str(hydra), tree=TREE)]),
            "hydra_dynamic": rewriter.optimize(traced, passes=[
                HydraHeads(weights=str(hydra), tree=TREE, dynamic=2)])}


def run(engine, static, prompts, **kw):
    engine.static_decode = static
    engine.stats.clear()
    return engine.generate(prompts, **{**KW, **kw}), dict(engine.stats)


@pytest.mark.parametrize("config", ["llama-gqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_static_rounds_give_the_eager_rounds_tokens_on_a_ragged_batch(config, tmp_path):
    models = engines(config, tmp_path)
    plain, _ = run(models.pop("plain"), False, RAGGED)
    for name, engine in models.items():
        eager, eager_stats = run(engine, False, RAGGED)
        static, static_stats = run(engine, True, RAGGED)
        assert torch.equal(static, eager) and torch.equal(static, plain), name
        assert static_stats["rounds"] == eager_stats["rounds"] > 0, name
        assert static_stats["accepted"] > 0, name  # rounds that accept: not plain steps


def test_static_rounds_reach_the_end_of_the_cache_and_sample_as_eager_rounds_do(tmp_path):
    models = engines("llama-gqa-3l", tmp_path)  # context: 128 positions
    ids = torch.stack([torch.arange(1, 101) % 120, torch.arange(100, 0, -1) % 97])
    kw = dict(max_new_tokens=28)  # 100 + 28 = the whole context
    plain, _ = run(models.pop("plain"), False, ids, **kw)
    for name, engine in models.items():
        static, _ = run(engine, True, ids, **kw)
        assert torch.equal(static, plain), name
        sampled = dict(do_sample=True, seed=3)  # the same draws on the same logits
        assert torch.equal(run(engine, True, RAGGED, **sampled)[0],
                           run(engine, False, RAGGED, **sampled)[0]), name


def test_graph_outputs_overwritten_by_the_next_replay_are_never_read(tmp_path, monkeypatch):
    """A replayed CUDA graph returns its own output tensors, rewritten by its next replay.
    Here every call returns the same tensors and poisons them (NaN, -1) before the next:
    a round that read an output after calling its replay again would change its tokens."""
    real = Replay.__call__

    def graph_like(self, *values):
        values = [v.clone() for v in values]  # copied into the buffers before the replay
        kept = self.__dict__.setdefault("kept", [])
        for t in kept:  # what the previous call returned is rewritten by this one
            t.fill_(float("nan") if t.is_floating_point() else -1)
        out = real(self, *values)
        outs = out if isinstance(out, tuple) else (out,)
        if not kept:
            kept += [t.clone() for t in outs]
        for t, new in zip(kept, outs):
            t.copy_(new)
        return tuple(kept) if isinstance(out, tuple) else kept[0]
    monkeypatch.setattr(Replay, "__call__", graph_like)
    models = engines("llama-gqa-3l", tmp_path)
    plain, _ = run(models.pop("plain"), False, RAGGED)
    for name, engine in models.items():
        assert torch.equal(run(engine, True, RAGGED)[0], plain), name
        sampled = dict(do_sample=True, seed=5)
        assert torch.equal(run(engine, True, RAGGED, **sampled)[0],
                           run(engine, False, RAGGED, **sampled)[0]), name


def test_each_program_and_shape_is_one_replay_made_once(tmp_path, monkeypatch):
    made = []
    real = Replay.__init__

    def counting(self, run, inputs, cuda_graph, name="step"):
        made.append((name, tuple(tuple(t.shape) for t in inputs)))
        real(self, run, inputs, cuda_graph, name)
    monkeypatch.setattr(Replay, "__init__", counting)
    models = engines("llama-gqa-3l", tmp_path)
    _, stats = run(models["medusa"], True, RAGGED)
    assert len(made) == len(set(made)) and stats["rounds"] > len(made)
    # the whole tree (root + 7 nodes): tokens, positions, starts, padding, mask and depths
    assert ("verify step of 8 tokens", ((3, 8), (3, 8), (3,), (3,), (8, 8), (8,))) in made
    assert ("heads", ((3, 1, 64),)) in made
    made.clear()
    run(models["hydra"], True, RAGGED)
    assert {"head0", "head1", "head2", "verify step of 8 tokens"} <= {n for n, _ in made}
    assert len(made) == len(set(made))
    made.clear()
    run(models["self_speculative"], True, RAGGED)
    assert ("draft step of 1 tokens", ((3, 1), (3, 1), (3,), (3,))) in made
    assert len(made) == len(set(made)) <= 5  # verification of 1-4 tokens, one draft step


def test_the_engine_keeps_only_the_most_recently_used_replays(tmp_path, monkeypatch):
    models = engines("llama-gqa-3l", tmp_path)
    spec = models["self_speculative"]
    eager, _ = run(spec, False, RAGGED)
    spec.replays.limit = 2  # a draft step and one verification
    kept = []
    real = speculative.Rounds.replay

    def watching(self, key, *args):
        out = real(self, key, *args)
        kept.append((key, self.store().keys()))
        return out
    monkeypatch.setattr(speculative.Rounds, "replay", watching)
    static, _ = run(spec, True, RAGGED)
    assert torch.equal(static, eager)
    for (key, held), (_, before) in zip(kept[1:], kept):
        assert len(held) <= 2 and held[-1] == key  # the one just used is the newest
        if key not in before and len(before) == 2:  # a new one evicts the least recent
            assert held == [before[-1], key]
    assert len({k for k, _ in kept}) > 2  # more shapes than it keeps: evictions happened


def test_replays_outlive_a_generation_with_new_padding_and_a_paused_stream(tmp_path, monkeypatch):
    import gc
    import weakref
    made = []
    real = Replay.__init__

    def counting(self, run, inputs, cuda_graph, name="step"):
        made.append(name)
        real(self, run, inputs, cuda_graph, name)
    monkeypatch.setattr(Replay, "__init__", counting)
    models = engines("llama-gqa-3l", tmp_path)
    reference = models["plain"]
    even = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]  # no padding
    other = [[7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18]]  # other rows, other padding
    want = {id(p): run(reference, False, p)[0] for p in (RAGGED, even, other)}
    for name, engine in models.items():
        for prompts in (RAGGED, other, even):  # (the store keeps 16: Hydra's fill it)
            before = len(made)
            got, _ = run(engine, True, prompts)
            assert torch.equal(got, want[id(prompts)]), (name, prompts)
            if prompts is other:  # padded as RAGGED was: the same replays, at most a shape
                assert len(made) - before <= 1, name  # the first text did not need
        # a stream paused mid-way holds the engine's cache: the next call gets its own, and
        # each goes on with its own replays
        engine.static_decode = True
        stream = engine.stream(RAGGED, **KW)
        head = [next(stream) for _ in range(5)]
        paused = weakref.ref(engine._cache)
        between, _ = run(engine, True, other)
        assert engine._cache is not paused()
        engine.static_decode = True
        rest = list(stream)
        assert torch.equal(between, want[id(other)]), name
        assert torch.equal(torch.stack(head + rest, 1),
                           want[id(RAGGED)][:, -KW["max_new_tokens"]:]), name
        del stream
        gc.collect()
        assert paused() is None, name  # no replay the stream made keeps its cache alive
        assert engine.replays.serves(engine._cache) and len(engine.replays) > 0


def test_a_replay_copies_its_inputs_into_fixed_buffers():
    seen = []

    def program(a, b):
        seen.append((a.data_ptr(), b.data_ptr()))
        return a * 2 + b
    r = Replay(program, [torch.zeros(2, 3), torch.zeros(3)], cuda_graph=False, name="toy")
    x, y = torch.arange(6.).view(2, 3), torch.ones(3)
    assert torch.equal(r(x, y), x * 2 + y) and torch.equal(r(y.expand(2, 3), x[0]), 2 + x[0].expand(2, 3))
    assert seen[0] == seen[1] != (x.data_ptr(), y.data_ptr())  # the same buffers every call
    with pytest.raises(TypeError, match="toy: 1 inputs for 2 buffers"):
        r(x)
    with pytest.raises(ValueError, match=r"toy: an input of shape \[3\] for a buffer of \[2, 3\]"):
        r(y, y)  # never broadcast into the buffer
