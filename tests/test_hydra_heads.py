"""Hydra draft heads: the path op, the heads in the IR against their math, drafting level
by level against a brute-force tree, lossless greedy decoding (families, ragged batches,
sampling), heads files, artifacts, the Triton backend and the shipped heads."""
import pytest
import torch

import rewriter
from rewriter.drafts import heads as heads_file
from rewriter.passes import HydraHeads, MedusaHeads, from_spec

from conftest import assert_same_distribution, oracle_drafts, traced_model, varied_init

IDS = torch.tensor([[3, 17, 42, 5, 99, 8, 64], [1, 2, 3, 4, 5, 6, 7]])
RAGGED = [[3, 17, 42, 5, 99, 8, 64, 11, 12], [1, 2, 3], [50, 51, 52, 53, 54]]
KW = dict(max_new_tokens=24, eos_token_id=[])
DEEP = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]  # a fixed tree: the
# auto tree follows timings, and a busy machine may choose one too small to accept much
WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


def hydra_heads(model, path, k=3, scale=0.05, seed=0, blocks=1, arch="hydra"):
    """A heads file (Hydra's, or Medusa's with ``arch``) for ``model`` with seeded random
    weights (``blocks`` residual blocks a head), accuracies and counts."""
    lm = model.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(seed)
    v, h = lm.shape
    w = [torch.randn(h, h * (i + 2), generator=g) * scale for i in range(k)] if arch == "hydra" \
        else torch.randn(k, h, h, generator=g) * scale
    deep = (torch.randn(blocks - 1, k, h, h, generator=g) * scale,
            torch.randn(blocks - 1, k, h, generator=g) * scale) if blocks > 1 else None
    heads_file.Heads(w, torch.randn(k, h, generator=g) * scale, v, heads_file.probe_of(lm),
                     [[0.5, 0.2, 0.1]] + [[0.4, 0.1]] * (k - 1), {"seed": seed},
                     torch.randint(0, 50, (v,), generator=g), arch, deep).save(path)
    return path


def model_and_file(tmp_path, config="llama-gqa-3l", **kw):
    """(model, its shared trace, a seeded heads file for it) of ``config`` with varied weights."""
    model, traced = traced_model(config, initializer_range=varied_init(config))
    return model, traced, hydra_heads(model, tmp_path / "h.safetensors", **kw)


def test_next_tokens_shifts_the_input():
    ids = torch.arange(10).view(2, 5)
    out = torch.ops.rw.next_tokens(ids, 3)
    assert out[0].tolist() == [[1, 2, 3], [2, 3, 4], [3, 4, 0], [4, 0, 0], [0, 0, 0]]
    assert torch.equal(out[1, 0], torch.tensor([6, 7, 8]))


def test_the_heads_in_the_ir_compute_hydras_math(tmp_path):
    model, traced, path = model_and_file(tmp_path)
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=WIDE)])
    text = str(hy.ir)
    assert "rw.next_tokens" in text and "hydra_2_linear" in text
    logits, draft = hy.ir.gm(IDS, torch.arange(7).expand(2, 7))
    heads = heads_file.load(path, "hydra")
    out = model(IDS, output_hidden_states=True)
    h = out.hidden_states[-1]
    e = model.get_input_embeddings().weight[torch.ops.rw.next_tokens(IDS, 3)]  # [B, S, K, H]
    want = heads_file.apply_hydra(h, e, heads.w, heads.b) @ model.lm_head.weight.t()
    assert torch.allclose(draft, want, atol=1e-4) and torch.allclose(logits, out.logits, atol=1e-4)


