"""Adaptation to KV sharing (``rewriter train-share``) and its weights file
(``ShareKV(..., weights=FILE)``): a few steps lower the distillation loss and change only
the owners' K/V projections (and with ``queries`` the readers' query projections); an
interrupted run resumes to the uninterrupted result; the file loads into the map and model
it was trained for and refuses any other, and any tensor out of place, by name.

Fast: the shipped default model, rows of 48 tokens, a few steps, one held-out chunk."""
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import rewriter
from rewriter.api.eval import heldout_chunks
from rewriter.cli import main
from rewriter.errors import PassError
from rewriter.passes import ShareKV, from_spec, to_spec
from rewriter.training import share_program
from rewriter.training.train_share import train_share

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("train_share")

FAST = dict(steps=6, lr=3e-3, batch=2, length=48, rows=8, eval_chunks=1, eval_length=32,
            save_every=2, progress=False)
KV = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 2, 4, 6) for p in ("k", "v")]


@pytest.fixture(scope="module")
def default():
    model, tok = rewriter.default_model()
    return model, tok, rewriter.trace(model, tokenizer=tok)


@pytest.fixture(scope="module")
def trained(default, tmp_path_factory):
    """A finished CLA2 run (``init="mean"``): its file, report and work directory."""
    out = tmp_path_factory.mktemp("share") / "cla2.safetensors"
    report = train_share(default[2], default[1], out, every=2, init="mean", **FAST)
    return out, report


def heldout_ids(tok):
    """Two held-out chunks of code, 64 tokens each."""
    return heldout_chunks(tok, 2, 64, "code")


