"""The EAGLE draft layer as a pass and in the runtime: the op in the IR against the layer's
math, the runtime's drafts against the op, lossless greedy decoding (trained and random
drafts, model families, ragged batches, an end of sequence inside an accepted path),
sampling, artifacts, the Triton backend, and hostile files, records and options."""
import pytest
import torch
import torch.nn.functional as F

import rewriter
from rewriter.drafts import eagle, eagle_file
from rewriter.errors import PassError, RewriterError
from rewriter.passes import EagleDraft, HydraHeads, from_spec
from rewriter.passes.eagle_draft import budget_tree

from conftest import assert_same_distribution, make_model, random_draft, traced_model, varied_init

RAGGED = [[3, 17, 42, 5, 99, 8, 64, 11, 12], [1, 2, 3], [50, 51, 52, 53, 54]]
KW = dict(max_new_tokens=24, eos_token_id=[])
TAUGHT = [list(range(3 + 7 * i, 20 + 7 * i)) for i in range(12)]  # the trained draft's prompts

# One xdist worker runs this module (``--dist loadgroup``, pyproject.toml):
# its shared trained draft and traces are built once.
pytestmark = pytest.mark.xdist_group("eagle_draft")


def kept_rows(monkeypatch) -> list:
    """Every ``EagleRows`` the runtime makes from now on, in order (to read its caches)."""
    from rewriter.runtime.decoding.tree import eagle_rows
    made = []

    class Kept(eagle_rows.EagleRows):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)
    monkeypatch.setattr("rewriter.runtime.decoding.tree.drafters.EagleRows", Kept)
    return made


@pytest.fixture(scope="module")
def default():
    """(model, trace, plain): the default model, traced once, and its plain pipeline. Each
    test optimizes its own pipeline from the trace, a copy of the IR (no ``torch.export``)."""
    model, _ = rewriter.default_model()
    traced = rewriter.trace(model)
    return model, traced, rewriter.optimize(traced)