@pytest.mark.parametrize("arch", ["hydra", "medusa"])
def test_deeper_heads_compute_their_math_stay_lossless_and_round_trip(arch, tmp_path):
    """Heads of 3 blocks: two more residual blocks after each head's first, in the IR, in
    the lowered head programs and in an artifact."""
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = hydra_heads(model, tmp_path / "h.safetensors", blocks=3, arch=arch)
    heads = heads_file.load(path, arch)
    assert heads.blocks == 3 and heads.deep[0].shape[:2] == (2, 3)
    cls = HydraHeads if arch == "hydra" else MedusaHeads
    opt = rewriter.optimize(traced, passes=[cls(weights=str(path), tree=WIDE)])
    assert f"{arch}_2_block2_linear" in str(opt.ir)
    _, draft = opt.ir.gm(IDS, torch.arange(7).expand(2, 7))
    out = model(IDS, output_hidden_states=True)
    h = out.hidden_states[-1]
    if arch == "hydra":
        e = model.get_input_embeddings().weight[torch.ops.rw.next_tokens(IDS, 3)]  # [B, S, K, H]
        r = heads_file.apply_hydra(h, e, heads.w, heads.b, heads.deep)
        shallow = heads_file.apply_hydra(h, e, heads.w, heads.b)
    else:
        r = heads_file.apply(h, heads.w, heads.b, heads.deep)
        shallow = heads_file.apply(h, heads.w, heads.b)
    want = r @ model.lm_head.weight.t()
    assert torch.allclose(draft, want, atol=1e-4)
    assert not torch.allclose(draft, shallow @ model.lm_head.weight.t(), atol=1e-2)  # the blocks count
    plain = rewriter.optimize(traced)
    assert torch.equal(opt.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    assert opt.stats["rounds"] > 0
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert torch.equal(loaded.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    # the head programs the runtime runs, here and from the artifact, are the deeper heads
    for engine in (opt, loaded):
        programs = engine._lowered()
        with torch.inference_mode():
            if arch == "hydra":
                path_ids = torch.ops.rw.next_tokens(IDS, 3)
                got = torch.stack([programs[f"head{k}"](h, path_ids) for k in range(3)], -2)
            else:
                got = programs["heads"](h)
        assert torch.allclose(got, want, atol=1e-4)
    # zero blocks are the identity: a 1-block file's heads
    zero = (torch.zeros_like(heads.deep[0]), torch.zeros_like(heads.deep[1]))
    assert torch.equal(heads_file.deepen(shallow, zero), shallow)


def test_drafting_level_by_level_fills_each_node_from_its_parents_path(tmp_path):
    """Every node's token is its rank among head d's guesses on the path down to its parent."""
    model, traced, path = model_and_file(tmp_path, scale=0.5)
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=WIDE)])
    heads = heads_file.load(path, "hydra")
    from collections import Counter
    from rewriter.drafts.tree import make_tree
    from rewriter.runtime.decoding.tree.drafters import Hydra, level_plan
    programs = hy._lowered()  # called eagerly (static rounds: tests/test_static_rounds.py)
    record = rewriter.decoding.strategy_of(hy.ir.info)
    drafter = Hydra(lambda name, *args: programs[name](*args), None, Counter(), record.depth)
    tree = make_tree(WIDE, 3)
    levels = level_plan(tree.layout(), tree.depth)
    ranks = [1] * tree.depth  # the levels' own ranks suffice here
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 1, model.config.hidden_size, generator=g)
    root = torch.tensor([5, 9])
    with torch.inference_mode():
        nodes, _ = drafter.fixed(h, root, tree, levels, ranks)
    E, P = model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach()
    for b in range(2):
        for i, p in enumerate(tree.paths, start=1):
            chain = [0]
            while len(chain) < len(p):
                chain.append(1 + tree.paths.index(tuple(p[:len(chain)])))
            toks = nodes[b, chain]  # root .. parent
            d = len(p) - 1
            x = torch.cat([h[b, 0], E[toks].flatten()])
            logits = (h[b, 0] + torch.nn.functional.silu(heads.w[d] @ x + heads.b[d])) @ P.t()
            assert int(nodes[b, i]) == int(logits.topk(p[-1] + 1).indices[-1]), (b, p)
    assert drafter.stats["head_passes"] == 3 and int(tree.layout()["depth"].max()) == 3


