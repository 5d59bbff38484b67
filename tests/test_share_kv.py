"""KV sharing across layers (``ShareKV``): readers take their owner's k and v in the IR,
the runtime allocates one cache per owner and writes it once; refusals name the problem."""
import pytest
import torch

import rewriter
from rewriter.errors import PassError, VerificationError
from rewriter.ir.sharing import check_sharing, sources
from rewriter.ir.verify import verify
from rewriter.passes import FuseQKV, FuseRoPE, Int4Weights, LayerSkip, SelfSpeculative, ShareKV
from rewriter.passes import StreamingAttention, from_spec, to_spec
from rewriter.ops import OPS, op_arguments

from artifact_tools import saved_and_loaded
from conftest import traced_model, varied_init

NAME = "llama-gqa-3l"
IDS = torch.tensor([[5, 9, 14, 2, 7, 30, 11, 4], [3, 3, 8, 1, 60, 12, 9, 2]])


def _trace(name: str = NAME):
    return traced_model(name, initializer_range=varied_init(name))[1]


def _eager_greedy(opt, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding by the whole-sequence IR (no cache): each reader recomputes its
    owner's K and V from the owner's input, the reference the cache must equal."""
    seq = ids.clone()
    with torch.no_grad():
        for _ in range(new):
            seq = torch.cat([seq, opt(seq)[:, -1:].argmax(-1)], 1)
    return seq


def _attention(ir, layer: int):
    return next(n for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"])
                if op_arguments("attention", tuple(n.args), dict(n.kwargs))["layer"] == layer)


def test_groups_and_suffixes_pick_the_lowest_and_the_last_owner():
    layers = list(range(7))
    assert ShareKV(every=2).pairs(layers) == {1: 0, 3: 2, 5: 4}
    assert ShareKV(every=3).pairs(layers) == {1: 0, 2: 0, 4: 3, 5: 3}
    assert ShareKV(last=3).pairs(layers) == {4: 3, 5: 3, 6: 3}
    assert ShareKV(sources={"5": 2, 6: 2}).pairs(layers) == {5: 2, 6: 2}


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"every": 2, "last": 1}, "exactly one"), ({"every": 1}, "every"),
    ({"every": True}, "every"), ({"last": 0}, "last"), ({"sources": [1, 0]}, "map"),
    ({"sources": {1: 1}}, "earlier"), ({"sources": {0: 1}}, "earlier"),
    ({"sources": {"x": 0}}, "earlier"), ({"sources": {2: 1, 1: 0}}, "both reads")])
def test_bad_parameters_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShareKV(**kwargs)


def test_a_map_that_shares_nothing_is_the_model():
    plain = rewriter.optimize(_trace())
    same = rewriter.optimize(_trace(), passes=[ShareKV(sources={})])
    assert torch.equal(same.generate(IDS, max_new_tokens=8), plain.generate(IDS, max_new_tokens=8))
    assert same.kv_bytes_per_token() == plain.kv_bytes_per_token()


@pytest.mark.parametrize("name", [NAME, "qwen2-mqa-3l", "mistral-window-3l"])
def test_the_shared_cache_gives_the_whole_sequence_graphs_tokens(name):
    """The cache (written by the owner, read by its reader) against the graph that computes
    the owner's K/V for the reader from scratch; a ragged batch included."""
    opt = rewriter.optimize(_trace(name), passes=[ShareKV(every=2)])
    assert sources(opt.ir.graph) == {1: 0}
    assert torch.equal(opt.generate(IDS, max_new_tokens=10), _eager_greedy(opt, IDS, 10))
    ragged = [[5, 9, 14], [3, 3, 8, 1, 60, 12, 9, 2]]
    for row, out in zip(ragged, opt.generate(ragged, max_new_tokens=6)):
        assert out[-6:].tolist() == _eager_greedy(opt, torch.tensor([row]), 6)[0, -6:].tolist()


def test_readers_lose_their_projections_and_the_cache_is_the_owners_alone():
    plain = rewriter.optimize(_trace())
    opt = rewriter.optimize(_trace(), passes=[ShareKV(last=2)])
    gone = [w for w in plain.ir.weights() if w not in opt.ir.weights()]
    assert sorted(gone) == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight"
                                  for i in (1, 2) for p in "kv")
    # the allocator's bytes: the one owner's cache, not three
    assert opt.kv_bytes_per_token() * 3 == plain.kv_bytes_per_token()
    opt.generate(IDS, max_new_tokens=2)
    assert sorted(opt._cache.k) == [0] and opt._cache.nbytes * 3 == plain_cache_bytes(plain)
    assert _attention(opt.ir, 2).kwargs["kv_source"] == 0 and "kv_source=0" in str(opt.ir)