def _tensors(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_a_few_steps_lower_the_loss_from_the_group_mean(default, trained):
    model, _, _ = default
    out, report = trained
    history = report["kl_history"]
    assert len(history) == FAST["steps"] and history[-1] < 0.8 * history[0]
    # the start: each owner's K/V the mean of its group's, read off the Hugging Face module
    start, _ = _tensors(out.with_name(out.name + ".work") / "start.safetensors")
    layers = model.model.layers
    for owner in (0, 2, 4, 6):
        for p in ("k", "v"):
            group = [getattr(layers[i].self_attn, f"{p}_proj").weight for i in (owner, owner + 1)]
            torch.testing.assert_close(start[f"model.layers.{owner}.self_attn.{p}_proj.weight"],
                                       (group[0] + group[1]).detach() / 2)
    assert report["quality"]["after"]["kv_bytes_per_token"] * 2 == \
        report["quality"]["plain"]["kv_bytes_per_token"]


def test_only_the_owners_kv_projections_change(default, trained):
    out, _ = trained
    tensors, meta = _tensors(out)
    assert sorted(tensors) == sorted(KV)
    assert json.loads(meta["sources"]) == {"1": 0, "3": 2, "5": 4, "7": 6}
    plain = rewriter.optimize(default[2], passes=[ShareKV(every=2)]).ir.weights()
    adapted = rewriter.optimize(default[2], passes=[ShareKV(every=2, weights=str(out))]).ir.weights()
    assert plain.keys() == adapted.keys()
    for name in plain:
        same = torch.equal(plain[name], adapted[name])
        assert same != (name in KV), name
        if name in KV:
            assert torch.equal(adapted[name], tensors[name])


def test_queries_train_the_readers_query_projections_too(default, tmp_path):
    out = tmp_path / "q.safetensors"
    train_share(default[2], default[1], out, last=2, init="owner", queries=True,
                **{**FAST, "steps": 2})
    tensors, _ = _tensors(out)
    assert sorted(tensors) == sorted([f"model.layers.5.self_attn.{p}_proj.weight" for p in "kv"]
                                     + [f"model.layers.{i}.self_attn.q_proj.weight" for i in (6, 7)])
    model = default[0].model.layers
    owner_k = tensors["model.layers.5.self_attn.k_proj.weight"]
    assert not torch.equal(owner_k, model[5].self_attn.k_proj.weight.detach())


def test_pass_key_rows_ask_for_a_key_given_earlier(default):
    from rewriter.training.train_share import _rows
    tok = default[1].backend_tokenizer if hasattr(default[1], "backend_tokenizer") else default[1]
    rows = _rows(default[1], 8, 128, 0, passkey=0.25)
    assert rows.shape == (8, 128)
    texts = [tok.decode(r.tolist()) for r in rows]
    asked = [t for t in texts if "What is the pass key? The pass key is" in t]
    assert len(asked) == 2
    for t in asked:  # the answer given is the key hidden before the question
        key = re.search(r"The pass key is (\d+)\. Remember it", t).group(1)
        assert f"What is the pass key? The pass key is {key}" in t


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(default, trained, tmp_path,
                                                              monkeypatch):
    out = tmp_path / "r.safetensors"
    calls = []
    loss = share_program.distill_loss

    def fails_at_step_five(student, teacher):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return loss(student, teacher)

    monkeypatch.setattr("rewriter.training.train_share.distill_loss", fails_at_step_five)
    with pytest.raises(KeyboardInterrupt):
        train_share(default[2], default[1], out, every=2, init="mean", **FAST)
    monkeypatch.setattr("rewriter.training.train_share.distill_loss", loss)
    report = train_share(default[2], default[1], out, every=2, init="mean", **FAST)
    assert report["resumed_at"] == 4  # the checkpoint of step 4 (every 2 steps)
    assert report["kl_history"] == trained[1]["kl_history"]
    got, _ = _tensors(out)
    want, _ = _tensors(trained[0])
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_runtime_with_adapted_weights_equals_the_whole_sequence_graph(default, trained):
    opt = rewriter.optimize(default[2], passes=[ShareKV(every=2, weights=str(trained[0]))])
    ids = torch.tensor([[0, 5, 9, 14, 2, 7, 30, 11, 4, 8, 100, 3]])
    with torch.no_grad():
        logits = share_program.program(opt.ir)(*share_program.inputs(opt.ir, ids))
    want = torch.log_softmax(logits.float(), -1)[0, 3:-1].gather(-1, ids[0, 4:, None])[:, 0]
    torch.testing.assert_close(opt.score(ids, 4)[0], want, rtol=1e-4, atol=1e-4)


def test_the_pass_with_weights_round_trips_as_a_spec(trained):
    p = ShareKV(every=2, weights=str(trained[0]))
    assert f"weights={str(trained[0])!r}" in repr(p)
    again = from_spec(to_spec(p))
    assert again.params() == p.params()
    assert from_spec(f'share_kv:every=2,weights="{trained[0]}"').weights == str(trained[0])


def test_an_artifact_keeps_the_adapted_weights_without_the_file(default, trained, tmp_path):
    copy = tmp_path / "w.safetensors"
    copy.write_bytes(trained[0].read_bytes())
    opt = rewriter.optimize(default[2], passes=[ShareKV(every=2, weights=str(copy))])
    opt.save(tmp_path / "a")
    copy.unlink()  # the artifact holds the tensors; the path is only its record
    back = rewriter.load(tmp_path / "a")
    tensors, _ = _tensors(trained[0])
    assert all(torch.equal(back.ir.weight(k), v) for k, v in tensors.items())
    ids = torch.tensor([[0, 5, 9, 14, 2, 7]])
    assert torch.equal(back.generate(ids, max_new_tokens=6), opt.generate(ids, max_new_tokens=6))
    assert back.kv_bytes_per_token() * 2 == rewriter.optimize(default[2]).kv_bytes_per_token()


def test_the_shipped_default_weights_adapt_the_default_models_cla2(default):
    ids = heldout_ids(default[1])
    plain, untrained, adapted = (
        rewriter.optimize(default[2], passes=p) for p in
        ([], [ShareKV(every=2)], [ShareKV(every=2, weights="default")]))
    nll = [-o.score(ids, 32).mean().item() for o in (plain, untrained, adapted)]
    assert nll[0] < nll[2] < nll[1]  # closer to the model than sharing alone
    assert adapted.kv_bytes_per_token() * 2 == plain.kv_bytes_per_token()
    _refused(default, "default", "trained for the sharing map", last=4)


def _rewrite(src, dst, tensors=None, **meta):
    """A copy of the weights file ``src`` at ``dst`` with tensors or metadata replaced."""
    old, old_meta = _tensors(src)
    save_file(old if tensors is None else tensors, str(dst), {**old_meta, **meta})
    return dst


def _refused(default, weights, match, **sharing):
    with pytest.raises(PassError, match=match):
        rewriter.optimize(default[2], passes=[ShareKV(**(sharing or {"every": 2}),
                                                      weights=str(weights))])


def test_a_file_for_another_map_or_model_is_refused(default, trained, tmp_path):
    out = trained[0]
    _refused(default, out, "trained for the sharing map", every=4)
    _refused(default, out, "trained for the sharing map", sources={1: 0})
    model = json.loads(_tensors(out)[1]["model"])
    probe = [[v + 1 for v in row] for row in model["probe"]]
    _refused(default, _rewrite(out, tmp_path / "m.st", model=json.dumps({**model, "probe": probe})),
             "another model .its LM head")
    _refused(default, _rewrite(out, tmp_path / "h.st", model=json.dumps({**model, "head_dim": 64})),
             "another model .head_dim")
    # the same map given explicitly is the same map
    rewriter.optimize(default[2], passes=[ShareKV(sources={1: 0, 3: 2, 5: 4, 7: 6},
                                                  weights=str(out))])


def test_bad_tensors_and_hostile_files_are_refused_by_name(default, trained, tmp_path):
    out = trained[0]
    good, _ = _tensors(out)
    name = KV[0]
    cases = {
        "lacks model.layers.0.self_attn.k_proj.weight": {k: v for k, v in good.items() if k != name},
        "holds model.layers.1.self_attn.k_proj.weight, which this sharing does not train":
            {**good, "model.layers.1.self_attn.k_proj.weight": good[name].clone()},
        r"k_proj.weight is \[64, 128\]": {**good, name: torch.zeros(64, 128)},
        "NaN or infinite": {**good, name: torch.full_like(good[name], float("nan"))},
        "not a float tensor": {**good, name: torch.zeros_like(good[name], dtype=torch.int32)},
    }
    for i, (match, tensors) in enumerate(cases.items()):
        _refused(default, _rewrite(out, tmp_path / f"{i}.st", tensors), match)
    _refused(default, _rewrite(out, tmp_path / "f.st", format="rewriter-heads"), "not a rewriter-share-kv")
    _refused(default, _rewrite(out, tmp_path / "s.st", sources="[[[["), "bad metadata")
    (tmp_path / "junk.st").write_bytes(b"\xff" * 64)
    _refused(default, tmp_path / "junk.st", "not a safetensors file")
    _refused(default, tmp_path / "none.st", "no such weights file")
    with pytest.raises(ValueError, match="weights must be a file's path"):
        ShareKV(every=2, weights=3)


@pytest.mark.parametrize("argv, match", [
    (["--every", "2", "--init", "zero"], "argument --init: invalid choice"),
    (["--every", "1"], "every must be an integer >= 2"),
    (["--sources", "{3: 2}"], "--sources must be a JSON map"),
    (["--sources", '{"1": 3}'], "sources maps a layer to an earlier one"),
    (["--every", "2", "--last", "2"], "not allowed with argument --every"),
    (["--every", "2", "--steps", "0"], "steps must be an integer"),
    (["--every", "2", "--lr", "2"], "lr must be a number in"),
    (["--every", "2", "--batch", "9", "--rows", "8"], "batch .9. must be at most rows"),
    (["--every", "2", "--device", "tpu"], "is not a device"),
    (["--every", "2", "--passkey", "1.5"], "passkey must be a fraction"),
    ([], "one of the arguments --every --last --sources is required"),
])
def test_the_command_refuses_bad_arguments_before_loading(argv, match, tmp_path, capsys):
    assert main(["train-share", "default", "--out", str(tmp_path / "o.safetensors"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rewriter: error:") and re.search(match, err), err
    assert list(tmp_path.iterdir()) == []


def test_the_command_refuses_an_out_that_is_another_kind_of_file(tmp_path, capsys):
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    assert main(["train-share", "default", "--out", str(other), "--every", "2"]) == 2
    assert "rewriter: error:" in capsys.readouterr().err and other.read_text() == "mine"


@pytest.mark.parametrize("name", ["length", "eval_length"])
def test_lengths_past_the_context_are_refused_before_training(default, tmp_path, name):
    """The default model holds 1024 tokens: rows of more would train positions it never
    saw (and its evaluation would refuse them only after the file was written)."""
    out = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match=rf"{name} 1100 is past the model's context length \(1024\)"):
        train_share(default[2], default[1], out, every=2, **{**FAST, name: 1100})
    assert not out.exists() and not (tmp_path / "x.safetensors.work").exists()