@pytest.mark.parametrize("config", ["llama-gqa-3l", "qwen2-mqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_greedy_tokens_equal_plain_greedy(config, tmp_path):
    _, traced, path = model_and_file(tmp_path, config)
    plain = rewriter.optimize(traced)
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=WIDE)])
    assert torch.equal(hy.generate(IDS, **KW), plain.generate(IDS, **KW))
    together = hy.generate(RAGGED, **KW)
    for i, row in enumerate(RAGGED):
        assert torch.equal(together[i, -24:], plain.generate([row], **KW)[0, len(row):]), i
    s = hy.stats
    assert s["head_passes"] >= 3 * s["rounds"]  # one call a level


def sampled(plain, hy, prompt: list[int], rows: int = 3000, new: int = 3):
    """``new`` sampled tokens after ``prompt``, ``rows`` times, from ``plain`` and from ``hy``
    (different seeds): the samples a two-sample chi-square compares."""
    ids = torch.tensor([prompt]).expand(rows, len(prompt))
    kw = dict(max_new_tokens=new, do_sample=True, top_k=0, eos_token_id=[])
    return plain.generate(ids, seed=1, **kw), hy.generate(ids, seed=2, **kw)


def test_untrained_heads_accept_and_sampling_follows_the_model():
    """Zero heads guess the LM head's token again, which random models' repetitive text
    often accepts; sampled tokens against plain sampling, two-sample chi-square."""
    _, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    plain = rewriter.optimize(traced)
    hy = rewriter.optimize(traced, passes=[HydraHeads(num_heads=2, tree=[[0], [1], [2], [0, 0]])])
    a, b = sampled(plain, hy, [5, 9, 2])
    assert hy.stats["accepted"] > 0
    assert_same_distribution(a, b, (4, 5), 48)