@pytest.fixture(scope="module")
def taught(default, tmp_path_factory):
    """The default model and a draft trained (EAGLE-3's unrolled loss, two steps) on its own
    greedy continuations of ``TAUGHT``: it learns that text by heart, so its trees on it
    are accepted deep; elsewhere it guesses little."""
    model, _, plain = default
    rows = plain.generate(TAUGHT, max_new_tokens=48)  # [B, L]
    with torch.no_grad():
        f = model.model(rows).last_hidden_state  # [B, L, H]
    embed, lm = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    shape = eagle.Shape.of(model.config)
    torch.manual_seed(0)
    p = {k: v.requires_grad_() for k, v in
         eagle.init(shape, torch.Generator().manual_seed(0), model.model.norm.weight).items()}
    opt = torch.optim.Adam(p.values(), lr=3e-3)
    for _ in range(100):
        outs = eagle.unroll(p, shape, f[:, :-1], embed[rows[:, 1:]], 2)
        # step s at position i guesses x_{i+2}; chains start at i - s + 1 >= 0
        loss = sum(F.cross_entropy((o[:, s - 1:-1] @ lm.t()).flatten(0, 1), rows[:, s + 1:].flatten())
                   for s, o in enumerate(outs, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = tmp_path_factory.mktemp("eagle") / "taught.safetensors"
    counts = torch.bincount(rows[:, 17:].flatten(), minlength=lm.shape[0])  # the answers' tokens
    eagle_file.made({k: v.detach() for k, v in p.items()}, shape, lm, counts=counts).save(path)
    return model, str(path)


def test_the_op_in_the_ir_is_the_layer_teacher_forced(tmp_path):
    model, traced = traced_model("llama-gqa-3l", initializer_range=varied_init("llama-gqa-3l"))
    path = random_draft(model, tmp_path / "d.safetensors", scale=20.0)
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=str(path))])
    text = str(opt.ir)
    assert "eagle_layer" in text and "eagle.q_proj" in text
    assert {f"eagle.{a}" for a, _ in rewriter.ops.EAGLE_WEIGHTS} <= set(opt.ir.weights())
    ids = torch.tensor([[3, 17, 42, 5, 99, 8, 64], [1, 2, 3, 4, 5, 6, 7]])
    logits, draft = opt.ir.gm(ids, torch.arange(7).expand(2, 7))
    assert draft.shape == (2, 7, 1, model.config.vocab_size)
    torch.testing.assert_close(logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    # by hand: the model's last hidden state beside the next token's embedding (0 past the end)
    d = eagle_file.load(path)
    f = model.model(ids).last_hidden_state
    nxt = F.pad(ids[:, 1:], (0, 1))
    g, _ = eagle.step(d.params, d.shape, f, model.model.embed_tokens.weight[nxt],
                      eagle.empty_cache(d.shape, 2))
    torch.testing.assert_close(draft[:, :, 0], g @ model.lm_head.weight.t(), rtol=1e-4, atol=1e-4)
    assert opt.ir.info["decoding"]["drafter"] == "eagle"


def test_the_runtimes_first_guesses_are_the_ops(taught, default, monkeypatch):
    """Every round's first level (the root's children) equals the graph's draft logits at
    the position before the root over the final text: the runtime's catch-up feeds the
    layer what the op reads."""
    _, path = taught
    opt = rewriter.optimize(default[1], passes=[EagleDraft(weights=path)])
    opt.fallback = False
    from rewriter.runtime.decoding.tree.eagle_rows import EagleRows
    seen, call = [], EagleRows.call

    def spy(self, d, chains, ranks):
        out = call(self, d, chains, ranks)
        if d == 0:
            seen.append((self.caches[0][0].shape[2], out[0][0, 0].clone()))
        return out
    monkeypatch.setattr(EagleRows, "call", spy)
    prompt = TAUGHT[3][:9] + [400, 401]  # part taught, part not: rounds of every depth
    out = opt.generate(torch.tensor([prompt]), max_new_tokens=30, eos_token_id=[])
    assert opt.stats["accepted"] > 0 and len(seen) == opt.stats["rounds"] + 1
    _, draft = opt.ir.gm(out, torch.arange(out.shape[1])[None])
    for n, logp in seen[:-1]:  # the root at position n: the draft read f_{n-1}, x_n
        want = draft[0, n - 1, 0].float().log_softmax(-1).topk(logp.shape[-1])
        torch.testing.assert_close(logp, want.values, rtol=1e-3, atol=1e-3)


def test_a_trained_draft_is_lossless_and_accepts_deep(taught, default):
    _, path = taught
    _, traced, plain = default
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=path, nodes=8, depth=4)])
    opt.fallback = False
    ids = TAUGHT[:3] + [[200, 201, 202, 203], [5]]
    want = plain.generate(ids, max_new_tokens=40, eos_token_id=[])
    for i, row in enumerate(ids):  # each alone, then the ragged batch
        opt.stats.clear()
        got = opt.generate(torch.tensor([row]), max_new_tokens=40, eos_token_id=[])
        assert got[0].tolist() == want[i, want.shape[1] - got.shape[1]:].tolist()
        if i < 3:  # the taught text: most rounds accept the whole depth
            assert opt.stats["tokens"] / opt.stats["rounds"] > 3.0, opt.stats
    assert torch.equal(opt.generate(ids, max_new_tokens=40, eos_token_id=[]), want)
    # a ragged batch of taught rows (left-padded): each row's draft is caught up over its
    # own prompt, so the rounds still accept deep
    ragged = [TAUGHT[4][:10], TAUGHT[5], TAUGHT[6][:13]]
    opt.stats.clear()
    got = opt.generate(ragged, max_new_tokens=40, eos_token_id=[])
    assert torch.equal(got, plain.generate(ragged, max_new_tokens=40, eos_token_id=[]))
    assert opt.stats["accepted"] / opt.stats["row_rounds"] > 2.0, opt.stats


