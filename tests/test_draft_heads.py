"""Medusa draft heads: the tree machinery on constructed cases (layout, mask, positions,
acceptance, KV compaction), lossless greedy decoding on every family, ragged batches,
EOS inside an accepted path, the sampling distribution, draft vocabularies, artifacts,
the Triton backend, heads files and bad parameters."""
import functools

import pytest
import torch

import rewriter
from rewriter.drafts import heads as heads_file
from rewriter.errors import PassError
from rewriter.passes import MedusaHeads, SelfSpeculative, from_spec
from rewriter.runtime.attention import Step
from rewriter.runtime.kv_cache import KVCache, cache_table
from rewriter.decoding import check_record
from rewriter.drafts.tree import Tree, best_subtree, choose_tree, expected_tokens, make_tree

from conftest import (CONFIGS, assert_same_distribution, make_model, oracle_drafts, traced_model,
                      varied_init)

IDS = torch.tensor([[3, 17, 42, 5, 99, 8, 64], [1, 2, 3, 4, 5, 6, 7]])
RAGGED = [[3, 17, 42, 5, 99, 8, 64, 11, 12], [1, 2, 3], [50, 51, 52, 53, 54]]
KW = dict(max_new_tokens=24, eos_token_id=[])
DEEP = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]  # a fixed tree: the
# auto tree follows timings, and a busy machine may choose one too small to accept much
WIDE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def pair(config: str, tree=WIDE, **overrides):
    """(plain, medusa) optimized models of one seeded model; untrained heads (each guesses
    the LM head's token again), which random models' repetitive text often accepts."""
    _, traced = traced_model(config, initializer_range=varied_init(config), **overrides)
    return rewriter.optimize(traced), rewriter.optimize(traced, passes=[MedusaHeads(num_heads=3, tree=tree)])


@functools.cache
def default_traced():
    """The shipped model and tokenizer as ``from_pretrained("default")`` loads them, traced
    once per test process: pipelines with its shipped heads optimize copies of the trace
    (``generate`` reads the model's config only, not the checkpoint's chat settings)."""
    from rewriter.models.checkpoints import load_hf_model, load_tokenizer
    return rewriter.trace(load_hf_model("default"), tokenizer=load_tokenizer("default"))


def random_heads(model, path, k=3, scale=0.05, seed=0, counts=True):
    """A heads file for ``model`` with seeded random weights, accuracies and token counts."""
    lm = model.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(seed)
    v, h = lm.shape
    heads_file.Heads(torch.randn(k, h, h, generator=g) * scale, torch.zeros(k, h), v,
                     heads_file.probe_of(lm), [[0.5, 0.2, 0.1]] + [[0.3, 0.1]] * (k - 1),
                     {"seed": seed}, torch.randint(0, 50, (v,), generator=g) if counts else None
                     ).save(path)
    return path


# ---------------------------------------------------------------------------- tree
def test_tree_layout_of_a_known_tree():
    tree = make_tree([[0, 0], [1], [0], [0, 1], [0, 0, 0]], num_heads=3)
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    lay = tree.layout()
    assert lay["parent"].tolist() == [-1, 0, 0, 1, 1, 3]
    assert lay["depth"].tolist() == [0, 1, 1, 2, 2, 3]
    assert lay["head"].tolist() == [-1, 0, 0, 1, 1, 2]
    assert lay["rank"].tolist() == [-1, 0, 1, 0, 1, 0]
    expect = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                           [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(lay["ancestors"], expect)
    assert lay["children"] == [[1, 2], [3, 4], [], [5], [], []]
    assert lay["paths"] == [[], [1], [2], [1, 3], [1, 4], [1, 3, 5]]
    assert tree.prefix(3).paths == ((0,), (1,))


@pytest.mark.parametrize("paths, match", [
    ([[0, 0]], "no parent"), ([[0], [0]], "twice"), ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], "deeper"),
    ([], "non-empty"), ([[10]], "ranks"), ([[-1]], "ranks"), ("0", "non-empty"), ([[True]], "ranks")])
def test_malformed_trees_are_refused(paths, match):
    with pytest.raises(ValueError, match=match):
        make_tree(paths, num_heads=3)


def test_tree_mask_sees_prefix_ancestors_and_self_at_each_rows_start():
    table = {0: cache_table_entry()}
    cache = KVCache(table, 2, 16, torch.float32, torch.device("cpu"))
    lay = make_tree([[0], [1], [0, 0]], 2).layout()
    step = Step(cache, 3, 4, None, tree=lay["ancestors"], depth=lay["depth"])
    m = step.mask(None)[0, 0]  # [4, 7]
    assert m[:, :3].all() and torch.equal(m[:, 3:], lay["ancestors"])
    ragged = Step(cache, torch.tensor([3, 5]), 4, None, end=9, tree=lay["ancestors"], depth=lay["depth"])
    r = ragged.mask(None)
    assert torch.equal(r[0, 0, :, :7], m) and not r[0, 0, :, 7:].any()
    assert r[1, 0, :, :5].all() and torch.equal(r[1, 0, :, 5:9], lay["ancestors"])
    windowed = Step(cache, 3, 4, None, tree=lay["ancestors"], depth=lay["depth"]).mask(3)[0, 0]
    # node 3 (depth 2, position 5) sees positions 3..5: its ancestors only, no prefix
    assert windowed[3].tolist() == [False, False, False, True, True, False, True]