def plain_cache_bytes(plain) -> int:
    plain.generate(IDS, max_new_tokens=2)
    return plain._cache.nbytes


def test_the_verifier_refuses_what_the_cache_could_not_serve():
    opt = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0})])
    ir = opt.ir
    reader, other = _attention(ir, 2), _attention(ir, 1)

    def refused(change, message):
        saved = (reader.args, dict(reader.kwargs))
        change()
        with pytest.raises(VerificationError, match=message):
            check_sharing(ir)
        reader.args, reader.kwargs = saved

    refused(lambda: reader.update_kwarg("kv_source", 7), "names no attention")
    refused(lambda: reader.update_arg(1, op_arguments("attention", tuple(other.args),
                                                      dict(other.kwargs))["k"]),
            r"its k \(.*\) is not the owner's")
    refused(lambda: reader.update_kwarg("window", 4), "its window")
    check_sharing(ir)
    verify(ir, shapes=False)
    both = rewriter.optimize(_trace(), passes=[ShareKV(sources={1: 0, 2: 0})]).ir
    _attention(both, 2).update_kwarg("kv_source", 1)
    with pytest.raises(VerificationError, match="which reads layer 0's: name the owner"):
        check_sharing(both)


def test_sparse_caches_first_and_fused_projections_are_refused_by_name():
    with pytest.raises(PassError, match="must run before StreamingAttention"):
        rewriter.optimize(_trace(), passes=[StreamingAttention(sinks=2, window=8), ShareKV(every=2)])
    with pytest.raises(PassError, match="before FuseQKV"):
        rewriter.optimize(_trace(), passes=[FuseQKV(), ShareKV(every=2)])
    fused = rewriter.optimize(_trace(), passes=[FuseQKV()]).ir
    fused.info["fusions"] = {}  # a projection fused by the model itself, as FuseQKV fuses it
    with pytest.raises(PassError, match="one projection with its queries"):
        ShareKV(every=2).run(fused)
    # GPT-2's c_attn is split into three projections by the frontend: it shares
    gpt2 = rewriter.optimize(_trace("gpt2-3l"), passes=[ShareKV(every=2)])
    assert "transformer.h.1.attn.k_proj.weight" not in gpt2.ir.weights()
    assert torch.equal(gpt2.generate(IDS, max_new_tokens=6, eos_token_id=[]),
                       _eager_greedy(gpt2, IDS, 6))  # its config's EOS lies past this vocabulary
    with pytest.raises(PassError, match="layer 5 has no attention"):
        rewriter.optimize(_trace(), passes=[ShareKV(sources={5: 0})])


def test_layer_skip_refuses_to_remove_an_owner_its_readers_need():
    with pytest.raises(PassError, match=r"layer 0 owns the KV cache that layers \[1, 2\] read"):
        rewriter.optimize(_trace(), passes=[ShareKV(last=2), LayerSkip(layers=[0])])
    # an owner removed with every reader is a model without them
    rewriter.optimize(_trace(), passes=[ShareKV(sources={1: 0}), LayerSkip(layers=[0, 1])])


def test_a_draft_that_skips_the_owner_lets_its_reader_write_and_stays_lossless():
    """Self-speculative decoding whose draft skips layer 0 (the owner): the draft's first
    reader writes the cache the skipped owner would have; the verified tokens are greedy's."""
    shared = rewriter.optimize(_trace(), passes=[ShareKV(every=2)])
    spec = rewriter.optimize(_trace(), passes=[ShareKV(every=2), SelfSpeculative(skip_layers=[0])])
    want = shared.generate(IDS, max_new_tokens=12)
    assert torch.equal(spec.generate(IDS, max_new_tokens=12), want)
    assert spec.stats["rounds"] > 0


@pytest.mark.parametrize("passes", [[ShareKV(every=2), FuseRoPE()], [FuseRoPE(), ShareKV(every=2)],
                                    [ShareKV(every=2), Int4Weights(group_size=32)]])
def test_it_composes_with_fusions_and_int4(passes):
    opt = rewriter.optimize(_trace(), passes=passes)
    assert sources(opt.ir.graph) == {1: 0}
    assert torch.equal(opt.generate(IDS, max_new_tokens=8), _eager_greedy(opt, IDS, 8))


