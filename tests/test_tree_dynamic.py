"""Trees re-grown every round (runtime.decoding.tree.dynamic): the grown tree against a brute-force
search on hand-made heads, one shape for a batch, ties, small budgets, and decoding with
it (lossless, ragged batches, sampling, artifacts, the record's checks)."""
import itertools
import math

import pytest
import torch

import rewriter
from rewriter.decoding import check_record
from rewriter.passes import HydraHeads, MedusaHeads, from_spec
from rewriter.runtime.decoding.tree.dynamic import grow

from conftest import assert_same_distribution, traced_model
from test_draft_heads import random_heads
from test_hydra_heads import IDS, KW, RAGGED, WIDE, model_and_file, sampled

V, R, DEPTH = 50, 3, 3


def fake_heads(rows: int, seed: int = 0):
    """A Hydra-like call whose guesses depend on the whole path: each path's child
    distribution is seeded by the path's tokens. Returns (call, probabilities of a path's
    children by rank per row, their tokens)."""
    def dist(row: int, tokens: tuple):
        g = torch.Generator().manual_seed(hash((seed, row, tokens)) % (2 ** 31))
        p = torch.rand(V, generator=g) ** 4  # peaked: some paths sure, some not
        p = p / p.sum()
        top = p.topk(R)
        return top.values, top.indices

    def call(d: int, chains: torch.Tensor):
        b, n, _ = chains.shape
        logp = torch.empty(b, n, R)
        ids = torch.empty(b, n, R, dtype=torch.int64)
        for r in range(b):
            for i in range(n):
                v, ix = dist(r, tuple(chains[r, i].tolist()))
                logp[r, i], ids[r, i] = v.log(), ix
        return logp, ids
    return call, dist


def brute(dist, roots: list[int], nodes: int):
    """Every rank path up to DEPTH scored by its probability summed over the rows; the best
    nodes - 1 (ancestors first on ties), and each row's token at each."""
    score, token = {}, {}
    for path in (p for d in range(1, DEPTH + 1) for p in itertools.product(range(R), repeat=d)):
        total, toks = 0.0, []
        for row, root in enumerate(roots):
            chain, prob = (root,), 1.0
            for r in path:
                v, ix = dist(row, chain)
                prob *= float(v[r])
                chain += (int(ix[r]),)
            total += prob
            toks.append(chain[-1])
        score[path], token[path] = total, toks
    best = sorted(score, key=lambda p: (-score[p], len(p), p))[:nodes - 1]
    return set(best), token


@pytest.mark.parametrize("nodes", [2, 5, 9, 16])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_grown_tree_is_the_best_nodes_of_all_paths(nodes, rows):
    """Expanding every node worth expanding, the tree is exactly the ``nodes - 1`` rank paths
    of highest probability summed over the rows, each row holding its own tokens."""
    call, dist = fake_heads(rows)
    roots = [7, 11, 13][:rows]
    tree, tokens, levels = grow(call, torch.tensor(roots), nodes, DEPTH, expand=R ** DEPTH)
    best, token = brute(dist, roots, nodes)
    assert set(tree.paths) == best and tree.size == nodes
    assert tree.paths == tuple(sorted(tree.paths, key=lambda p: (len(p), p)))  # laid out by depth
    assert tokens[:, 0].tolist() == roots
    for i, p in enumerate(tree.paths, start=1):
        assert tokens[:, i].tolist() == token[p], p
    assert len(levels) <= DEPTH and levels[0][0] == [()]


def test_rows_without_a_say_do_not_shape_the_tree():
    """A row weighted 0 (done) leaves the shape to the others: the batch's tree is the one
    the running row would grow alone."""
    call, _ = fake_heads(2)
    both = grow(call, torch.tensor([7, 11]), 9, DEPTH, 27, torch.tensor([1.0, 0.0]))[0]

    def first_row(d, chains):
        logp, ids = call(d, torch.cat([chains, chains]))  # row 0's distributions, twice
        return logp[:1], ids[:1]
    alone = grow(first_row, torch.tensor([7]), 9, DEPTH, 27)[0]
    assert both == alone and both != grow(call, torch.tensor([7, 11]), 9, DEPTH, 27)[0]


def test_a_narrow_expansion_calls_the_heads_on_few_paths():
    """``expand`` bounds each level's head call; the tree still fills its budget from
    the children of what was expanded."""
    call, _ = fake_heads(1)
    seen = []

    def counting(d, chains):
        seen.append(chains.shape[1])
        return call(d, chains)
    tree, _, _ = grow(counting, torch.tensor([7]), 8, DEPTH, expand=1)
    assert seen[0] == 1 and all(n <= 1 for n in seen) and tree.size == 8


