"""``rewriter train-eagle`` fails as the other training commands do: one ``rewriter: error:``
line, status 2, nothing written; a device, a path, a seed, a length or a budget that
cannot be used is refused before the model loads. And one short run on the default model
writes a draft file ``EagleDraft(weights=...)`` loads, with its report.

Fast: the run's questions, answers and steps are a handful, its held-out code prompts two
(about 25 CPU-seconds, most of them tracing the model and asking)."""
import json
import shlex

import pytest
import torch

import rewriter
from rewriter.models import checkpoints
from rewriter.drafts import eagle_file
from rewriter.training import prompts, train_eagle_data
from rewriter.cli import main
from rewriter.passes import EagleDraft
from test_train_cli_errors import _dir, _file, _link, listing, one_error_line
from test_train_heads import _Templated

TINY = ["--questions", "2", "--question-batch", "8", "--code-prompts", "2", "--new-tokens", "6",
        "--generate-batch", "16", "--chat-heldout", "1", "--steps", "2", "--rows", "4",
        "--positions", "32", "--depth", "2", "--reserve", "0", "--seconds", "3600",
        "--device", "cpu"]
EAGLE = ["train-eagle", "default"] + TINY

# (extra argv with {tmp}, a fragment of the error line; every row fails before the model loads)
EARLY = [
    ("--out {tmp}/o --device cuda:4096", "'cuda:4096': no such CUDA device"),
    ("--out {tmp}/o --device mps", "'mps': training runs on cpu or cuda"),
    ("--out {tmp}/o --device foo", "'foo' is not a device"),
    ("--out ''", "out must name a folder, got ''"),
    ("--out {tmp}/notes.txt", "out {tmp}/notes.txt exists and is not a folder"),
    ("--out {tmp}/notes.txt/o", "notes.txt is a file, not a directory"),
    ("--out {tmp}/d --data {tmp}/notes.txt", "data {tmp}/notes.txt exists and is not a folder"),
    ("--out {tmp}/d --data ''", "data must name a folder, got ''"),
    ("--out {tmp}/d --init {tmp}/none.safetensors", "init {tmp}/none.safetensors: no such draft file"),
    ("--out {tmp}/d --init ' '", "init must be a draft file's path"),
    ("--out {tmp}/o --seed -1", "seed must be an int in [0, 2**32), got -1"),
    ("--out {tmp}/o --seed 4294967296", "seed must be an int in [0, 2**32)"),
    ("--out {tmp}/o --new-tokens 3", "new_tokens must be at least depth + 2 = 4, got 3"),
    ("--out {tmp}/o --steps 0", "steps must be an int >= 1, got 0"),
    ("--out {tmp}/o --chat-heldout 0", "chat_heldout must be an int >= 1, got 0"),
    ("--out {tmp}/o --train-vocab 5", "train_vocab must be 0 (the whole vocabulary) or an int >= 10"),
    ("--out {tmp}/o --seconds nan", "seconds must be a finite number, got nan"),
    ("--out {tmp}/o --lr=-inf", "lr must be a finite number, got -inf"),
    ("--out {tmp}/o --lr 0", "seconds and lr must be > 0 and reserve >= 0"),
    ("--out {tmp}/o --ask 0.6", "need 0 < ask < answer < 1"),
    ("--out {tmp}/o --seconds 30 --reserve 30", "reserve (30.0 s) leaves no time to train"),
    ("--out {tmp}/o --save-dtype float16", "argument --save-dtype: invalid choice: 'float16'"),
]


@pytest.mark.parametrize("argv,fragment", EARLY, ids=[a for a, _ in EARLY])
def test_refused_before_the_model_loads(argv, fragment, tmp_path, capsys, monkeypatch):
    _link(tmp_path), _file(tmp_path), _dir(tmp_path)
    before = listing(tmp_path)

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(checkpoints, "load_model", loaded)
    assert main(EAGLE + shlex.split(argv.format(tmp=tmp_path))) == 2
    one_error_line(capsys, fragment.format(tmp=tmp_path))
    assert listing(tmp_path) == before  # nothing written, the file and the link's target unchanged