def test_a_trimmed_draft_vocabulary(taught, default, tmp_path):
    """``draft_vocab=N``: the draft projects onto the N tokens its training text made most
    (the file's counts); its guesses are those tokens' ids, the output is still the model's,
    and the artifact keeps the vocabulary."""
    model, path = taught
    _, traced, plain = default
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=path, draft_vocab=200)])
    opt.fallback = False
    vocab = opt.ir.weight("medusa.vocab")
    assert vocab.shape == (200,) and opt.ir.info["decoding"]["draft_vocab"] == 200
    _, draft = opt.ir.gm(torch.tensor([TAUGHT[0]]), torch.arange(17)[None])
    assert draft.shape == (1, 17, 1, 200)
    ids = TAUGHT[:2] + [[300, 301, 302]]
    want = plain.generate(ids, **KW)
    assert torch.equal(opt.generate(ids, **KW), want)
    assert opt.stats["accepted"] / opt.stats["row_rounds"] > 1.5  # the taught answers' tokens are kept
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    loaded.fallback = False
    assert torch.equal(loaded.ir.weight("medusa.vocab"), vocab)
    assert torch.equal(loaded.generate(ids, **KW), want)
    bare = tmp_path / "bare.safetensors"
    random_draft(model, bare)
    with pytest.raises(ValueError, match="has no counts"):
        EagleDraft(weights=str(bare), draft_vocab=200)


def test_an_end_of_sequence_inside_an_accepted_path(taught, default):
    _, path = taught
    _, traced, plain = default
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=path)])
    opt.fallback = False
    full = plain.generate([TAUGHT[1]], max_new_tokens=40, eos_token_id=[])[0].tolist()
    eos = full[len(TAUGHT[1]) + 13]  # a token deep in the taught answer
    kw = dict(max_new_tokens=40, eos_token_id=[eos])
    got = opt.generate([TAUGHT[1]], **kw)
    assert torch.equal(got, plain.generate([TAUGHT[1]], **kw))
    assert got[0, -1].item() == eos and got.shape[1] <= len(full)


@pytest.mark.parametrize("config", ["llama-gqa-3l", "qwen2-mqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_random_drafts_are_lossless_on_model_families(config, tmp_path):
    model, traced = traced_model(config, initializer_range=varied_init(config))
    path = random_draft(model, tmp_path / "d.safetensors")
    plain = rewriter.optimize(traced)
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=str(path), nodes=6, depth=3)])
    opt.fallback = False
    assert torch.equal(opt.generate(RAGGED, **KW), plain.generate(RAGGED, **KW))
    assert opt.stats["rounds"] > 0


def test_sampling_follows_the_models_distribution(tmp_path):
    """Two-sample chi-square on the second and third sampled tokens, 3000 rows each way."""
    model, traced = traced_model("llama-gqa-3l", vocab_size=48, initializer_range=0.08)
    path = random_draft(model, tmp_path / "d.safetensors")
    plain = rewriter.optimize(traced)
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=str(path), nodes=6, depth=2)])
    opt.fallback = False
    ids = torch.tensor([[5, 9, 2]]).expand(3000, 3)
    kw = dict(max_new_tokens=3, do_sample=True, top_k=0, eos_token_id=[])
    a = plain.generate(ids, seed=1, **kw)
    b = opt.generate(ids, seed=2, **kw)
    assert opt.stats["accepted"] > 0
    assert_same_distribution(a, b, (4, 5), 48)


def test_artifact_round_trip(taught, default, tmp_path):
    _, path = taught
    _, traced, plain = default
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=path, nodes=6)])
    opt.save(tmp_path / "a")
    loaded = rewriter.load(tmp_path / "a")
    loaded.fallback = False
    assert loaded.ir.info["decoding"] == opt.ir.info["decoding"]
    assert set(loaded.programs()) == {"prefill", "decode", "tree_prefill", "verify", "eagle"}
    ids = TAUGHT[:2] + [[7, 8]]
    assert torch.equal(loaded.generate(ids, **KW), plain.generate(ids, **KW))
    assert loaded.stats["accepted"] > 0
    torch.testing.assert_close(loaded.ir.weight("eagle.q_proj"), opt.ir.weight("eagle.q_proj"))