def test_draft_vocabulary_artifact_round_trip_and_auto_tree(tmp_path):
    _, traced, path = model_and_file(tmp_path)
    plain = rewriter.optimize(traced)
    p = HydraHeads(weights=str(path), draft_vocab=32, max_nodes=6)
    hy = rewriter.optimize(traced, passes=[p])
    assert hy.ir.info["decoding"]["drafter"] == "hydra" and 1 <= len(hy.ir.info["decoding"]["tree"]) <= 6
    assert torch.equal(hy.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    hy.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    assert set(loaded.programs()) == {"prefill", "decode", "tree_prefill", "verify", "head0",
                                      "head1", "head2"}
    assert torch.equal(loaded.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    assert torch.equal(loaded(IDS), plain(IDS))


def test_heads_files_name_their_architecture_and_bad_ones_are_refused(tmp_path):
    _, _, path = model_and_file(tmp_path)
    with pytest.raises(ValueError, match="holds hydra heads"):
        MedusaHeads(weights=str(path))
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    for name, edit, match in (
            ("gap", lambda t: t.pop("w1"), "holds the tensors"),
            ("shape", lambda t: t.update(w1=torch.zeros(64, 64)), "w1 must be"),
            ("nan", lambda t: t["w2"].fill_(float("nan")), "NaN"),
            ("half", lambda t: t.update(deep_w=torch.zeros(1, 3, 64, 64)), "hold both deep_w and deep_b"),
            ("half_b", lambda t: t.update(deep_b=torch.zeros(1, 3, 64)), "hold both deep_w and deep_b"),
            ("dtype", lambda t: t.update(deep_w=torch.zeros(1, 3, 64, 64, dtype=torch.float16),
                                         deep_b=torch.zeros(1, 3, 64)), "float16"),
            ("too_deep", lambda t: t.update(deep_w=torch.zeros(8, 3, 64, 64), deep_b=torch.zeros(8, 3, 64)),
             r"B in \[2, 8\]"),
            ("deep", lambda t: t.update(deep_w=torch.zeros(1, 2, 64, 64), deep_b=torch.zeros(1, 2, 64)),
             r"deep_w must be \[B - 1, K, H, H\]"),
            ("deep_b", lambda t: t.update(deep_w=torch.zeros(1, 3, 64, 64), deep_b=torch.zeros(2, 3, 64)),
             "deep_b must be"),
            ("deep_nan", lambda t: t.update(deep_w=torch.full((1, 3, 64, 64), float("nan")),
                                            deep_b=torch.zeros(1, 3, 64)), "NaN")):
        bad = {k: v.clone() for k, v in t.items()}
        edit(bad)
        save_file(bad, str(tmp_path / f"{name}.safetensors"), metadata=meta)
        with pytest.raises(ValueError, match=match):
            HydraHeads(weights=str(tmp_path / f"{name}.safetensors"))
    save_file(t, str(tmp_path / "arch.safetensors"), metadata={**meta, "arch": "eagle"})
    with pytest.raises(ValueError, match="unknown heads architecture"):
        HydraHeads(weights=str(tmp_path / "arch.safetensors"))
    assert isinstance(from_spec("hydra_heads:num_heads=2"), HydraHeads)


def test_a_graph_that_uses_next_tokens_for_its_logits_is_refused():
    """rw.next_tokens reads later positions: a cached step cannot run it."""
    eng = rewriter.optimize(traced_model("llama-gqa-3l")[1])
    ir = eng.ir
    g = ir.graph
    (out,) = g.find_nodes(op="output")
    ids = next(iter(g.find_nodes(op="placeholder")))
    logits = out.args[0]
    with g.inserting_before(out):
        nxt = g.call_function(torch.ops.rw.next_tokens.default, (ids, 1))
        emb = next(n for n in g.nodes if n.target is torch.ops.rw.embedding.default)
        e = g.call_function(torch.ops.rw.embedding.default, (g.call_function(
            torch.ops.aten.select.int, (nxt, -1, 0)), emb.args[1]))
        new = g.call_function(torch.ops.aten.add.Tensor, (logits, g.call_function(
            torch.ops.aten.sum.dim_IntList, (e, [-1], True))))
    out.args = (new,)
    from rewriter.runtime.lower import lower
    with pytest.raises(rewriter.errors.RewriterError, match="next_tokens"):
        lower(ir, False)


def test_the_triton_backend_gives_the_same_tokens(tmp_path):
    model, traced = traced_model("llama-gqa-3l", initializer_range=0.2, num_hidden_layers=2)
    path = hydra_heads(model, tmp_path / "h.safetensors", k=2)
    plain = rewriter.optimize(traced)
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=[[0], [1], [0, 0]])],
                           backend="triton")
    kw = dict(max_new_tokens=6, eos_token_id=[])
    assert torch.equal(hy.generate(RAGGED[:2], **kw), plain.generate(RAGGED[:2], **kw))


def test_the_default_model_with_its_shipped_hydra_heads_is_lossless_and_accepts():
    from test_draft_heads import default_traced
    plain = rewriter.optimize(default_traced())
    hy = rewriter.optimize(default_traced(), passes=[HydraHeads(weights="default", tree=DEEP)])
    ids = [plain.tokenizer.encode("def main(").ids, plain.tokenizer.encode("import os\n").ids]
    assert torch.equal(hy.generate(ids, max_new_tokens=48), plain.generate(ids, max_new_tokens=48))
    s = hy.stats
    assert s["accepted"] / s["row_rounds"] > 1.0


def test_right_drafts_are_accepted_whole(tmp_path, monkeypatch):
    """The Hydra engine's rounds with drafts that are right (an oracle in place of the
    heads' guesses): whole chains accepted, plain greedy's tokens."""
    _, traced, path = model_and_file(tmp_path)
    plain = rewriter.optimize(traced)
    hy = rewriter.optimize(traced, passes=[HydraHeads(weights=str(path), tree=WIDE)])
    ref = plain.generate(RAGGED, **KW)
    oracle_drafts(monkeypatch, ref[:, -24:].tolist(), 128)
    assert torch.equal(hy.generate(RAGGED, **KW), ref)
    assert hy.stats["accepted"] / hy.stats["row_rounds"] > 2