@pytest.mark.parametrize("name,fragment", [
    ("eagle.safetensors", "eagle.safetensors exists and is not a draft file"),
    ("train_eagle.json", "train_eagle.json exists and is not a training report"),
])
def test_a_file_in_out_that_is_not_the_commands_is_kept(name, fragment, tmp_path, capsys, monkeypatch):
    """A file of the user's where the draft or the report would go: it would be lost."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / name).write_text("someone's notes")
    monkeypatch.setattr(checkpoints, "load_model", lambda *a, **k: pytest.fail("loaded"))
    before = listing(tmp_path)
    assert main(EAGLE + ["--out", str(tmp_path / "d")]) == 2
    one_error_line(capsys, fragment)
    assert listing(tmp_path) == before


def test_a_link_where_the_draft_goes_is_refused(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    _link(tmp_path)
    (tmp_path / "link").rename(tmp_path / "d" / "eagle.safetensors")
    assert main(EAGLE + ["--out", str(tmp_path / "d")]) == 2
    one_error_line(capsys, "eagle.safetensors is a symbolic link")


def test_an_artifact_or_a_too_long_answer_is_refused_before_any_data(tmp_path, capsys):
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "artifact.json").write_text(json.dumps({"format": "rewriter-artifact",
                                                        "format_version": 2}))
    argv = ["train-eagle", str(artifact)] + TINY + ["--out", str(tmp_path / "o")]
    assert main(argv) == 2
    one_error_line(capsys, "is an artifact; training needs the checkpoint")
    assert main(EAGLE + ["--out", str(tmp_path / "o"), "--new-tokens", "2000"]) == 2
    one_error_line(capsys, "prompt_tokens + new_tokens = 64 + 2000 = 2064 exceeds the model's "
                           "context length, 1024 tokens")
    assert not (tmp_path / "o").exists()


@pytest.fixture()
def chat_model(monkeypatch):
    """The default model with a chat template (it has none), whose turns end at a full
    stop; questions of at most 16 tokens (not 64) and two held-out code prompts (not 48)."""
    model, tok = rewriter.default_model()
    stop = _Templated(tok).backend_tokenizer.token_to_id(".")
    monkeypatch.setattr(checkpoints, "load_model", lambda path, dtype: (model, _Templated(tok)))
    for module in (prompts, train_eagle_data):
        monkeypatch.setattr(module, "eos_ids", lambda model, tokenizer: {stop})
    monkeypatch.setattr(train_eagle_data, "HELD_CODE", 2)
    monkeypatch.setattr(prompts, "QUESTION_TOKENS", 16)
    return model


def test_a_short_run_writes_a_draft_the_pass_loads(chat_model, tmp_path, capsys):
    out = tmp_path / "new" / "eagle"
    assert main(EAGLE + ["--out", str(out)]) == 0
    assert f"saved: {out / 'eagle.safetensors'}" in capsys.readouterr().out
    draft = eagle_file.load(out / "eagle.safetensors")
    draft.fits(chat_model.lm_head.weight.detach(), "the run's draft")
    assert draft.trained["steps"] == 2 and draft.trained["seed"] == 11 and draft.trained["depth"] == 2
    assert len(draft.accuracy) == 2 and int(draft.counts.sum()) > 0
    assert EagleDraft(weights=str(out / "eagle.safetensors")).draft.shape == draft.shape
    report = json.loads((out / "train_eagle.json").read_text())
    assert report["steps"] == 2 and report["args"]["questions"] == 2
    assert report["data"]["heldout_code_rows"] == 2 and report["data"]["chat_rows"] >= 1
    assert sorted(p.name for p in out.iterdir()) == ["eagle.safetensors", "train_eagle.json"]
    assert all(torch.isfinite(t).all() for t in draft.params.values())


def test_a_model_without_a_chat_template_is_refused_by_this_command_before_any_work(tmp_path, capsys, monkeypatch):
    """The default model has no chat template: refused once it is loaded, named as
    train_eagle's problem, before the runtime traces it or anything is written."""
    def traced(model):
        raise AssertionError("the model was traced before its chat template was checked")
    monkeypatch.setattr(train_eagle_data, "one_engine", traced)
    assert main(EAGLE + ["--out", str(tmp_path / "o")]) == 2
    one_error_line(capsys, "train_eagle: self-asked questions need a chat template")
    assert not (tmp_path / "o").exists()