def test_the_triton_backend_gives_the_same_tokens(tmp_path):
    model, traced = traced_model("llama-gqa-3l", initializer_range=0.2, num_hidden_layers=2)
    path = random_draft(model, tmp_path / "d.safetensors")
    plain = rewriter.optimize(traced)
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=str(path), nodes=4, depth=2)],
                            backend="triton")
    opt.fallback = False
    kw = dict(max_new_tokens=5, eos_token_id=[])
    assert torch.equal(opt.generate(RAGGED[:2], **kw), plain.generate(RAGGED[:2], **kw))
    assert "eagle" in opt.programs() and isinstance(opt.kernel_sources(), dict)
    opt.dump(tmp_path / "dump")  # the draft layer is no Triton program: nothing of it to list
    assert (tmp_path / "dump" / "programs" / "eagle.py").is_file()


def test_the_cli_spec_and_the_budget_tree():
    assert budget_tree(8, 4).size == 8 and budget_tree(8, 4).depth <= 4
    assert budget_tree(2, 1).paths == ((0,),)
    assert budget_tree(30, 2).depth == 2 and budget_tree(30, 2).size == 30
    with pytest.raises(ValueError, match="unknown parameter 'tree'"):
        from_spec("eagle_draft:weights=x.safetensors,tree=[[0]]")


@pytest.mark.parametrize("kw, match", [
    (dict(), "give weights=.smollm2. .the shipped SmolLM2 draft. or PATH"),
    (dict(weights="/nonexistent/d.safetensors"), "d.safetensors"),
    (dict(nodes=1), "nodes must be an int in \\[2, 63\\]"),
    (dict(nodes=True), "nodes must be an int"),
    (dict(expand=0), "expand must be an int in \\[1, 16\\]"),
    (dict(depth=9), "depth must be an int in \\[1, 8\\]"),
    (dict(lookup=-1), "lookup must be an int"),
    (dict(draft_vocab=5), "draft_vocab must be an int >= 10"),
    (dict(nodes=12, depth=1), "at most 11 nodes"),
    (dict(acceptance="greedy"), "acceptance must be 'exact'"),
    (dict(posterior_alpha=float("nan")), "posterior_alpha must be a number"),
])
def test_bad_options_are_refused_by_name(kw, match, tmp_path):
    model = make_model("llama-gqa-3l")
    if "weights" not in kw and kw:
        kw["weights"] = str(random_draft(model, tmp_path / "d.safetensors"))
    with pytest.raises(ValueError, match=match):
        EagleDraft(**kw)


def test_its_repr_names_every_setting(tmp_path):
    """What the IR's pass list shows: every option that changes the rounds."""
    model = make_model("llama-gqa-3l", vocab_size=48)
    path = random_draft(model, tmp_path / "d.safetensors")
    text = repr(EagleDraft(weights=str(path), nodes=6, expand=2, depth=3, lookup=4,
                           acceptance="typical", posterior_threshold=0.2, posterior_alpha=0.3))
    for part in ("nodes=6", "expand=2", "depth=3", "draft_vocab=None", "lookup=4",
                 "acceptance='typical'", "posterior_threshold=0.2", "posterior_alpha=0.3"):
        assert part in text, (part, text)
    assert "posterior" not in repr(EagleDraft(weights=str(path)))


def test_a_draft_for_another_model_is_refused(tmp_path):
    model, traced = traced_model("llama-gqa-3l")
    other = make_model("llama-gqa-3l", seed=1)
    path = random_draft(other, tmp_path / "d.safetensors")
    with pytest.raises(PassError, match="another model"):
        rewriter.optimize(traced, passes=[EagleDraft(weights=str(path))])
    with pytest.raises(PassError, match="already has a decoding strategy"):
        rewriter.optimize(traced, passes=[HydraHeads(num_heads=2, tree=[[0]]),
                                         EagleDraft(weights=str(random_draft(model, tmp_path / "m.safetensors")))])