def test_artifacts_and_pass_specs_round_trip(tmp_path):
    opt = rewriter.optimize(_trace(), passes=[from_spec('share_kv:sources={"2": 0}')])
    assert from_spec(to_spec(ShareKV(sources={2: 0}))).sources == {2: 0}
    assert from_spec("share_kv:every=2").pairs([0, 1, 2]) == {1: 0}
    back = saved_and_loaded(opt, tmp_path / "a", IDS)
    assert sources(back.ir.graph) == {2: 0}


def test_each_reader_reads_its_owners_cache_again():
    """Sharing saves memory, not reads: a decode step's KV reads are the model's."""
    plain = rewriter.optimize(_trace())
    opt = rewriter.optimize(_trace(), passes=[ShareKV(every=2)])
    assert opt.kv_read_bytes(100) == plain.kv_read_bytes(100) > 0
    assert opt.kv_bytes_per_token() * 3 == plain.kv_bytes_per_token() * 2


def test_the_similarity_of_a_layer_with_itself_and_with_its_owner_is_one():
    """``kv_similarity`` over a shared model: a reader's keys and values are its owner's
    (1 off the diagonal there), every layer is itself (1 on it), the other pairs less."""
    from rewriter.measure.kv_similarity import distance, layer_kv, similarity
    opt = rewriter.optimize(_trace(), passes=[ShareKV(sources={2: 0})])
    kv = layer_kv(opt.ir, IDS)
    assert sorted(kv) == [0, 1, 2] and kv[0][0].shape == (2, 8, 2, 16)
    keys, values = similarity(kv)
    assert torch.allclose(keys.diagonal(), torch.ones(3)) and torch.allclose(values[0, 2], torch.tensor(1.0))
    assert torch.allclose(keys, keys.T) and keys[0, 1] < 0.99 and values[1, 2] < 0.99
    far = distance(kv)
    assert far[0, 2] == 0 and far[0, 1] > 0 and torch.equal(far, far.T)
    with pytest.raises(ValueError, match=r"ids must be a \[B, T\] tensor"):
        layer_kv(opt.ir, torch.tensor([1, 2]))


@pytest.mark.parametrize("rule", ["kvsharer", "measured"])
def test_a_calibrated_search_keeps_pairs_while_the_hidden_states_stay_close(rule):
    """Each kept pair passed the threshold, the final cosine is the search's own, and a
    threshold of 1 keeps nothing a reader changes; the map found is the pass's."""
    prompts = [[5, 9, 14, 2, 7, 30, 11, 4, 8, 19, 3], [3, 3, 8, 1, 60, 12, 9, 2, 77, 5, 6]]
    p = ShareKV(calibrate=prompts, budget=2, threshold=0.0, rule=rule)
    opt = rewriter.optimize(_trace(), passes=[p])
    assert sources(opt.ir.graph) == p.sources and 1 <= len(p.sources) <= 2
    assert all(t["kept"] == (t["cosine"] >= 0.0) for t in p.report["tried"])
    assert all(owner < reader for reader, owner in p.sources.items())
    strict = ShareKV(calibrate=prompts, budget=2, threshold=1.0, rule=rule)
    rewriter.optimize(_trace(), passes=[strict])
    assert strict.sources == {} and all(not t["kept"] for t in strict.report["tried"])
    assert "calibrate=<2 prompts>" in repr(p)
    with pytest.raises(ValueError, match="come together"):
        ShareKV(calibrate=prompts)
    with pytest.raises(ValueError, match="rule must be one of"):
        ShareKV(calibrate=prompts, budget=1, rule="closest")


@pytest.mark.parametrize("fused", [False, True])
def test_the_triton_backend_gives_the_torch_tokens(fused):
    """Under the interpreter: the owner's kernel writes (rotating K in it with FuseRoPE),
    the reader's kernels read only."""
    pytest.importorskip("triton")
    passes = lambda: [*([FuseRoPE()] if fused else []), ShareKV(every=2)]  # noqa: E731
    torch_side = rewriter.optimize(_trace(), passes=passes())
    tri = rewriter.optimize(_trace(), passes=passes(), backend="triton")
    assert (_attention(tri.ir, 1).kwargs.get("cos") is not None) == fused
    assert torch.equal(tri.generate(IDS, max_new_tokens=5), torch_side.generate(IDS, max_new_tokens=5))
