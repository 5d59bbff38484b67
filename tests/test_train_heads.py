"""Training draft heads: seeded, resumable after an interruption, a loadable file with
rank accuracies and token counts, and the CLI.

Fast: every run and every question asked generates with one engine of the default model,
traced once for the file (a trace and its first steps cost more than a tiny run)."""
import json
import shutil
import types

import pytest
import torch

import rewriter
from rewriter.drafts import heads as heads_file
from rewriter.training import generation as tg, heads_data as hd, heads_fit as hf, prompts as tp
from rewriter.training import train_heads as th
from rewriter.models.checkpoints import default_model

from conftest import Clock

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("train_heads")

SMALL = dict(num_heads=2, prompts=6, heldout_prompts=3, prompt_tokens=16, new_tokens=8,
             epochs=2, batch=16, progress=False)
OWN_ENGINE = tg.engine_of  # a trace per run (or per call outside one): what the file's runs skip


@pytest.fixture(scope="module")
def engine():
    """The default model traced once: every model this file generates with is the default
    model, loaded again (the same weights, so the same tokens)."""
    return rewriter.optimize(default_model()[0])


@pytest.fixture(autouse=True)
def one_trace(engine, monkeypatch):
    for module in (tg, tp):  # continuing prompts; asking questions
        monkeypatch.setattr(module, "engine_of", lambda model: engine)