def test_hostile_records_and_graphs_are_refused(tmp_path):
    from rewriter.decoding import check_record
    model, traced = traced_model("llama-gqa-3l")
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=str(random_draft(model, tmp_path / "d.safetensors")))])
    r = dict(opt.ir.info["decoding"])
    assert check_record(r) is None
    assert "drafter 'eagle'" in check_record({k: v for k, v in r.items() if k != "dynamic"})
    assert "drafter 'eagle'" in check_record({**r, "batch_trees": [[2, [[0]]]]})
    # a record that asks for the layer on a graph without one
    from rewriter.runtime.decoding import strategy_for
    from rewriter.runtime.programs import build_programs
    for k, match in ((2, "draft logits are"), (1, "no rw.eagle_layer")):  # one head: the op's shape
        hy = rewriter.optimize(traced, passes=[HydraHeads(num_heads=k, tree=[[0], [1]])])
        hy.ir.info["decoding"] = {**hy.ir.info["decoding"], "drafter": "eagle", "dynamic": 2}
        with pytest.raises(RewriterError, match=match):
            build_programs(hy.ir, "torch", {}, strategy_for(hy.ir))
    # a layer whose weight does not fit is refused by shape propagation, by name
    from rewriter.ops import ShapeError
    layer = next(n for n in opt.ir.graph.nodes if n.name == "eagle_layer")
    bad = list(layer.args)
    bad[5] = bad[6]  # q_proj's place given k_proj's weight
    with pytest.raises(ShapeError, match="q_proj must be"):
        torch.ops.rw.eagle_layer(*[opt.ir.weight(a.target) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                                   else torch.zeros(1, 3, model.config.hidden_size) if isinstance(a, torch.fx.Node)
                                   else a for a in bad])


def test_each_drafted_node_is_the_layer_run_along_its_path():
    """``EagleRows``: every node of a grown tree gets the feature that ``eagle.step`` gives
    run token by token along the node's path after the row's cache, on its own feature
    each time; rows of a batch keep their own caches."""
    from rewriter.runtime.decoding.tree.eagle_rows import EagleProgram, EagleRows
    from rewriter.runtime.decoding.tree.dynamic import grow
    shape = eagle.Shape(32, 4, 2, 48, 500.0)
    g = torch.Generator().manual_seed(3)
    p = {k: v * 20 if v.dim() == 2 else v for k, v in eagle.init(shape, g).items()}
    embed, lm = torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g)
    rows = EagleRows(EagleProgram(p, shape, embed, lm), 2, "cpu")
    texts = [torch.randint(0, 40, (9,), generator=g), torch.randint(0, 40, (5,), generator=g)]
    for r, t in enumerate(texts):
        rows.catch_up(r, torch.randn(len(t) - 1, 32, generator=g), t[1:].tolist())
        # past a row's length a level reads the buffer (its text in steps of 256): large
        # finite values there must weigh nothing
        rows.k[r, :, rows.lengths[r]:] = torch.randn(rows.k[r, :, rows.lengths[r]:].shape, generator=g) * 100
        rows.v[r, :, rows.lengths[r]:] = torch.randn(rows.v[r, :, rows.lengths[r]:].shape, generator=g) * 100
    root = torch.tensor([int(t[-1]) for t in texts])
    tree, tokens, _ = grow(lambda d, c: rows.call(d, c, 5), root, 12, 4, 3)
    assert tree.depth == 4  # nodes at depth 3 read their ancestors' keys at depths 1 and 2
    for r in range(2):
        for path, feature in rows.drafted(r).items():
            cache, f = rows.caches[r], rows.g[r]
            for t in path:
                out, cache = eagle.step(p, shape, f[None, None], embed[t][None, None], cache)
                f = out[0, -1]
            torch.testing.assert_close(feature, f, rtol=1e-4, atol=1e-4)
        assert len(rows.drafted(r)) > 4 and rows.caches[r][0].shape[2] == len(texts[r]) - 1