def cache_table_entry():
    from rewriter.runtime.kv_cache import CacheSpec
    return CacheSpec(id=0, num_heads=2, num_kv_heads=1, head_dim=4, scale=0.5, causal=True, window=None)


@pytest.mark.parametrize("config", ["llama-gqa-3l", "gpt2-3l"])
def test_verifying_a_tree_gives_each_nodes_logits_as_if_its_path_ran_alone(config):
    plain, med = pair(config)
    programs = med._lowered()
    lay = make_tree(WIDE, 3).layout()
    n = len(WIDE) + 1
    prefix = torch.tensor([[3, 17, 42, 5, 99]])
    nodes = torch.tensor([[7, 11, 12, 13, 14, 20, 21, 22, 30]])  # root + 8 nodes
    cache = KVCache(cache_table(med.ir.gm), 1, 32, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        programs["prefill"](Step(cache, 0, 5, None), prefix, torch.arange(5)[None])
        logits, h = programs["verify"](Step(cache, 5, n, None, tree=lay["ancestors"], depth=lay["depth"]),
                                       nodes, 5 + lay["depth"][None])
    for i in range(n):
        path = [i]
        while lay["parent"][path[0]] >= 0:
            path.insert(0, int(lay["parent"][path[0]]))
        seq = torch.cat([prefix, nodes[:, path]], dim=1)
        ref = plain(seq)[0, -1]
        assert torch.allclose(logits[0, i], ref, atol=1e-4), i


def test_greedy_acceptance_on_hand_made_logits():
    from rewriter.runtime.settings import GenerationSettings
    from rewriter.runtime.decoding.tree.rounds import TreeRounds
    r = TreeRounds.__new__(TreeRounds)
    r.s, r.device = GenerationSettings(), torch.device("cpu")
    r.strategy = rewriter.decoding.TreeDecoding("medusa", depth=2, tree=((0,), (1,), (1, 0)))
    r.tree, r.layouts = make_tree([[0], [1], [1, 0]], 2), {}
    r.verified, r.to_head, r.chain, r.adapt = r.tree, None, None, None
    lay = r.layout(4)
    v = 10
    tokens = torch.tensor([[5, 1, 2, 3]] * 4)  # root, n1, n2, n3 (child of n2)
    # the model's argmax after each node; the last row would accept n3 (3 after n2) but
    # not n2 itself (9, not 2, after the root), so it accepts nothing
    wants = [[2, 0, 3, 9], [1, 4, 0, 0], [7, 0, 0, 0], [9, 0, 3, 0]]
    logits = torch.full((4, 4, v), -5.0)
    for b, w in enumerate(wants):
        for i, t in enumerate(w):
            logits[b, i, t] = 5.0
    paths, bonus = r.accept(logits, tokens, lay)
    assert paths == [[2, 3], [1], [], []] and bonus == [9, 4, 7, 9]


def test_compaction_moves_the_accepted_rows_only():
    from rewriter.runtime.decoding.tree.rounds import TreeRounds
    cache = KVCache({0: cache_table_entry()}, 2, 16, torch.float32, torch.device("cpu"))
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.arange(16.0)[None, None, :, None].expand_as(t))  # slot j holds j
    r = TreeRounds.__new__(TreeRounds)
    r.cache, r.device, r.stats = cache, torch.device("cpu"), __import__("collections").Counter()
    r.compact([4, 2], [[2, 5], [1]])  # row 0: nodes 2, 5 -> slots 5, 6; row 1: in place
    assert cache.k[0][0, 0, :, 0].tolist()[:10] == [0, 1, 2, 3, 4, 6, 9, 7, 8, 9]
    assert cache.v[0][1, 0, :, 0].tolist()[:10] == [float(j) for j in range(10)]
    assert r.stats["kv_moves"] == 2