def test_training_is_seeded_and_resumes_after_an_interruption(tmp_path, monkeypatch):
    model, tok = default_model()
    report = th.train_heads(model, tok, tmp_path / "a.safetensors", **SMALL)
    a = heads_file.load(tmp_path / "a.safetensors")
    assert a.num_heads == 2 and a.counts.sum() == 6 * 8  # every generated token counted
    assert len(a.accuracy) == 2 and len(a.accuracy[0]) == hf.RANKS
    assert report["steps"] > 3 and a.w.abs().sum() > 0  # it learned something
    # interrupted at step 3 (checkpoints every step), then run again: the same heads
    monkeypatch.setattr(hf, "CHECKPOINT_EVERY", 1)
    real, calls = heads_file.apply, []

    def crash(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(heads_file, "apply", crash)
    with pytest.raises(KeyboardInterrupt):
        th.train_heads(model, tok, tmp_path / "b.safetensors", **SMALL)
    assert not (tmp_path / "b.safetensors").exists()
    monkeypatch.setattr(heads_file, "apply", real)
    th.train_heads(model, tok, tmp_path / "b.safetensors", **SMALL)
    b = heads_file.load(tmp_path / "b.safetensors")
    assert torch.equal(a.w, b.w) and torch.equal(a.b, b.b)


def test_training_from_earlier_heads_starts_at_their_weights(tmp_path):
    """``init``: the run starts at the file's weights (a tiny learning rate leaves them where
    they were), adds its token counts to the new data's, and names the file it came from;
    heads of another architecture, head count or model are refused before any data is made."""
    model, tok = default_model()
    th.train_heads(model, tok, tmp_path / "a.safetensors", **SMALL)
    a = heads_file.load(tmp_path / "a.safetensors")
    report = th.train_heads(model, tok, tmp_path / "b.safetensors", init=tmp_path / "a.safetensors",
                            work_dir=tmp_path / "work", **{**SMALL, "lr": 1e-12, "seed": 1})
    b = heads_file.load(tmp_path / "b.safetensors")
    assert torch.equal(a.w, b.w) and torch.equal(a.b, b.b)  # bfloat16 files: 1e-12 rounds away
    assert b.counts.sum() == a.counts.sum() + 6 * 8  # the start's data and this run's
    assert report["init"]["file"] == "a.safetensors" and len(report["init"]["sha256"]) == 64
    # from zero weights instead, the same data and learning rate give untrained heads
    th.train_heads(model, tok, tmp_path / "c.safetensors", work_dir=tmp_path / "work",
                   **{**SMALL, "lr": 1e-12, "seed": 1})
    assert heads_file.load(tmp_path / "c.safetensors").w.abs().max() < 1e-6
    with pytest.raises(ValueError, match="init must be a heads file's path"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", init=3, **SMALL)
    with pytest.raises(heads_file.HeadsFileError, match="no such heads file"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", init=tmp_path / "nothing", **SMALL)
    with pytest.raises(ValueError, match="holds 2 heads; this run trains 3"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", init=tmp_path / "a.safetensors",
                       **{**SMALL, "num_heads": 3})
    with pytest.raises(heads_file.HeadsFileError, match="not hydra heads"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", init=tmp_path / "a.safetensors",
                       arch="hydra", **SMALL)
    with pytest.raises(heads_file.HeadsFileError, match="trained for a model with hidden size 576"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", init="smollm2", **{**SMALL, "num_heads": 4})
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.safetensors.work").exists()


@pytest.mark.parametrize("arch", ["hydra", "medusa"])
def test_deeper_heads_train_and_start_from_shallower_ones(arch, tmp_path, monkeypatch):
    """``blocks=2``: one more residual block a head, zero at first, so a run from 1-block
    heads starts at their weights (a tiny learning rate leaves it there); it learns when the
    rate allows, and its accuracies are the deeper heads'; a 3-block run from it keeps its
    block; heads deeper than the run are refused as a start."""
    model, tok = default_model()
    ws = lambda h: h.w if arch == "hydra" else [h.w]  # noqa: E731
    th.train_heads(model, tok, tmp_path / "a.safetensors", arch=arch, **SMALL)
    a = heads_file.load(tmp_path / "a.safetensors", arch)
    assert a.blocks == 1 and a.deep is None
    report = th.train_heads(model, tok, tmp_path / "b.safetensors", arch=arch, blocks=2,
                            init=tmp_path / "a.safetensors", work_dir=tmp_path / "work",
                            **{**SMALL, "lr": 1e-12, "seed": 1})
    b = heads_file.load(tmp_path / "b.safetensors", arch)
    assert b.blocks == 2 and report["blocks"] == 2
    assert all(torch.equal(x, y) for x, y in zip(ws(a), ws(b))) and torch.equal(a.b, b.b)
    assert b.deep[0].abs().max() < 1e-6 and b.deep[1].abs().max() < 1e-6
    # the same data, a real learning rate: the new block learns; the stored accuracies
    # are measured with it
    seen = []
    real = th.rank_accuracy
    monkeypatch.setattr(th, "rank_accuracy", lambda *a, **k: seen.append(k["deep"]) or real(*a, **k))
    th.train_heads(model, tok, tmp_path / "c.safetensors", arch=arch, blocks=2,
                   init=tmp_path / "a.safetensors", work_dir=tmp_path / "work", **{**SMALL, "seed": 1})
    c = heads_file.load(tmp_path / "c.safetensors", arch)
    assert c.deep[0].abs().sum() > 0 and c.deep[1].abs().sum() > 0
    assert torch.equal(seen[-1][0].to(torch.bfloat16), c.deep[0])
    # 3 blocks from 2: the file's block is the first, the new one starts at zero
    th.train_heads(model, tok, tmp_path / "d.safetensors", arch=arch, blocks=3,
                   init=tmp_path / "c.safetensors", work_dir=tmp_path / "work",
                   **{**SMALL, "lr": 1e-12, "seed": 2})
    d = heads_file.load(tmp_path / "d.safetensors", arch)
    assert torch.equal(d.deep[0][:1], c.deep[0]) and torch.equal(d.deep[1][:1], c.deep[1])
    assert d.deep[0][1:].abs().max() < 1e-6
    # runs that differ only in their blocks do not resume each other's checkpoint
    th.train_heads(model, tok, tmp_path / "f.safetensors", arch=arch, blocks=2,
                   work_dir=tmp_path / "work", **{**SMALL, "seed": 2})
    th.train_heads(model, tok, tmp_path / "e.safetensors", arch=arch, work_dir=tmp_path / "work",
                   **{**SMALL, "seed": 2})
    e, f = (heads_file.load(tmp_path / f"{n}.safetensors", arch) for n in "ef")
    assert e.deep is None and not all(torch.equal(x, y) for x, y in zip(ws(e), ws(f)))
    with pytest.raises(ValueError, match="holds heads of 2 blocks; this run trains 1"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", arch=arch,
                       init=tmp_path / "c.safetensors", **SMALL)
    for bad in (0, 9, 2.0):
        with pytest.raises(ValueError, match="blocks must be"):
            th.train_heads(model, tok, tmp_path / "x.safetensors", blocks=bad, **SMALL)
    assert not (tmp_path / "x.safetensors").exists()


def test_bad_training_parameters_are_refused(tmp_path):
    model, tok = default_model()
    for kw in ({"num_heads": 0}, {"num_heads": 9}, {"epochs": 0}, {"lr": 0}, {"lr": True},
               {"new_tokens": 2}, {"prompts": 1.5}, {"data": "web"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            th.train_heads(model, tok, tmp_path / "x.safetensors", **{**SMALL, **kw})


def test_asking_for_more_prompts_than_the_corpus_holds_is_refused():
    _, tok = default_model()
    assert len(tp.make_prompts(tok, "heldout", 5, 16, 0, True)) == 5
    with pytest.raises(ValueError, match="heldout corpus gives .* ask for fewer prompts"):
        tp.make_prompts(tok, "heldout", 10 ** 7, 16, 0, True)  # never silently fewer
    assert len(tp.corpus_rows(tok, "heldout", 5, 16, 0)) == 5
    with pytest.raises(ValueError, match="heldout corpus gives .* rows of 16 tokens"):
        tp.corpus_rows(tok, "heldout", 10 ** 7, 16, 0)


def test_corpus_rows_are_teacher_forced_with_the_models_own_tokens(tmp_path):
    """``data="corpus"``: the corpus's text, and for head k at t the model's greedy token
    after position t + k + 1 (masked past the row); the held-out set stays generated."""
    from safetensors.torch import load_file
    model, tok = default_model()
    kw = {**SMALL, "arch": "hydra", "work_dir": tmp_path / "w"}
    length = SMALL["prompt_tokens"] + SMALL["new_tokens"]
    report = th.train_heads(model, tok, tmp_path / "c.safetensors", data="corpus", **kw)
    assert report["data"] == "corpus" and report["steps"] > 3
    d = load_file(tmp_path / "w" / "train-corpus.safetensors")
    assert d["tokens"].tolist() == tp.corpus_rows(tok, "train", 6, length, 0)  # not generated
    text = {tuple(r) for r in tp.corpus_rows(tok, "train", 600, length, 0)}
    assert all(tuple(r) in text for r in d["tokens"].tolist())  # rows of the source, whole
    with torch.inference_mode():
        want = model(d["tokens"]).logits.argmax(-1)  # [6, L]
    assert torch.equal(d["next"], want)
    assert heads_file.load(tmp_path / "c.safetensors").counts.sum() == 6 * length
    d["end"] = hd.row_ends(d, SMALL["new_tokens"], {0, 1, 2})  # no end of sequence in text rows
    assert (d["end"] == length).all()
    pairs = hf._samples(d, 2)
    y, path = hf.head_targets(d, pairs, 2), hf.path_tokens(d, pairs, 2)
    r, t = pairs[:, 0], pairs[:, 1]
    assert t.min() == 0 and torch.equal(y[:, 0], want[r, t + 1])
    assert torch.equal(path[:, 0], d["tokens"][r, t + 1])  # the path is the text
    ok = t + 3 < length
    assert torch.equal(y[ok, 1], want[r[ok], t[ok] + 2]) and bool((y[~ok, 1] == -100).all())
    held = tmp_path / "w" / "heldout.safetensors"
    assert "next" not in load_file(held)
    before = held.stat().st_mtime_ns
    th.train_heads(model, tok, tmp_path / "g.safetensors", **kw)  # generated: its own rows
    assert held.stat().st_mtime_ns == before  # the same held-out set, not made again
    assert "next" not in load_file(tmp_path / "w" / "train.safetensors")
    assert (tmp_path / "w" / "train-corpus.safetensors").is_file()  # both modes' data kept
    # the generated run trained its own heads (not the corpus run's checkpoint), under the
    # keys caches made before the corpus mode have
    assert not torch.equal(heads_file.load(tmp_path / "c.safetensors").w[0],
                           heads_file.load(tmp_path / "g.safetensors").w[0])
    from safetensors import safe_open
    for name in ("train.safetensors", "checkpoint.safetensors"):
        with safe_open(str(tmp_path / "w" / name), framework="pt") as f:
            assert "data" not in json.loads(f.metadata()["settings"])


def test_mixed_data_is_the_generated_rows_and_the_corpus_rows_each_mode_made(tmp_path):
    """``data="mixed"``: the rows a generated run and a corpus run cache, reused (not made
    again), trained on together with the same targets each mode gives its rows."""
    from safetensors.torch import load_file
    model, tok = default_model()
    kw = {**SMALL, "arch": "hydra", "work_dir": tmp_path / "w"}
    th.train_heads(model, tok, tmp_path / "g.safetensors", **kw)
    th.train_heads(model, tok, tmp_path / "c.safetensors", data="corpus", **{**kw, "prompts": 4})
    files = [tmp_path / "w" / f for f in ("train.safetensors", "train-corpus.safetensors",
                                          "heldout.safetensors")]
    before = [f.stat().st_mtime_ns for f in files]
    report = th.train_heads(model, tok, tmp_path / "m.safetensors", data="mixed", rows=4, **kw)
    assert [f.stat().st_mtime_ns for f in files] == before  # each mode's cache reused
    gen, cor = (load_file(f) for f in files[:2])
    assert report["data"] == "mixed" and report["settings"]["rows"] == 4
    m = heads_file.load(tmp_path / "m.safetensors")
    assert m.counts.sum() == 6 * 8 + 4 * 24  # generated tokens + every corpus position
    # the merged set's targets and paths are each part's own
    eos = hd.eos_ids(model, tok)
    parts = []
    for d in (gen, cor):
        d["end"] = hd.row_ends(d, SMALL["new_tokens"], eos)
        parts.append(d)
    merged = hd.merge_parts(parts)
    assert merged["tokens"].shape[0] == 10 and merged["hidden"].shape[:2] == merged["tokens"].shape
    pm, pg, pc = (hf._samples(d, 2) for d in (merged, gen, cor))
    assert len(pm) == len(pg) + len(pc) == report["positions"]
    for part, pp, offset in ((gen, pg, 0), (cor, pc, 6)):
        mine = torch.isin(pm[:, 0], torch.arange(offset, offset + len(part["start"])))
        shifted = pm[mine] - torch.tensor([offset, 0])
        assert torch.equal(shifted, pp)
        assert torch.equal(hf.head_targets(merged, pm[mine], 2), hf.head_targets(part, pp, 2))
        assert torch.equal(hf.path_tokens(merged, pm[mine], 2), hf.path_tokens(part, pp, 2))
        h = merged["hidden"][pm[mine][:, 0], pm[mine][:, 1]]
        assert torch.equal(h, part["hidden"][pp[:, 0], pp[:, 1]])
    # its own checkpoint, under its own key
    from safetensors import safe_open
    with safe_open(str(tmp_path / "w" / "checkpoint.safetensors"), framework="pt") as f:
        key = json.loads(f.metadata()["settings"])
    assert key["data"] == "mixed" and key["rows"] == 4 and "questions" not in key
    with pytest.raises(ValueError, match="rows counts the corpus rows of data='mixed'"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", rows=4, **kw)
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        th.train_heads(model, tok, tmp_path / "x.safetensors", data="mixed", rows=0, **kw)


class _Templated:
    """The default model's tokenizer with a chat template (it has none)."""
    chat_template = ("{% for m in messages %}User: {{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}Assistant:{% endif %}")

    def __init__(self, tok):
        self.backend_tokenizer = getattr(tok, "backend_tokenizer", tok)


def _turns_end_at_full_stops(monkeypatch, tok):
    """The default model has no end of turn and rarely writes its end of sequence within a
    question's length: a full stop ends its turns here."""
    stop = _Templated(tok).backend_tokenizer.token_to_id(".")
    assert stop is not None
    for module in (tp, hd):  # the questions' turns; the rows' ends
        monkeypatch.setattr(module, "eos_ids", lambda model, tokenizer: {stop})


def test_self_asked_takes_a_batch_and_stops_at_its_deadline(monkeypatch):
    """A GPU asks more questions at once (``batch``: seeded, deterministic, other questions
    than 32 at a time); a deadline stops it after the batch that passes it, with fewer
    questions than asked; a batch below one is refused by name."""
    model, tok = default_model()
    _turns_end_at_full_stops(monkeypatch, tok)
    chat = _Templated(tok)
    eight = tp.self_asked(model, chat, 4, seed=0, batch=8)
    assert eight == tp.self_asked(model, chat, 4, seed=0, batch=8) and len(eight) == 4
    # the deadline passes during the first batch: that batch's questions only, never more
    clock = Clock(1.0)
    monkeypatch.setattr(tp, "time", types.SimpleNamespace(perf_counter=clock))
    first = tp.self_asked(model, chat, 400, seed=0, batch=8, deadline=clock.now + 1.5)
    assert 1 <= len(first) <= 8 and first == tp.self_asked(model, chat, len(first), seed=0, batch=8)
    assert tp.self_asked(model, chat, 4, seed=0, batch=8, deadline=clock.now - 1) == []
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="question batch must be an int >= 1"):
            tp.self_asked(model, chat, 4, seed=0, batch=bad)


def test_continuing_stops_after_the_batch_that_passes_the_deadline(monkeypatch):
    """``continue_prompts(deadline=...)``: the first prompts' rows only, each as an undeadlined run
    makes it, with their own starts; a deadline already passed makes none."""
    model, tok = default_model()
    prompts = [[1, 5, 9], [2, 7], [3, 8, 4, 6], [5, 5], [9, 1, 1]]
    whole, start, _ = tg.continue_prompts(model, tok, prompts, 6, 2, False, "train")
    clock = Clock(1.0)
    monkeypatch.setattr(tg, "time", types.SimpleNamespace(perf_counter=clock))
    cut, cut_start, _ = tg.continue_prompts(model, tok, prompts, 6, 2, False, "train",
                                     deadline=clock.now + 2.5)
    assert 1 <= len(cut) < len(prompts) and len(cut) % 2 == 0  # whole batches of 2
    assert torch.equal(cut, whole[:len(cut)]) and torch.equal(cut_start, start[:len(cut)])
    none, none_start, _ = tg.continue_prompts(model, tok, prompts, 6, 2, False, "train",
                                       deadline=clock.now - 1)
    assert none.shape == (0, whole.shape[1]) and len(none_start) == 0


def test_merging_rows_of_unequal_widths_keeps_each_rows_targets_paths_and_states():
    """``merge_parts`` pads rows to the widest: every sample reads what its own part gives it."""
    g = torch.Generator().manual_seed(0)
    gen = {"tokens": torch.randint(3, 50, (3, 13), generator=g), "start": torch.tensor([4, 6, 5]),
           "hidden": torch.randn(3, 13, 5, generator=g).to(torch.bfloat16)}
    gen["end"] = torch.tensor([13, 9, 11])
    gen["tokens"][1, 9:] = 0  # right padding after the row's end
    cor = {"tokens": torch.randint(3, 50, (2, 30), generator=g), "start": torch.ones(2, dtype=torch.int64),
           "hidden": torch.randn(2, 30, 5, generator=g).to(torch.bfloat16),
           "next": torch.randint(3, 50, (2, 30), generator=g)}
    cor["end"] = torch.full((2,), 30)
    other = {k: v.clone() for k, v in gen.items()}
    other["tokens"], other["hidden"] = other["tokens"][:, :10], other["hidden"][:, :10]
    other["end"] = torch.tensor([10, 9, 10])
    parts = [gen, cor, other]
    merged = hd.merge_parts(parts)
    assert merged["tokens"].shape == (8, 30) and merged["hidden"].shape == (8, 30, 5)
    pm, offset = hf._samples(merged, 3), 0
    for part in parts:
        pp = hf._samples(part, 3)
        mine = (pm[:, 0] >= offset) & (pm[:, 0] < offset + len(part["start"]))
        assert torch.equal(pm[mine] - torch.tensor([offset, 0]), pp)
        y = hf.head_targets(part, pp, 3)
        assert torch.equal(hf.head_targets(merged, pm[mine], 3), y)
        used = y != -100  # where a head learns, the path before it is text (elsewhere clamped)
        assert torch.equal(hf.path_tokens(merged, pm[mine], 3)[used], hf.path_tokens(part, pp, 3)[used])
        assert torch.equal(merged["hidden"][pm[mine][:, 0], pm[mine][:, 1]],
                           part["hidden"][pp[:, 0], pp[:, 1]])
        offset += len(part["start"])
    assert len(pm) == sum(len(hf._samples(p, 3)) for p in parts)
    assert not merged["hidden"][5:, 10:].any()  # the padding of the narrow part


def test_self_asked_questions_are_the_models_own_chat_prompts(tmp_path, monkeypatch):
    """Magpie: the model writes the user's message after the template's text before it;
    seeded; distinct; refused by name without a template or when the model never ends."""
    from rewriter.runtime.chat import chat_prompt, split_tokenizer
    model, tok = default_model()
    _turns_end_at_full_stops(monkeypatch, tok)
    chat = _Templated(tok)
    backend, text = split_tokenizer(chat)
    prompts = tp.self_asked(model, chat, 3, seed=0)
    again = tp.self_asked(model, chat, 3, seed=0)
    assert prompts == again and len({tuple(p) for p in prompts}) == 3
    assert prompts != tp.self_asked(model, chat, 3, seed=1)
    for p in prompts:
        shown = backend.decode(p)
        assert shown.startswith("User: ") and shown.endswith("Assistant:")
        q = shown.removeprefix("User: ").removesuffix("\nAssistant:").strip()
        assert q and p == chat_prompt(backend, text, q)  # the question, as chat lays it out
    with pytest.raises(ValueError, match="need a chat template"):
        tp.self_asked(model, tok, 3, seed=0)
    twice = _Templated(tok)
    twice.chat_template = "{% for m in messages %}{{ m.content }}|{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="does not show the user's message once"):
        tp.self_asked(model, twice, 3, seed=0)
    bare = _Templated(tok)
    bare.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="no text before the user's message"):
        tp.self_asked(model, bare, 3, seed=0)
    monkeypatch.setattr(tp, "QUESTION_TOKENS", 1)  # no room to end a question: none kept
    with pytest.raises(ValueError, match="asked 0 distinct questions .* in 32 tries"):
        tp.self_asked(model, chat, 2, seed=0)
    monkeypatch.setattr(tp, "eos_ids", lambda model, tokenizer: set())
    with pytest.raises(ValueError, match="need an end-of-sequence token"):
        tp.self_asked(model, chat, 2, seed=0)


def test_mixed_data_with_self_asked_questions(tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import load_file
    model, tok = default_model()
    _turns_end_at_full_stops(monkeypatch, tok)
    chat = _Templated(tok)
    kw = {**SMALL, "arch": "hydra", "work_dir": tmp_path / "w"}
    report = th.train_heads(model, chat, tmp_path / "q.safetensors", data="mixed", rows=2,
                            questions=3, **kw)
    assert report["settings"]["questions"] == 3
    magpie = load_file(tmp_path / "w" / "train-magpie.safetensors")
    assert len(magpie["tokens"]) == 3 and "next" not in magpie
    for row, start, p in zip(magpie["tokens"], magpie["start"], tp.self_asked(model, chat, 3, 0)):
        assert row[:start].tolist() == p  # the self-asked questions, answered
    magpie["end"] = hd.row_ends(magpie, SMALL["new_tokens"], hd.eos_ids(model, tok))
    answers = int((magpie["end"] - magpie["start"]).sum())
    assert 3 <= answers <= 3 * SMALL["new_tokens"]
    gen = load_file(tmp_path / "w" / "train.safetensors")
    assert len(gen["tokens"]) == 6 and bool((gen["start"] > 0).all())
    assert report["positions"] == sum(len(hf._samples(d, 2)) for d in (
        {**gen, "end": hd.row_ends(gen, SMALL["new_tokens"], hd.eos_ids(model, tok))},
        {**load_file(tmp_path / "w" / "train-corpus.safetensors"), "end": torch.tensor([24, 24])},
        magpie))
    with safe_open(str(tmp_path / "w" / "train-magpie.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["settings"])["data"] == "magpie"
    with pytest.raises(ValueError, match="questions .* are part of data='mixed'"):
        th.train_heads(model, chat, tmp_path / "x.safetensors", questions=3, **kw)
    for bad in (True, -1, 2.0):  # refused by name, not sent to the template
        with pytest.raises(ValueError, match="questions must be an int >= 0"):
            th.train_heads(model, chat, tmp_path / "x.safetensors", data="mixed", questions=bad,
                           **kw)
    with pytest.raises(ValueError, match="need a chat template"):  # before any data is made
        th.train_heads(model, tok, tmp_path / "x.safetensors", data="mixed", questions=3,
                       **{**kw, "work_dir": tmp_path / "none"})
    assert not (tmp_path / "none" / "train.safetensors").exists()


def test_answering_self_asked_questions_resumes_after_an_interruption(tmp_path, monkeypatch):
    """The questions are kept once asked; an interrupted run answers the same ones, and
    saved rows that do not continue their prompts are made again."""
    from safetensors.torch import load_file
    model, tok = default_model()
    _turns_end_at_full_stops(monkeypatch, tok)
    chat = _Templated(tok)
    kw = {**SMALL, "arch": "hydra", "data": "mixed", "rows": 2, "questions": 4, "epochs": 1,
          "generate_batch": 2}
    th.train_heads(model, chat, tmp_path / "a.safetensors", work_dir=tmp_path / "a", **kw)
    want = load_file(tmp_path / "a" / "train-magpie.safetensors")
    real, saves = tg.save_rows, []

    def crash(path, *args):  # the magpie answers stop after their first batch
        real(path, *args)
        if path.name == "train-magpie.partial.safetensors":
            saves.append(1)
            raise KeyboardInterrupt
    monkeypatch.setattr(tg, "save_rows", crash)
    with pytest.raises(KeyboardInterrupt):
        th.train_heads(model, chat, tmp_path / "b.safetensors", work_dir=tmp_path / "b", **kw)
    monkeypatch.setattr(tg, "save_rows", real)
    asked = tmp_path / "b" / "train-magpie.questions.safetensors"
    assert asked.is_file() and saves == [1]
    monkeypatch.setattr(hd, "self_asked", lambda *a, **k: pytest.fail("asked again"))
    partial = tmp_path / "b" / "train-magpie.partial.safetensors"
    rows, seconds = tg.partial_rows(partial, load_file_key(partial))
    assert len(rows) == 2
    rows[1][0] += 1  # a row that does not continue its prompt: made again, not trained on
    tg.save_rows(partial, rows, load_file_key(partial), seconds)
    th.train_heads(model, chat, tmp_path / "b.safetensors", work_dir=tmp_path / "b", **kw)
    got = load_file(tmp_path / "b" / "train-magpie.safetensors")
    assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["start"], want["start"])


def load_file_key(path):
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()["settings"]


def test_the_cli_trains_heads(tmp_path, capsys):
    from rewriter.cli import main
    out = tmp_path / "h.safetensors"
    assert main(["train-heads", "default", "--out", str(out), "--num-heads", "1", "--prompts", "4",
                 "--new-tokens", "8", "--epochs", "1", "--dtype", "float32", "--batch", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert heads_file.load(out).num_heads == 1 and report["batch"] == 4
    assert report["steps"] == -(-report["positions"] // 4)
    more = tmp_path / "more.safetensors"  # more training from those heads, on other prompts
    assert main(["train-heads", "default", "--out", str(more), "--num-heads", "1", "--prompts", "4",
                 "--new-tokens", "8", "--epochs", "1", "--dtype", "float32", "--init", str(out),
                 "--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["init"]["file"] == "h.safetensors"
    # the same data again would count its tokens twice: refused
    assert main(["train-heads", "default", "--out", str(tmp_path / "x.safetensors"), "--num-heads",
                 "1", "--prompts", "4", "--new-tokens", "8", "--epochs", "1", "--dtype", "float32",
                 "--init", str(out)]) != 0
    assert "trained on this very data" in capsys.readouterr().err


def test_hydra_training_is_seeded_resumes_and_learns_from_the_path(tmp_path, monkeypatch):
    model, tok = default_model()
    kw = {**SMALL, "arch": "hydra", "work_dir": tmp_path / "work"}
    th.train_heads(model, tok, tmp_path / "a.safetensors", **kw)
    a = heads_file.load(tmp_path / "a.safetensors", "hydra")
    assert a.arch == "hydra" and [tuple(w.shape) for w in a.w] == [(256, 512), (256, 768)]
    assert all(w[:, 256:].abs().sum() > 0 for w in a.w)  # the path's embeddings are read
    monkeypatch.setattr(hf, "CHECKPOINT_EVERY", 1)
    real, calls = heads_file.apply_hydra, []

    def crash(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(heads_file, "apply_hydra", crash)
    kw["work_dir"] = tmp_path / "work-b"
    with pytest.raises(KeyboardInterrupt):
        th.train_heads(model, tok, tmp_path / "b.safetensors", **kw)
    monkeypatch.setattr(heads_file, "apply_hydra", real)
    th.train_heads(model, tok, tmp_path / "b.safetensors", **kw)
    b = heads_file.load(tmp_path / "b.safetensors", "hydra")
    assert all(torch.equal(x, y) for x, y in zip(a.w, b.w)) and torch.equal(a.b, b.b)
    with pytest.raises(ValueError, match="arch"):
        th.train_heads(model, tok, tmp_path / "c.safetensors", **{**SMALL, "arch": "eagle"})


def test_samples_stop_at_each_rows_end_not_at_the_padding():
    """Rows of unequal prompts are right-padded; an EOS ends a row's text early."""
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 0, 0],    # prompt 2, 4 generated, 2 padding
                           [1, 2, 3, 4, 11, 2, 13, 14]])  # prompt 4, EOS (2) after one token
    data = {"tokens": tokens, "start": torch.tensor([2, 4])}
    data["end"] = hd.row_ends(data, 4, {2})
    assert data["end"].tolist() == [6, 6]
    pairs = hf._samples(data, 2)
    assert pairs.tolist() == [[0, 1], [0, 2], [0, 3], [1, 3]]
    targets = hf.head_targets(data, pairs, 2)
    assert targets.tolist() == [[8, 9], [9, 10], [10, -100], [2, -100]]
    assert hd.produced(data, 16).sum() == 4 + 2 and hd.produced(data, 16)[0] == 0


def test_generating_the_data_resumes_after_an_interruption(tmp_path, monkeypatch):
    model, tok = default_model()
    kw = {**SMALL, "num_heads": 1, "epochs": 1, "generate_batch": 2}
    th.train_heads(model, tok, tmp_path / "a.safetensors", **kw)
    real, calls = tg.save_rows, []

    def crash(*args):
        real(*args)
        calls.append(1)
        if len(calls) == 2:  # two batches of four made and saved
            raise KeyboardInterrupt
    monkeypatch.setattr(tg, "save_rows", crash)
    with pytest.raises(KeyboardInterrupt):
        th.train_heads(model, tok, tmp_path / "b.safetensors", **kw)
    monkeypatch.setattr(tg, "save_rows", real)
    made, real_partial = [], tg.partial_rows

    def partial(*args):
        rows, seconds = real_partial(*args)
        made.append((len(rows), seconds))
        return rows, seconds
    monkeypatch.setattr(tg, "partial_rows", partial)
    th.train_heads(model, tok, tmp_path / "b.safetensors", **kw)
    assert [n for n, _ in made] == [4, 0]  # train resumed after its saved rows; held-out afresh
    from safetensors import safe_open
    with safe_open(str(tmp_path / "b.safetensors.work" / "train.safetensors"), "pt") as f:
        total = float(f.metadata()["seconds"])
    assert made[0][1] > 0 and total > made[0][1]  # the interrupted run's time is counted
    from safetensors.torch import load_file
    for split in ("train", "heldout"):
        a = load_file(str(tmp_path / "a.safetensors.work" / f"{split}.safetensors"))
        b = load_file(str(tmp_path / "b.safetensors.work" / f"{split}.safetensors"))
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["start"], b["start"])
    assert not (tmp_path / "b.safetensors.work" / "train.partial.safetensors").exists()



def test_the_teacher_is_the_models_distribution_at_each_heads_target(tmp_path):
    """``loss="teacher"``: head k at position t learns the model's distribution over the
    token at t + k + 2; on greedy continuations its argmax is that token."""
    model, tok = default_model()
    kw = {**SMALL, "num_heads": 3, "work_dir": tmp_path / "work"}
    th.train_heads(model, tok, tmp_path / "tokens.safetensors", **kw)
    report = th.train_heads(model, tok, tmp_path / "teacher.safetensors", **kw, loss="teacher")
    assert report["loss"] == "teacher"
    a = heads_file.load(tmp_path / "tokens.safetensors")
    b = heads_file.load(tmp_path / "teacher.safetensors")
    assert not torch.equal(a.w, b.w)  # the checkpoint of the other loss was not resumed
    from safetensors.torch import load_file
    data = load_file(str(tmp_path / "work" / "train.safetensors"))
    data["end"] = hd.row_ends(data, SMALL["new_tokens"], hd.eos_ids(model, tok))
    pairs = hf._samples(data, 3)
    targets = hf.head_targets(data, pairs, 3)
    head = model.get_output_embeddings().weight.detach()
    probs = hf._teacher(data["hidden"], pairs[:, :1], hf._teacher_positions(pairs, 3), head, "cpu")
    assert probs.shape == (len(pairs), 3, head.shape[0])
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(pairs), 3))
    valid = targets != -100
    agree = (probs.argmax(-1) == targets)[valid].float().mean()
    assert valid.sum() > 50 and agree > 0.98  # shifted by one position it would be near 0
    with pytest.raises(ValueError, match="loss"):
        th.train_heads(model, tok, tmp_path / "c.safetensors", **SMALL, loss="kl")


def test_teacher_training_on_one_hot_distributions_is_token_training(tmp_path, monkeypatch):
    """The soft cross-entropy of the teacher run, fed one-hot distributions of the targets,
    trains what the token run trains; fed the tokens one position off, it does not: the
    teacher reaches ``_train`` at the right rows, positions and samples of each batch."""
    from safetensors.torch import load_file
    model, tok = default_model()
    kw = {**SMALL, "num_heads": 3, "epochs": 8, "lr": 0.2, "work_dir": tmp_path / "work"}
    th.train_heads(model, tok, tmp_path / "tokens.safetensors", **kw)
    tokens = load_file(str(tmp_path / "work" / "train.safetensors"))["tokens"]
    vocab = model.get_output_embeddings().weight.shape[0]

    def teacher(shift):
        def one_hot(hidden, rows, at, head, device):  # the token ``shift`` after ``at``
            nxt = tokens[rows.expand_as(at), (at + shift).clamp(max=tokens.shape[1] - 1)]
            return torch.nn.functional.one_hot(nxt, vocab).float()
        return one_hot
    a = heads_file.load(tmp_path / "tokens.safetensors")
    scale = a.w.float().abs().max()
    assert scale > 0.01  # trained far enough for a misplaced teacher to show
    for shift, close in ((1, True), (2, False)):
        work = tmp_path / f"work{shift}"  # the data, not the other run's finished checkpoint
        work.mkdir()
        for split in ("train", "heldout"):
            shutil.copy(tmp_path / "work" / f"{split}.safetensors", work)
        monkeypatch.setattr(hf, "_teacher", teacher(shift))
        th.train_heads(model, tok, tmp_path / f"t{shift}.safetensors", **{**kw, "work_dir": work},
                       loss="teacher")
        b = heads_file.load(tmp_path / f"t{shift}.safetensors")
        gap = (a.w.float() - b.w.float()).abs().max() / scale
        assert (gap < 0.02) == close, (shift, gap)


@pytest.mark.parametrize("family", ["llama-gqa-3l", "qwen2-mqa-3l", "mistral-window-3l", "gpt2-3l"])
def test_hidden_states_are_the_lm_heads_input(family):
    """The heads' training reads the decoder's last hidden state (no vocabulary projection):
    the input the model's own LM head turns into its logits. (One chunk: a product's
    rounding may depend on how many rows it holds.)"""
    from conftest import make_model
    model = make_model(family).eval()
    tokens = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    h, nxt = tg.hidden_states(model, tokens, progress=False, split="train", chunk=3, argmax=True)
    with torch.inference_mode():
        full = model(tokens, output_hidden_states=True)
    assert h.dtype == torch.bfloat16 and h.shape == full.hidden_states[-1].shape
    assert torch.equal(h, full.hidden_states[-1].to(torch.bfloat16))
    lm = model.get_output_embeddings()
    with torch.inference_mode():
        assert torch.allclose(lm(h.float()), full.logits, atol=0.05 * full.logits.abs().max())
    assert torch.equal(nxt, full.logits.argmax(-1))  # [3, 11]: corpus rows' targets


def test_greedy_tokens_from_a_reused_logits_buffer_with_and_without_bias():
    """The corpus rows' greedy tokens are computed into one logits buffer (a fresh block a
    row fragmented the heap): the LM head's own argmax, with a bias or without."""
    torch.manual_seed(0)
    row = torch.randn(7, 16)
    buf = torch.empty(7, 50)
    for bias in (False, True):
        lm = torch.nn.Linear(16, 50, bias=bias)
        with torch.no_grad():
            assert torch.equal(tg._greedy(lm, row, buf), lm(row).argmax(-1))


def test_a_run_traces_the_model_once(tmp_path, monkeypatch, engine):
    """Every prompt set a run makes (training and held-out rows) is continued by one
    optimized engine: tracing the model takes seconds. Outside a run each call makes its own.
    (Each trace counted is the file's one engine, not traced again.)"""
    for module in (tg, tp):  # what this test counts
        monkeypatch.setattr(module, "engine_of", OWN_ENGINE)
    model, tok = default_model()
    made = []
    monkeypatch.setattr(rewriter, "optimize", lambda *a, **k: made.append(1) or engine)
    th.train_heads(model, tok, tmp_path / "a.safetensors", **SMALL)
    assert len(made) == 1 and not tg._SHARED
    tg.continue_prompts(model, tok, [[1, 2, 3]], 2, 1, False, "train")
    tg.continue_prompts(model, tok, [[1, 2, 3]], 2, 1, False, "train")
    assert len(made) == 3
