"""``rewriter train-eagle --train-vocab N``: the EAGLE draft trained and measured on the trimmed
draft vocabulary ``EagleDraft(draft_vocab=N)`` drafts from. The same tokens on both sides,
a target outside them no training target and always a miss, and a trimmed run that
learns."""
import types

import pytest
import torch

import rewriter
from rewriter.drafts import eagle_file
from rewriter.drafts.heads import draft_vocab
from rewriter.training.draft_loop import generated_pairs, top1
from rewriter.training.eagle_layer import DraftLayer
from rewriter.passes import EagleDraft
from rewriter.training.heads_fit import head_targets

PROMPTS = [list(range(3 + 7 * i, 20 + 7 * i)) for i in range(6)]

# One xdist worker runs this module (``--dist loadgroup``, pyproject.toml):
# its shared trace and training data are built once.
pytestmark = pytest.mark.xdist_group("eagle_train_vocab")


@pytest.fixture(scope="module")
def default():
    """(model, trace): the default model, traced once for every pipeline of this module."""
    model, _ = rewriter.default_model()
    return model, rewriter.trace(model)


@pytest.fixture(scope="module")
def rows(default):
    """The default model and its greedy answers to ``PROMPTS``, as the training's data."""
    model, traced = default
    tokens = rewriter.optimize(traced).generate(PROMPTS, max_new_tokens=24)  # [B, L]
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state  # [B, L, H]
    b, length = tokens.shape
    data = {"tokens": tokens, "hidden": hidden, "start": torch.full((b,), 17),
            "end": torch.full((b,), length)}
    return model, data


def _args(steps=0, seed=0):
    return types.SimpleNamespace(steps=steps, rows=6, positions=4096, lr=3e-3, seed=seed)


def test_the_draft_vocabulary_is_the_most_produced_tokens_sorted():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert draft_vocab(counts, 3).tolist() == [2, 3, 5]
    assert draft_vocab(counts, 100).tolist() == list(range(6))  # capped at V
    assert draft_vocab(counts, 2).tolist() == [2, 3]


def test_equal_counts_at_the_cut_off_go_to_the_lower_ids():
    """Ties are broken by token id, not by ``topk``'s implementation: many tokens share the
    count at the cut-off, and the later ones are kept whatever the order of the tie."""
    counts = torch.zeros(5000)
    counts[4000:] = 3.0  # 1000 tied tokens; the 10 kept are the lowest ids
    counts[[7, 123]] = 5.0
    assert draft_vocab(counts, 12).tolist() == [7, 123] + list(range(4000, 4010))
    assert draft_vocab(counts.to(torch.int64), 12).tolist() == [7, 123] + list(range(4000, 4010))
    # a vocabulary's worth of small counts ties everywhere (topk keeps other ids here)
    counts = torch.randint(0, 60, (49152,), generator=torch.Generator().manual_seed(0))
    want = sorted(sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))[:4096])
    assert draft_vocab(counts, 4096).tolist() == want
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            draft_vocab(counts, bad)


def test_the_pass_drafts_from_the_same_tokens(default, tmp_path, monkeypatch):
    """``EagleDraft(draft_vocab=N)`` hands the IR exactly ``draft_vocab(counts, N)``."""
    model, traced = default
    lm = model.lm_head.weight.detach()
    counts = torch.randint(0, 1000, (lm.shape[0],), generator=torch.Generator().manual_seed(3))
    d = DraftLayer(model, "random", 2)
    path = tmp_path / "d.safetensors"
    eagle_file.made({n: t.detach() for n, t in d.p.items()}, d.shape, lm, counts=counts).save(path)
    seen = []
    import rewriter.passes.eagle_draft as pass_module
    real = pass_module.insert_eagle
    monkeypatch.setattr(pass_module, "insert_eagle",
                        lambda *a: (seen.append(a[-1]), real(*a))[1])
    rewriter.optimize(traced, passes=[EagleDraft(weights=str(path), draft_vocab=50)])
    assert torch.equal(seen[0], draft_vocab(counts, 50))


def test_trimming_to_every_token_changes_nothing(rows):
    model, data = rows
    torch.manual_seed(0)
    full = DraftLayer(model, "random", 2)
    torch.manual_seed(0)
    trimmed = DraftLayer(model, "random", 2)
    trimmed.trim(torch.arange(model.lm_head.weight.shape[0]))
    assert full.accuracy(data) == trimmed.accuracy(data)
    assert full.train(data, _args(steps=3)) == pytest.approx(trimmed.train(data, _args(steps=3)), rel=1e-5)