def test_compaction_moves_every_cache_of_every_shape_and_nothing_else():
    """Caches of one shape share a block and move in one copy; a cache of another shape
    (more KV heads here) moves too; K and V alike, and no other slot or row changes."""
    from dataclasses import replace

    from rewriter.runtime.decoding.tree.rounds import TreeRounds
    spec = cache_table_entry()
    table = {0: spec, 1: replace(spec, id=1), 2: replace(spec, id=2, num_heads=4, num_kv_heads=2)}
    cache = KVCache(table, 2, 12, torch.float32, torch.device("cpu"))
    assert len(cache.blocks) == 2 and cache.k[0].data_ptr() != cache.k[1].data_ptr()
    for key, t in [*cache.k.items(), *cache.v.items()]:
        t.copy_(torch.randn(t.shape))
    before = {k: (cache.k[k].clone(), cache.v[k].clone()) for k in table}
    r = TreeRounds.__new__(TreeRounds)
    r.cache, r.device, r.stats = cache, torch.device("cpu"), __import__("collections").Counter()
    r.compact([3, 5], [[1, 4], [2]])  # row 0: node 4 -> slot 5; row 1: node 2 -> slot 6
    for key in table:
        for got, old in zip((cache.k[key], cache.v[key]), before[key]):
            want = old.clone()
            want[0, :, 5] = old[0, :, 7]  # slot 3 + 4
            want[1, :, 6] = old[1, :, 7]  # slot 5 + 2
            assert torch.equal(got, want), key


def test_choose_tree_weighs_accuracy_against_verify_cost():
    acc = [[0.6, 0.15, 0.05], [0.4, 0.1], [0.3]]
    cheap = [0] + [1.0] * 40
    tree, info = choose_tree(acc, cheap, max_nodes=20)
    assert tree.paths[0] == (0,) and (0, 0) in tree.paths and (0, 0, 0) in tree.paths
    assert info["expected_tokens"] == pytest.approx(expected_tokens(tree, acc), abs=1e-4)
    dear = [0] + [1.0 + 0.5 * s for s in range(40)]  # every token costs half a step
    small, _ = choose_tree(acc, dear, max_nodes=20)
    assert small.size < tree.size
    assert expected_tokens(Tree(((0,), (0, 0))), acc) == pytest.approx(1 + 0.6 + 0.24)
    # the heads' own calls: one a round (Medusa) or one a level (Hydra)
    _, once = choose_tree(acc, cheap, max_nodes=20, head_cost=0.5)
    assert once["predicted_speedup"] == pytest.approx(info["expected_tokens"] / 1.5, abs=1e-3)
    shallow, levels = choose_tree(acc, cheap, max_nodes=20, head_cost=0.5, per_level=True)
    assert shallow.depth < tree.depth
    assert levels["predicted_speedup"] == pytest.approx(
        levels["expected_tokens"] / (1 + 0.5 * shallow.depth), abs=1e-3)


# ---------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_tokens_equal_plain_greedy_on_every_family(config):
    plain, med = pair(config)
    assert torch.equal(med.generate(IDS, **KW), plain.generate(IDS, **KW))
    s = med.stats
    assert 0 < s["accepted"] < s["drafted"] and s["forward_passes"] < s["tokens"] * 2