def test_a_level_reads_the_text_in_steps_of_256_positions(monkeypatch):
    """A level's text grows in steps (bfloat16 products on a CPU build a kernel for every
    new shape); what it reads past a row's length is masked (the test above fills it)."""
    from rewriter.runtime.decoding.tree import eagle_rows
    from rewriter.runtime.decoding.tree.eagle_rows import EagleProgram, EagleRows
    from rewriter.runtime.decoding.tree.dynamic import grow
    shape = eagle.Shape(32, 4, 2, 48, 500.0)
    g = torch.Generator().manual_seed(3)
    embed, lm = torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g)
    rows = EagleRows(EagleProgram(eagle.init(shape, g), shape, embed, lm), 2, "cpu", capacity=256)
    seen, level = [], eagle.tree_level
    monkeypatch.setattr(eagle_rows.eagle, "tree_level",
                        lambda p, s, f, e, k, v, *a: seen.append(k.shape[2]) or level(p, s, f, e, k, v, *a))
    # 300 positions double the 256-position buffer to 512; 700 double it again, to 1024
    for texts, want in (((9, 5), 256), ((255, 5), 256), ((300, 5), 512), ((700, 5), 768)):
        for r, n in enumerate(texts):
            rows.lengths[r] = 0
            rows.catch_up(r, torch.randn(n, 32, generator=g), torch.randint(0, 40, (n,), generator=g).tolist())
        seen.clear()
        grow(lambda d, c: rows.call(d, c, 3), torch.tensor([1, 2]), 6, 3, 2)
        assert seen and set(seen) == {want}, (texts, seen)


def test_the_rows_cache_grows_past_its_capacity_in_chunks():
    """``EagleRows`` from a 2-position buffer, prompts caught up 3 positions at a time and
    then a round's 2: each row's cache is ``eagle.step``'s over its whole text."""
    from rewriter.runtime.decoding.tree.eagle_rows import EagleProgram, EagleRows
    shape = eagle.Shape(32, 4, 2, 48, 500.0)
    g = torch.Generator().manual_seed(4)
    p = {k: v * 5 if v.dim() == 2 else v for k, v in eagle.init(shape, g).items()}
    embed, lm = torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g)
    rows = EagleRows(EagleProgram(p, shape, embed, lm), 2, "cpu", capacity=2)
    texts = [torch.randint(0, 40, (12,), generator=g), torch.randint(0, 40, (6,), generator=g)]
    feats = [torch.randn(len(t), 32, generator=g) for t in texts]
    for r, (t, f) in enumerate(zip(texts, feats)):
        rows.catch_up(r, f[:-3], t[1:-2].tolist(), chunk=3)
        rows.catch_up(r, f[-3:-1], t[-2:].tolist())  # a round that accepted one token
    for r, (t, f) in enumerate(zip(texts, feats)):
        with torch.no_grad():
            out, (k, v) = eagle.step(p, shape, f[None, :-1], embed[t[1:]][None], eagle.empty_cache(shape, 1))
        assert rows.cache(r)[0].shape[2] == len(t) - 1
        torch.testing.assert_close(rows.cache(r)[0], k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rows.cache(r)[1], v, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(rows.g[r], out[0, -1], rtol=1e-4, atol=1e-4)


def test_a_row_that_is_done_drafts_nothing_and_changes_no_other_row():
    """A batch with its middle row done: that row's guesses are zeros (no say in the tree),
    and every other row's are those it gets in a batch of its own."""
    from rewriter.runtime.decoding.tree.eagle_rows import EagleProgram, EagleRows
    from rewriter.runtime.decoding.tree.dynamic import grow
    shape = eagle.Shape(32, 4, 2, 48, 500.0)
    g = torch.Generator().manual_seed(6)
    p = {k: v * 20 if v.dim() == 2 else v for k, v in eagle.init(shape, g).items()}
    program = EagleProgram(p, shape, torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g))
    texts = [torch.randint(0, 40, (n,), generator=g) for n in (9, 4, 6)]
    feats = [torch.randn(len(t) - 1, 32, generator=g) for t in texts]
    batch = EagleRows(program, 3, "cpu")
    for r, (t, f) in enumerate(zip(texts, feats)):
        batch.catch_up(r, f, t[1:].tolist())
    batch.idle = {1}
    weight = torch.tensor([1.0, 0.0, 1.0])  # as the runtime weighs a done row
    seen = []  # (level, the chains grow handed over, the guesses)

    def call(d, chains):
        seen.append((d, chains.clone(), batch.call(d, chains, 5)))
        return seen[-1][2]
    grow(call, torch.tensor([int(t[-1]) for t in texts]), 12, 4, 3, weight)
    assert len(seen) == 4 and all(not lp[1].any() and not ids[1].any() for _, _, (lp, ids) in seen)
    for r in (0, 2):  # the same levels, the row alone
        alone = EagleRows(program, 1, "cpu")
        alone.catch_up(0, feats[r], texts[r][1:].tolist())
        for d, chains, (lp, ids) in seen:
            want_lp, want_ids = alone.call(d, chains[r:r + 1], 5)
            torch.testing.assert_close(lp[r], want_lp[0], rtol=1e-4, atol=1e-4)
            assert torch.equal(ids[r], want_ids[0])