def test_a_target_outside_the_vocabulary_is_a_miss_and_no_target(rows):
    model, data = rows
    used = torch.unique(data["tokens"])
    others = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool)
    others[used] = False
    d = DraftLayer(model, "random", 2)
    d.trim(others.nonzero().flatten())  # not one of the text's tokens
    assert d.accuracy(data) == [0.0, 0.0]
    remap = d.targets(missing=-100)
    y = torch.tensor([[int(used[0]), -100], [int(d.vocab[4]), int(used[-1])]])
    assert remap(y).tolist() == [[-100, -100], [4, -100]]
    before = {n: t.detach().clone() for n, t in d.p.items()}
    assert d.train(data, _args(steps=2)) == 0.0  # nothing to learn: no gradient at all
    assert all(torch.equal(before[n], d.p[n].detach()) for n in before)


def test_a_trimmed_run_learns_its_text(rows):
    """Trained on the answers' own tokens plus others, the trimmed draft's top-1 (as the
    runtime counts it) rises well above where it started."""
    model, data = rows
    counts = torch.bincount(data["tokens"].flatten(), minlength=model.lm_head.weight.shape[0])
    torch.manual_seed(0)
    d = DraftLayer(model, "random", 2)
    d.trim(draft_vocab(counts + 1, 300))  # the text's tokens, then 0, 1, 2 ...
    before = d.accuracy(data)
    d.train(data, _args(steps=20))  # about 0.93 top-1 after 20 steps (0 before)
    after = d.accuracy(data)
    assert after[0] > before[0] + 0.3 and after[1] > before[1] + 0.2, (before, after)


@pytest.mark.parametrize("ids", [torch.tensor([3, 2]), torch.tensor([1, 1]), torch.tensor([], dtype=torch.int64),
                                 torch.tensor([-1, 4]), torch.tensor([0, 10 ** 9])])
def test_bad_vocabularies_are_refused(rows, ids):
    with pytest.raises(ValueError, match="sorted distinct token ids"):
        DraftLayer(rows[0], "random", 2).trim(ids)


def test_top1_counts_a_target_outside_the_vocabulary_as_a_miss():
    """Logits that always pick the target where it is in the vocabulary: top-1 is the share
    of targets inside it, every valid target counted, none dropped."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (3, 12), generator=g)
    data = {"tokens": tokens, "start": torch.tensor([4, 5, 6]), "end": torch.tensor([12, 11, 12])}
    vocab = torch.tensor([1, 4, 7, 8, 11, 15, 19])
    d = types.SimpleNamespace(vocab=vocab)
    remap = DraftLayer.targets(d, missing=-1)

    def logits_of(rows, pairs):  # [P, 2, 7]: column of the target, or column 0
        y = remap(head_targets(data, pairs, 2)).clamp_min(0)
        return torch.nn.functional.one_hot(y, len(vocab)).float()
    got = top1(data, 2, logits_of, rows=2, targets=remap)
    y = head_targets(data, generated_pairs(data, torch.arange(3)), 2)
    ok = y != -100
    inside = torch.isin(y, vocab) & ok  # a target outside: column 0 picked, never -1
    want = [round(float(inside[:, k].sum() / ok[:, k].sum()), 4) for k in range(2)]
    assert got == want and 0 < want[0] < 1


def test_the_map_to_the_vocabulary():
    remap = DraftLayer.targets(types.SimpleNamespace(vocab=torch.tensor([2, 5])), missing=-100)
    assert remap(torch.tensor([7, -100, 5, 0, 2])).tolist() == [-100, -100, 1, -100, 0]
    miss = DraftLayer.targets(types.SimpleNamespace(vocab=torch.tensor([2, 5])), missing=-1)
    assert miss(torch.tensor([7, -100, 5, 0, 2])).tolist() == [-1, -100, 1, -1, 0]


def test_a_vocabulary_is_chosen_once(rows):
    d = DraftLayer(rows[0], "random", 2)
    d.trim(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="chosen once"):
        d.trim(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="sorted distinct token ids"):
        DraftLayer(rows[0], "random", 2).trim(torch.tensor([1.0, 2.0]))