@pytest.mark.parametrize("config", ["llama-gqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_ragged_batches_equal_each_row_alone(config):
    plain, med = pair(config)
    together = med.generate(RAGGED, **KW)
    for i, row in enumerate(RAGGED):
        alone = plain.generate([row], **KW)[0, len(row):]
        assert torch.equal(together[i, -KW["max_new_tokens"]:], alone), i
    assert med.stats["accepted"] > 0


def test_eos_inside_an_accepted_path_ends_the_row_as_plain_decoding_does():
    plain, med = pair("llama-gqa-3l")
    free = plain.generate(IDS, **KW)
    for at in (3, 6, 9):
        eos = int(free[0, IDS.shape[1] + at])
        kw = dict(max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(med.generate(IDS, **kw), plain.generate(IDS, **kw)), at
        streamed = torch.stack(list(med.stream(IDS, **kw)), dim=1)
        assert torch.equal(streamed, plain.generate(IDS, **kw)[:, IDS.shape[1]:])


def test_trees_that_reach_the_end_of_the_cache_are_cut_short():
    plain, med = pair("llama-gqa-3l")  # context: 128 positions
    ids = torch.stack([torch.arange(1, 101) % 120, torch.arange(100, 0, -1) % 97])
    kw = dict(max_new_tokens=28, eos_token_id=[])
    assert torch.equal(med.generate(ids, **kw), plain.generate(ids, **kw))


def test_sampling_follows_the_models_distribution():
    """Two-sample chi-square on the second and third sampled tokens, 3000 rows each way."""
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    plain = rewriter.optimize(traced)
    med = rewriter.optimize(traced, passes=[MedusaHeads(num_heads=2, tree=[[0], [1], [2], [0, 0]])])
    ids = torch.tensor([[5, 9, 2]]).expand(3000, 3)
    kw = dict(max_new_tokens=3, do_sample=True, top_k=0, eos_token_id=[])
    a = plain.generate(ids, seed=1, **kw)
    b = med.generate(ids, seed=2, **kw)
    assert med.stats["accepted"] > 0
    assert_same_distribution(a, b, (4, 5), 48)


def test_tree_sampling_rule_alone_is_unbiased():
    """The walk on synthetic logits: whatever the (fixed) candidates, each emitted token is
    distributed as the model's p."""
    from rewriter.runtime.settings import GenerationSettings
    from rewriter.runtime.decoding.tree.rounds import TreeRounds
    torch.manual_seed(0)
    v, b = 5, 6000
    r = TreeRounds.__new__(TreeRounds)
    r.s = GenerationSettings(do_sample=True, top_k=0)
    r.generator, r.device = torch.Generator().manual_seed(0), torch.device("cpu")
    r.strategy = rewriter.decoding.TreeDecoding("medusa", depth=1, tree=((0,), (1,)))
    lay = make_tree([[0], [1]], 1).layout()
    p_logits = torch.randn(v)
    logits = p_logits.expand(b, 3, v).clone()
    tokens = torch.tensor([0, 1, 2]).expand(b, 3)  # candidates: tokens 1 then 2
    paths, bonus = r.accept(logits, tokens, lay)
    first = torch.tensor([int(tokens[0, p[0]]) if p else x for p, x in zip(paths, bonus)])
    p = torch.softmax(p_logits, -1)
    freq = torch.bincount(first, minlength=v).float() / b
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / b).sqrt() + 1e-3).all(), (freq, p)


def test_typical_acceptance_on_hand_made_logits_accepts_what_greedy_would_not():
    """p = [.5, .3, .15, .05]: entropy 1.14 nats, so the bar is min(0.09, 0.3 e^-1.14) =
    0.09: token 2 (p .15, not the argmax) passes, token 3 (p .05) does not."""
    from rewriter.runtime.settings import GenerationSettings
    from rewriter.runtime.decoding.tree.rounds import TreeRounds
    r = TreeRounds.__new__(TreeRounds)
    r.s, r.generator, r.device = GenerationSettings(), None, torch.device("cpu")
    r.strategy = rewriter.decoding.TreeDecoding("medusa", depth=1, tree=((0,), (1,)),
                                            acceptance="typical")
    r.tree, r.layouts = make_tree([[0], [1]], 1), {}
    r.verified, r.to_head, r.chain, r.adapt = r.tree, None, None, None
    lay = r.layout(3)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    after = torch.tensor([0.0, 0.0, 0.0, 9.0])  # after the accepted child: token 3
    logits = torch.stack([p.log(), after, after])[None]  # [1, 3 nodes, 4]
    for children, path, bonus in (([3, 2], [2], 3), ([3, 1], [2], 3), ([3, 3], [], 0)):
        tokens = torch.tensor([[0, *children]])
        assert r.accept(logits, tokens, lay) == ([path], [bonus]), children
    greedy = rewriter.decoding.TreeDecoding("medusa", depth=1, tree=((0,), (1,)))
    r.strategy = greedy
    assert r.accept(logits, torch.tensor([[0, 3, 2]]), lay) == ([[]], [0])  # greedy: neither


# ---------------------------------------------------------------------------- heads, files, artifacts
def test_trained_heads_files_draft_vocabularies_and_artifact_round_trip(tmp_path):
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_heads(model, tmp_path / "h.safetensors")
    plain = rewriter.optimize(traced)
    med = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), draft_vocab=32, tree=WIDE)])
    vocab = med.ir.weight("medusa.vocab")
    assert vocab.shape == (32,) and "index_select" in str(med.ir)
    _, draft = med.ir.gm(IDS, torch.arange(7).expand(2, 7))
    assert draft.shape == (2, 7, 3, 32)
    assert torch.equal(med.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    med.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.info["decoding"] == med.ir.info["decoding"]
    assert set(loaded.programs()) == {"prefill", "decode", "tree_prefill", "verify", "heads"}
    assert torch.equal(loaded.ir.weight("medusa.vocab"), vocab)
    assert torch.equal(loaded.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    assert torch.equal(loaded(IDS), plain(IDS))  # calling the model still gives its logits


def test_the_ir_and_its_dumps_show_the_heads_and_their_programs(tmp_path):
    """The heads print as ops of their pass, the pass's dump and diff list them, and the
    dump's programs include the ones the tree rounds run."""
    med = rewriter.optimize(traced_model("llama-gqa-3l")[1],
                            passes=[MedusaHeads(num_heads=2, tree=[[0], [0, 0]])])
    heads = [ln for ln in str(med.ir).splitlines() if ln.strip().startswith("%medusa_")]
    assert any("rw.silu" in ln for ln in heads) and all("# draft_head [MedusaHeads]" in ln for ln in heads)
    assert "return [%linear_21, %medusa_logits]" in str(med.ir)  # the heads' logits beside the model's
    med.dump(tmp_path)
    text = (tmp_path / "01_MedusaHeads.txt").read_text()
    assert "medusa_0_silu" in text and "medusa_1_silu" in text and "medusa_logits" in text
    assert "medusa_" not in (tmp_path / "00_lift.txt").read_text()
    assert "rw.silu: +2" in (tmp_path / "01_MedusaHeads.diff.txt").read_text()
    assert {"verify.py", "heads.py"} <= {p.name for p in (tmp_path / "programs").iterdir()}


def test_auto_tree_comes_from_accuracies_and_measured_cost(tmp_path):
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_heads(model, tmp_path / "h.safetensors")
    p = MedusaHeads(weights=str(path), max_nodes=6)
    med = rewriter.optimize(traced, passes=[p])
    assert 1 <= len(med.ir.info["decoding"]["tree"]) <= 6
    assert p.report["expected_tokens"] > 1 and p.lookup == 4  # the default beside the auto tree
    assert len(p.report["verify_cost"]) == 7 + 4  # a round of the largest tree and a chain
    assert med.ir.info["decoding"]["lookup"] == 4
    assert MedusaHeads(weights=str(path), tree=[[0]]).lookup == 0  # no costs to choose by
    assert MedusaHeads(weights=str(path), adapt=False).lookup == 0
    # and how many of its first nodes a round verifies at 2, 4 and 8 rows
    record = med.ir.info["decoding"]
    assert check_record(record) is None
    if p.report["predicted_speedup"] < 1:  # this machine: no tree pays, every batch is plain
        assert record["batch_trees"] == [[1, []]] and not p.report["batches"]
    else:
        assert [b for b, _ in record["batch_trees"]] == [2, 4, 8]
        assert set(p.report["batches"]) == {"2", "4", "8"}


def test_hostile_heads_files_get_named_errors(tmp_path):
    model = make_model("llama-gqa-3l")
    good = random_heads(model, tmp_path / "good.safetensors")
    (tmp_path / "trunc.safetensors").write_bytes(good.read_bytes()[:200])
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    from safetensors.torch import save_file
    save_file({"w": torch.full((1, 64, 64), float("nan")), "b": torch.zeros(1, 64)},
              str(tmp_path / "nan.safetensors"), metadata={"format": heads_file.FORMAT, "version": "1",
                                                          "vocab": "128", "probe": "[]"})
    save_file({"w": torch.zeros(1, 64, 64), "b": torch.zeros(1, 64)}, str(tmp_path / "fmt.safetensors"))
    for name, match in (("trunc", "not a safetensors"), ("junk", "not a safetensors"),
                        ("nan", "NaN"), ("fmt", "not a rewriter-medusa-heads"), ("none", "no such")):
        with pytest.raises(ValueError, match=match):
            MedusaHeads(weights=str(tmp_path / f"{name}.safetensors"))
    other = make_model("llama-gqa-3l", seed=1)
    with pytest.raises(PassError, match="another model"):
        rewriter.optimize(other, passes=[MedusaHeads(weights=str(good))])
    wider = make_model("llama-gqa-3l", hidden_size=96)
    with pytest.raises(PassError, match="hidden size"):
        rewriter.optimize(wider, passes=[MedusaHeads(weights=str(good))])


def test_bad_parameters_and_conflicts_are_refused(tmp_path):
    for kwargs, match in (({}, "weights=PATH"), ({"num_heads": 0}, "num_heads"),
                          ({"num_heads": 9}, "num_heads"), ({"num_heads": 2, "tree": [[0, 0, 0]]}, "deeper"),
                          ({"num_heads": 2, "draft_vocab": 100}, "draft_vocab"),
                          ({"num_heads": 2, "max_nodes": 0}, "max_nodes"),
                          ({"num_heads": 2, "acceptance": "loose"}, "acceptance"),
                          ({"num_heads": 2, "posterior_alpha": float("nan")}, "posterior_alpha")):
        with pytest.raises(ValueError, match=match):
            MedusaHeads(**kwargs)
    _, traced = traced_model("llama-gqa-3l")
    with pytest.raises(PassError, match="already has a decoding strategy"):
        rewriter.optimize(traced, passes=[SelfSpeculative(skip_layers=[1]), MedusaHeads(num_heads=2)])
    with pytest.raises(PassError, match="already has a decoding strategy"):
        rewriter.optimize(traced, passes=[MedusaHeads(num_heads=2), SelfSpeculative(skip_layers=[1])])
    assert isinstance(from_spec("medusa_heads:num_heads=2,tree=[[0],[0,0]]"), MedusaHeads)


def test_the_triton_backend_gives_the_same_tokens():
    _, traced = traced_model("llama-gqa-3l", initializer_range=0.2, num_hidden_layers=2)
    plain = rewriter.optimize(traced)
    med = rewriter.optimize(traced, passes=[MedusaHeads(num_heads=2, tree=[[0], [1], [0, 0]])],
                            backend="triton")
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert torch.equal(med.generate(RAGGED[:2], **kw), plain.generate(RAGGED[:2], **kw))
    assert torch.equal(med.generate(RAGGED[:1], **kw), plain.generate(RAGGED[:1], **kw))  # the kernel


def test_the_default_model_with_its_shipped_heads_is_lossless_and_accepts():
    plain = rewriter.optimize(default_traced())
    med = rewriter.optimize(default_traced(), passes=[MedusaHeads(weights="default", tree=DEEP)])
    ids = [plain.tokenizer.encode("def main(").ids, plain.tokenizer.encode("import os\n").ids]
    assert torch.equal(med.generate(ids, max_new_tokens=48), plain.generate(ids, max_new_tokens=48))
    s = med.stats
    assert s["accepted"] / s["row_rounds"] > 1.0  # more than one drafted token a round


def test_triton_prefill_kernel_takes_the_tree_as_ancestor_bit_sets():
    """The kernel under the interpreter against the torch attention, one tree step after a
    5-token prefix, rows with and without padding."""
    from rewriter.codegen.prefill_attention import tree_bits
    from rewriter.runtime import triton_attention
    from rewriter.runtime.attention import cached_attention
    from rewriter.runtime.kv_cache import CacheSpec
    torch.manual_seed(0)
    spec = CacheSpec(id=0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, causal=True, window=None)
    lay = make_tree(WIDE, 3).layout()
    assert tree_bits(lay["ancestors"]).tolist()[:4] == [1, 3, 5, 9]
    n = len(WIDE) + 1
    caches = [KVCache({0: spec}, 2, 32, torch.float32, torch.device("cpu")) for _ in range(2)]
    prefix = torch.randn(2, 2, 5, 16)
    for c in caches:
        c.k[0][:, :, :5], c.v[0][:, :, :5] = prefix, -prefix
    q, k, v = torch.randn(2, n, 64), torch.randn(2, n, 32), torch.randn(2, n, 32)
    pad = torch.tensor([0, 2])
    outs = [fn(Step(c, 5, n, pad, tree=lay["ancestors"], depth=lay["depth"]), q, k, v, spec)
            for fn, c in ((cached_attention, caches[0]), (triton_attention.cached_attention, caches[1]))]
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("tree", [0, 1, 3])  # 0: a tree; else a chain of as many tokens
@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("window", [None, 4])
def test_triton_kernels_take_each_rows_own_start(tree, rope, window, monkeypatch):
    """A step whose rows start at their own cache positions (a ``[B]`` device tensor, as
    after ragged acceptance and in every static round) runs the prefill kernel, and
    ``rope_into_cache`` with ``FuseRoPE``, under the interpreter: the same output and the
    same cache as the torch attention, rows padded and not, trees and chains, a window."""
    from rewriter.runtime import triton_attention
    from rewriter.runtime.attention import cached_attention
    from rewriter.runtime.kv_cache import CacheSpec
    chain, tree = tree, tree == 0
    if tree and window:
        pytest.skip("a tree under a window runs the torch path")
    torch.manual_seed(1)
    spec = CacheSpec(id=0, num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, causal=True, window=window)
    lay = make_tree(WIDE, 3).layout()
    n = len(WIDE) + 1 if tree else chain
    caches = [KVCache({0: spec}, 3, 40, torch.float32, torch.device("cpu")) for _ in range(2)]
    prefix = torch.randn(3, 2, 40, 16)
    for c in caches:  # garbage past each row's start: masked, then overwritten
        c.k[0][:], c.v[0][:] = prefix, -prefix
    q, k, v = torch.randn(3, n, 64), torch.randn(3, n, 32), torch.randn(3, n, 32)
    cos, sin = (torch.randn(3, n, 16), torch.randn(3, n, 16)) if rope else (None, None)
    start, pad = torch.tensor([9, 5, 14]), torch.tensor([0, 2, 0])
    kw = dict(tree=lay["ancestors"], depth=lay["depth"]) if tree else {}
    calls = []
    monkeypatch.setattr(triton_attention, "torch_cached_attention",
                        lambda *a, **k: calls.append(1) or cached_attention(*a, **k))
    outs = [fn(Step(c, start, n, pad, end=14 + n, **kw), q, k, v, spec, cos, sin)
            for fn, c in ((cached_attention, caches[0]), (triton_attention.cached_attention, caches[1]))]
    assert calls == []  # the kernels ran, not the torch path
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for a, b in ((caches[0].k[0], caches[1].k[0]), (caches[0].v[0], caches[1].v[0])):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.equal(caches[1].k[0], prefix)  # each row's tokens were written


# ---------------------------------------------------------------------------- oracle drafts
@pytest.mark.parametrize("config", ["llama-gqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_right_drafts_are_accepted_whole_and_the_output_stays_plain_greedys(config, monkeypatch):
    """With drafts that are right (an oracle in place of the heads), every round accepts a
    whole chain: deep paths, moved K/V rows and ragged rows, still plain greedy's tokens."""
    plain, med = pair(config)
    ref = plain.generate(RAGGED, **KW)
    seen = oracle_drafts(monkeypatch, ref[:, -24:].tolist(), 128)
    assert torch.equal(med.generate(RAGGED, **KW), ref)
    s = med.stats
    assert s["accepted"] / s["row_rounds"] > 2 and s["kv_moves"] > 0  # depth-3 chains
    assert max(len(t) for rnd in seen["accepted"] for t in rnd) == 3


def test_eos_inside_an_accepted_draft_ends_the_row_as_plain_decoding_does(monkeypatch):
    plain, med = pair("llama-gqa-3l")
    free = plain.generate(IDS, **KW)[:, IDS.shape[1]:]
    seen = oracle_drafts(monkeypatch, free.tolist(), 128)
    for at in (3, 5, 10):
        eos = int(free[0, at])
        kw = dict(max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
        seen["accepted"].clear()
        assert torch.equal(med.generate(IDS, **kw), plain.generate(IDS, **kw)), at
        assert any(eos in t for rnd in seen["accepted"] for t in rnd), at  # drafted, accepted


def test_right_drafts_reaching_the_end_of_the_cache_are_cut_short(monkeypatch):
    plain, med = pair("llama-gqa-3l")  # context: 128 positions
    ids = torch.stack([torch.arange(1, 101) % 120, torch.arange(100, 0, -1) % 97])
    kw = dict(max_new_tokens=28, eos_token_id=[])
    ref = plain.generate(ids, **kw)
    oracle_drafts(monkeypatch, ref[:, 100:].tolist(), 128)
    assert torch.equal(med.generate(ids, **kw), ref)
    assert med.stats["accepted"] / med.stats["row_rounds"] > 2


def test_records_that_disagree_with_the_graphs_draft_vocabulary_are_refused(tmp_path):
    from rewriter.errors import RewriterError
    from rewriter.runtime.decoding import strategy_for
    from rewriter.runtime.programs import build_programs
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_heads(model, tmp_path / "h.safetensors")
    big = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), draft_vocab=500, tree=WIDE)])
    assert big.ir.info["decoding"]["draft_vocab"] == 128  # the whole vocabulary: recorded as such
    big.ir.info["decoding"]["draft_vocab"] = None  # the graph still trims through medusa.vocab
    with pytest.raises(RewriterError, match="come together"):
        build_programs(big.ir, "torch", {}, strategy_for(big.ir))
    big.ir.info["decoding"]["draft_vocab"] = 128
    big.ir.weight("medusa.vocab")[0] = 999  # an id outside the vocabulary
    with pytest.raises(RewriterError, match="distinct int64 token ids"):
        build_programs(big.ir, "torch", {}, strategy_for(big.ir))


# ---------------------------------------------------------------------------- larger batches
def test_best_subtree_keeps_the_likeliest_nodes_as_verifying_gets_dearer():
    acc = [[0.6, 0.15, 0.05], [0.4, 0.1], [0.3]]
    tree, _ = choose_tree(acc, [0] + [1.0] * 40, max_nodes=8)
    n = tree.size - 1
    likeliest = sorted(tree.paths, key=lambda p: -expected_tokens(Tree((p,)), acc))

    def brute(cost, head_cost=0.0, per_level=False):  # every m likeliest; 0: plain, rate 1
        def rate(m):
            sub = Tree(tuple(likeliest[:m]))
            return expected_tokens(sub, acc) / (cost[m + 1] + head_cost * (sub.depth if per_level else 1))
        return max(range(n + 1), key=lambda m: (rate(m) if m else 1.0, -m))
    cheap = [0] + [1.0] * 40
    assert best_subtree(tree, acc, cheap) == (tree, pytest.approx(expected_tokens(tree, acc), abs=1e-3))
    dear = [0] + [1.0 + 0.1 * s for s in range(40)]
    sub, rate = best_subtree(tree, acc, dear)
    assert 0 < sub.size - 1 < n and sub.size - 1 == brute(dear) and rate > 1
    assert set(sub.paths) == set(likeliest[:sub.size - 1])  # not the first nodes: (0, 0) before (2,)
    assert (0, 0) in sub.paths and sub == make_tree(list(sub.paths), 3)  # a tree, in its order
    assert best_subtree(tree, acc, [0] + [1.0 + 2.0 * s for s in range(40)]) == (Tree(()), 1.0)
    assert best_subtree(tree, acc, cheap, head_cost=2.0)[0] == Tree(())  # heads cost too much
    # Hydra pays its head cost once per level: deep sub-trees cost more
    flat = [0] + [1.0 + 0.05 * s for s in range(40)]
    once, levels = best_subtree(tree, acc, flat, 0.3), best_subtree(tree, acc, flat, 0.3, True)
    assert levels[0].size - 1 == brute(flat, 0.3, True) and once[0].size - 1 == brute(flat, 0.3)
    assert levels[0].depth < once[0].depth


def _check_batch_trees(med, plain, levels_of_whole: int):
    """``batch_trees`` gives a batch of 2 (IDS) a sub-tree, or plain decoding, and leaves one
    row's tree whole; tokens stay plain greedy's."""
    record = med.ir.info["decoding"]
    for sub in ([[0], [0, 0]], []):
        record["batch_trees"] = [[2, sub]]
        assert check_record(record) is None
        med.stats.clear()
        assert torch.equal(med.generate(IDS, **KW), plain.generate(IDS, **KW)), sub
        s = med.stats
        assert s["drafted"] <= len(sub) * s["row_rounds"] and (s["drafted"] > 0) == bool(sub)
        if sub:  # one head call a round (Medusa) or one a level (Hydra: 2 levels here)
            assert 0 < s["head_passes"] <= (s["rounds"] + 1) * (2 if levels_of_whole > 1 else 1)
        else:  # plain decoding: one forward a token, no head
            assert s["head_passes"] == 0 and s["forward_passes"] == KW["max_new_tokens"]
    med.stats.clear()
    assert torch.equal(med.generate(IDS[:1], **KW), plain.generate(IDS[:1], **KW))
    s = med.stats  # the whole tree (rounds near the last token draft fewer): more than 2
    assert 2 * s["rounds"] < s["drafted"] <= len(WIDE) * s["rounds"]
    assert s["head_passes"] > (s["rounds"] + 1) * (2 if levels_of_whole > 1 else 0)


def test_batch_trees_give_larger_batches_a_sub_tree_and_stay_lossless(tmp_path):
    plain, med = pair("llama-gqa-3l")
    _check_batch_trees(med, plain, 1)
    med.ir.info["decoding"]["batch_trees"] = [[2, [[0], [1], [0, 0]]], [4, []]]
    med.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.info["decoding"]["batch_trees"] == [[2, [[0], [1], [0, 0]]], [4, []]]
    four = torch.cat([IDS, IDS.flip(1)])
    assert torch.equal(loaded.generate(four, **KW), plain.generate(four, **KW))
    assert loaded.stats["head_passes"] == 0


def test_hydra_batch_trees_draft_only_their_levels(tmp_path):
    from rewriter.passes import HydraHeads
    from test_hydra_heads import hydra_heads
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = hydra_heads(model, tmp_path / "h.safetensors")
    plain = rewriter.optimize(traced)
    hyd = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=WIDE)])
    _check_batch_trees(hyd, plain, 3)