def test_a_padded_rows_draft_cache_is_its_prompts_alone(taught, default, monkeypatch):
    """After the prompt, each row of a left-padded batch holds the draft cache it would
    hold alone: its own positions, no padding."""
    _, path = taught
    made = kept_rows(monkeypatch)
    opt = rewriter.optimize(default[1], passes=[EagleDraft(weights=path)])
    ragged = [TAUGHT[4][:10], TAUGHT[5] + TAUGHT[6], [9, 10]]  # the long one: in 3 chunks
    opt.generate(ragged, max_new_tokens=1, eos_token_id=[], prefill_chunk=16)
    batch = made[-1]
    for r, prompt in enumerate(ragged):
        opt.generate([prompt], max_new_tokens=1, eos_token_id=[])
        alone = made[-1]
        n = len(prompt)
        assert batch.caches[r][0].shape[2] == n
        torch.testing.assert_close(batch.caches[r][0], alone.caches[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(batch.g[r], alone.g[0], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """(model, trace, params, shape, path): a 16-token model whose random text repeats,
    traced once, and a seeded random draft for it (with counts) saved at ``path``."""
    model, traced = traced_model("llama-gqa-3l", vocab_size=16, initializer_range=0.2)
    h = model.config.hidden_size
    shape = eagle.Shape(h, 4, 2, 2 * h)
    p = {k: v * 5 if v.dim() == 2 else v for k, v in eagle.init(shape, torch.Generator().manual_seed(0)).items()}
    path = tmp_path_factory.mktemp("repeating") / "d.safetensors"
    eagle_file.made(p, shape, model.get_output_embeddings().weight.detach(),
                    counts=torch.arange(16)).save(path)
    return model, traced, p, shape, path


@pytest.mark.parametrize("mode", ["greedy", "sampled", "typical", "lookup", "trimmed"])
def test_the_draft_cache_is_the_layer_over_the_final_text(mode, repeating, monkeypatch):
    """After a generation each row's draft cache holds the layer's keys over the row's own
    text (its prompt and every token made but the last), whatever the acceptance, copied
    chains or draft vocabulary: the catch-up after every round fed it the right features
    and tokens. A 16-token model whose random text repeats, so rounds accept often."""
    made = kept_rows(monkeypatch)
    model, traced, p, shape, path = repeating
    pkw = {"typical": dict(acceptance="typical"), "lookup": dict(lookup=4),
           "trimmed": dict(draft_vocab=10)}.get(mode, {})
    gkw = dict(do_sample=True, seed=3, top_k=0) if mode == "sampled" else {}
    opt = rewriter.optimize(traced, passes=[EagleDraft(weights=str(path), nodes=8, depth=3, **pkw)])
    opt.fallback = False
    prompts = [list(range(1, 15)) * 3, [3, 4, 5], list(range(7, 16)) + list(range(1, 12))]
    new = 20
    out = opt.generate(prompts, max_new_tokens=new, eos_token_id=[], **gkw)
    assert opt.stats["accepted"] > 0
    rows = made[-1]
    for r, prompt in enumerate(prompts):
        text = torch.cat([torch.tensor(prompt), out[r, -new:]])  # [S + new]
        # the last round's catch-up may stop short of the text, or go past the tokens kept
        n = min(rows.caches[r][0].shape[2], len(text) - 1)
        assert n >= len(text) - 1 - 4
        with torch.no_grad():
            f = model.model(text[None]).last_hidden_state
            _, (k, v) = eagle.step(p, shape, f[:, :n], model.model.embed_tokens.weight[text[1:n + 1]][None],
                                   eagle.empty_cache(shape, 1))
        torch.testing.assert_close(rows.caches[r][0][:, :, :n], k, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(rows.caches[r][1][:, :, :n], v, rtol=1e-3, atol=1e-3)