def test_ties_keep_parents_before_children_and_small_budgets():
    """Heads that are certain (probability 1 on one token) tie a child with its parent: the
    parent comes first. A budget of one node is the root alone; one larger than the heads
    can offer is a smaller tree."""
    def sure(d, chains):
        b, n, _ = chains.shape
        logp = torch.full((b, n, 2), -math.inf)
        logp[..., 0] = 0.0
        return logp, chains[..., -1:].expand(b, n, 2) + torch.tensor([1, 2])
    tree, tokens, _ = grow(sure, torch.tensor([10]), 4, 4, expand=4)
    assert tree.paths == ((0,), (0, 0), (0, 0, 0))  # the sure chain, not the impossible siblings
    assert tokens[0].tolist() == [10, 11, 12, 13]
    assert grow(sure, torch.tensor([10]), 1, 4, 4)[0].size == 1
    assert grow(sure, torch.tensor([10]), 40, 2, 4)[0].size == 7  # 2 + 2 x 2 nodes exist


@pytest.mark.parametrize("cls", [HydraHeads, MedusaHeads])
def test_greedy_tokens_equal_plain_greedy(cls, tmp_path):
    model, traced, path = model_and_file(tmp_path)
    if cls is MedusaHeads:
        path = random_heads(model, tmp_path / "m.safetensors")
    plain = rewriter.optimize(traced)
    hy = rewriter.optimize(traced, passes=[cls(weights=str(path), tree=WIDE, dynamic=2)])
    assert hy.ir.info["decoding"]["dynamic"] == 2
    assert torch.equal(hy.generate(IDS, **KW), plain.generate(IDS, **KW))
    together = hy.generate(RAGGED, **KW)
    for i, row in enumerate(RAGGED):
        assert torch.equal(together[i, -24:], plain.generate([row], **KW)[0, len(row):]), i
    assert hy.stats["accepted"] > 0


def test_sampling_follows_the_model(tmp_path):
    """Seeded heads with peaked guesses: trees of more than one level, re-shaped."""
    from test_hydra_heads import hydra_heads
    model, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    plain = rewriter.optimize(traced)
    path = hydra_heads(model, tmp_path / "h.safetensors", k=2, scale=0.5)
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=[[0], [1], [2], [0, 0]],
                                                     dynamic=2)])
    a, b = sampled(plain, hy, [5, 9, 2])
    assert hy.stats["accepted"] > 0
    assert_same_distribution(a, b, (4, 5), 48)


def test_the_artifact_keeps_it_and_bad_values_are_refused(tmp_path):
    _, traced, path = model_and_file(tmp_path)
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=WIDE, dynamic=3)])
    hy.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert loaded.ir.info["decoding"]["dynamic"] == 3
    assert torch.equal(loaded.generate(IDS, **KW), hy.generate(IDS, **KW))
    refuses("dynamic", hy.ir.info["decoding"])


def refuses(key: str, record: dict) -> None:
    """The pass's ``key`` parameter is read from a spec, and bad values of it are refused by
    name, by the pass and in a decoding record (an artifact's)."""
    assert getattr(from_spec(f"hydra_heads:num_heads=2,{key}=5"), key) == 5
    for bad in (-1, 17, 2.0, True, "4"):
        with pytest.raises(ValueError, match=key):
            HydraHeads(num_heads=2, **{key: bad})
        assert key in check_record({**record, key: bad})


def triton_pair(tmp_path, **kw):
    """(plain, Hydra heads with ``kw`` on the Triton backend) of a small seeded model."""
    from test_hydra_heads import hydra_heads
    model, traced = traced_model("llama-gqa-3l", initializer_range=0.2, num_hidden_layers=2)
    path = hydra_heads(model, tmp_path / "h.safetensors", k=2)
    return rewriter.optimize(traced), rewriter.optimize(traced, passes=[
        HydraHeads(weights=str(path), tree=[[0], [1], [0, 0]], **kw)], backend="triton")


def test_the_triton_backend_gives_the_same_tokens(tmp_path):
    """A re-grown tree's mask is data: the Triton attention kernels verify it as any tree."""
    plain, hy = triton_pair(tmp_path, dynamic=2)
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert torch.equal(hy.generate(RAGGED[:2], **kw), plain.generate(RAGGED[:2], **kw))
    assert hy.stats["rounds"] > 0