@pytest.mark.parametrize("bad", [[[0, [[0]]]], [[4, [[5]]]], [[4, [[0]]], [2, []]], [[2, [[0, 0]]]],
                                 [[2, [[1], [0]]]], [[2]], "x", [[True, []]], [[2, "x"]]])
def test_bad_batch_trees_are_refused(bad):
    from rewriter.decoding import TreeDecoding
    record = TreeDecoding("medusa", depth=3, tree=tuple(map(tuple, WIDE))).record()
    assert check_record({**record, "batch_trees": [[2, [[0], [0, 0]]], [4, []]]}) is None
    assert "batch_trees" in check_record({**record, "batch_trees": bad})


def test_auto_tree_gives_larger_batches_the_sub_trees_their_costs_pay_for(tmp_path, monkeypatch):
    """Wiring: costs measured at each batch choose that batch's sub-tree (here: batch 1 and
    2 verify cheaply, 4 dearly, 8 so dearly that nothing pays)."""
    from conftest import measured_costs
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_heads(model, tmp_path / "h.safetensors")
    slope = {1: 0.0, 2: 0.0, 4: 0.3, 8: 5.0}
    measured_costs(monkeypatch, slope)  # the programs' costs alone, as set here
    med = rewriter.optimize(traced, passes=[MedusaHeads(weights=str(path), max_nodes=6)])
    record = med.ir.info["decoding"]
    trees = dict((b, sub) for b, sub in record["batch_trees"])
    assert len(record["tree"]) == 6 and trees[2] == record["tree"]
    assert 0 < len(trees[4]) < 6 and trees[8] == []
    # where even one row's tree costs more than it saves, every batch decodes plainly
    slope[1] = 5.0
    measured_costs(monkeypatch, slope, heads=0.5)
    p = MedusaHeads(weights=str(path), max_nodes=6)
    med = rewriter.optimize(traced, passes=[p])
    assert p.report["predicted_speedup"] < 1
    assert med.ir.info["decoding"]["batch_trees"] == [[1, []]]
    plain = rewriter.optimize(traced)
    assert torch.equal(med.generate(IDS[:1], **KW), plain.generate(IDS[:1], **KW))
    assert med.stats["head_passes"] == 0 and med.stats["forward_passes"] == KW["max_new_tokens"]
