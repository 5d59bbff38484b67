"""``rewriter train-eagle --data``: each run keeps its rows (``eagle_data``), later runs
train on them too (never on this run's held-out questions), a cut-short run takes its own
back, and a hostile file stops the run with its name."""
import json
import types

import pytest
import torch
from safetensors.torch import save_file

from rewriter.training import eagle_data
from rewriter.drafts import heads as heads_file
from rewriter.training.train_eagle_checks import rows_of

VOCAB = 50
LM = torch.randn(VOCAB, 16, generator=torch.Generator().manual_seed(0))  # the model's LM head


def _rows(seed=5, n=4, width=12, new_tokens=6, kind=(0, 1, 2, 1), held=1):
    g = torch.Generator().manual_seed(seed)
    return eagle_data.Rows(tokens=torch.randint(0, VOCAB, (n, width), generator=g),
                           start=torch.full((n,), width - new_tokens),
                           kind=torch.tensor(kind[:n]), seed=seed, new_tokens=new_tokens,
                           chat_heldout=held)


def test_rows_round_trip(tmp_path):
    rows = _rows()
    path = eagle_data.save(tmp_path / "d", rows, LM)
    assert path.name == "rows-5.safetensors" and not list((tmp_path / "d").glob("*.tmp"))
    back = eagle_data.load(path, LM)
    for k in ("tokens", "start", "kind"):
        assert torch.equal(getattr(back, k), getattr(rows, k))
    assert (back.seed, back.new_tokens, back.chat_heldout) == (5, 6, 1)


def test_rows_of_another_model_are_refused(tmp_path):
    path = eagle_data.save(tmp_path, _rows(), LM)
    with pytest.raises(eagle_data.RowsError, match="answered by another model: .*weights differ"):
        eagle_data.load(path, LM + 1)  # the same vocabulary, another model
    with pytest.raises(eagle_data.RowsError, match="vocabulary of 50, the model has 49"):
        eagle_data.load(path, LM[:49])


def test_earlier_runs_are_the_other_seeds_with_the_same_answers(tmp_path):
    for seed in (3, 5, 7):
        eagle_data.save(tmp_path, _rows(seed), LM)
    (tmp_path / "notes.txt").write_text("not a rows file")  # other files are not read
    assert [r.seed for r in eagle_data.earlier(tmp_path, 5, LM, 6)] == [3, 7]
    with pytest.raises(eagle_data.RowsError, match="answers of 6 tokens, this run's --new-tokens is 9"):
        eagle_data.earlier(tmp_path, 5, LM, 9)


def _hostile(tmp_path, tensors, name="rows-5.safetensors", **meta):
    path = tmp_path / name
    meta = {"seed": "5", "new_tokens": "6", "vocab": str(VOCAB), "chat_heldout": "1",
            "probe": json.dumps(heads_file.probe_of(LM)), **meta}
    save_file(tensors, str(path), metadata=meta)
    return path


GOOD = {"tokens": torch.zeros(2, 12, dtype=torch.int64), "start": torch.tensor([6, 6]),
        "kind": torch.tensor([1, 2])}


@pytest.mark.parametrize("change, match", [
    (dict(tokens=torch.full((2, 12), VOCAB)), r"token ids outside \[0, 50\)"),
    (dict(tokens=torch.full((2, 12), -1)), r"token ids outside"),
    (dict(start=torch.tensor([6, 7])), "no room for its 6 tokens"),
    (dict(start=torch.tensor([0, 6])), "leaves no prompt"),
    (dict(start=torch.tensor([6, 2 ** 63 - 1])), "no room for its 6 tokens"),  # no int64 wrap
    (dict(kind=torch.tensor([1, 4])), "kinds must be"),
    (dict(kind=torch.tensor([1])), "start, kind"),
    (dict(tokens=torch.zeros(2, 12, dtype=torch.int32)), "all int64"),
    (dict(tokens=torch.zeros(2, 12, 1, dtype=torch.int64)), r"tokens must be \[N, L\]"),
    (dict(tokens=torch.zeros(2, 0, dtype=torch.int64)), "out of range for 2 rows of 0 tokens"),
])
def test_a_hostile_file_is_refused_by_name(tmp_path, change, match):
    with pytest.raises(eagle_data.RowsError, match="rows-5.safetensors: .*" + match):
        eagle_data.load(_hostile(tmp_path, {**GOOD, **change}), LM)


@pytest.mark.parametrize("meta, match", [
    (dict(new_tokens="99999999999999999999"), "out of range"),
    (dict(new_tokens="0"), "out of range"),
    (dict(chat_heldout="3"), "out of range"),
    (dict(new_tokens="six"), "not a rows file"),
    (dict(probe="[[1]]"), "probe is not a 4 x 8 matrix"),
    (dict(probe="{"), "not a rows file"),
    (dict(seed="8"), "its name is not rows-8.safetensors"),
])
def test_hostile_metadata_is_refused_by_name(tmp_path, meta, match):
    with pytest.raises(eagle_data.RowsError, match="rows-5.safetensors: .*" + match):
        eagle_data.load(_hostile(tmp_path, GOOD, **meta), LM)


def test_a_seed_has_one_file_name(tmp_path):
    """``rows-05`` is not seed 5's file: a copy under it would be trained on twice."""
    eagle_data.save(tmp_path, _rows(5), LM)
    (tmp_path / "rows-05.safetensors").write_bytes((tmp_path / "rows-5.safetensors").read_bytes())
    with pytest.raises(eagle_data.RowsError, match="rows-05.safetensors: its name is not rows-5"):
        eagle_data.earlier(tmp_path, 7, LM, 6)


def test_a_torn_file_is_refused_by_name(tmp_path):
    torn = tmp_path / "rows-5.safetensors"
    torn.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(eagle_data.RowsError, match="rows-5.safetensors: not a rows file"):
        eagle_data.load(torn, LM)


def test_padded_rows_of_several_runs():
    a, b = torch.ones(2, 3, dtype=torch.int64), torch.full((1, 5), 2)
    assert eagle_data.padded([a, b]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [2] * 5]


def test_earlier_rows_train_and_never_ask_a_held_out_question_again():
    # this run: held-out code, two chat rows (the last one held out), a code row
    tokens = torch.tensor([[1, 2, 9, 9], [3, 4, 9, 9], [5, 6, 9, 9], [7, 8, 9, 9]])
    start, kinds = torch.tensor([2, 2, 2, 2]), torch.tensor([0, 1, 1, 2])
    old = eagle_data.Rows(  # an earlier run of wider rows: held-out code, chat, code, chat
        tokens=torch.tensor([[1, 2, 7, 7, 7], [5, 6, 8, 8, 8], [4, 4, 4, 8, 8], [3, 3, 3, 8, 8]]),
        start=torch.tensor([2, 2, 3, 3]), kind=torch.tensor([0, 1, 2, 1]), seed=3,
        new_tokens=2, chat_heldout=1)
    t, s, k, dropped = eagle_data.merged(tokens, start, kinds, 1, [old])
    # its held-out code row is left out, and its chat row asking [5, 6] (this run's
    # held-out question) too; the rest train, its chat as EARLIER_CHAT
    assert dropped == 1
    assert t.tolist() == [[1, 2, 9, 9, 0], [3, 4, 9, 9, 0], [5, 6, 9, 9, 0], [7, 8, 9, 9, 0],
                          [4, 4, 4, 8, 8], [3, 3, 3, 8, 8]]
    assert s.tolist() == [2, 2, 2, 2, 3, 3]
    assert k.tolist() == [0, 1, 1, 2, eagle_data.CODE, eagle_data.EARLIER_CHAT]
    assert eagle_data.merged(tokens, start, kinds, 1, [])[0].tolist() == tokens.tolist()


def _args(tmp_path, seed=5, new_tokens=6, held=1, init=None):
    return types.SimpleNamespace(data=str(tmp_path), seed=seed, new_tokens=new_tokens, init=init,
                                 chat_heldout=held)


def test_a_cut_short_run_takes_its_own_rows_back(tmp_path):
    eagle_data.save(tmp_path, _rows(5), LM)
    eagle_data.save(tmp_path, _rows(3), LM)
    earlier, resumed = rows_of(_args(tmp_path), LM)
    assert [e.seed for e in earlier] == [3] and resumed.seed == 5
    assert rows_of(_args(tmp_path, seed=9), LM)[1] is None
    assert rows_of(types.SimpleNamespace(data=None), LM) == ([], None)


@pytest.mark.parametrize("args, rows, match", [
    (dict(new_tokens=7), {}, "answered with --new-tokens 6 and hold out 1 chat rows; this run has 7 and 1"),
    (dict(held=2), {}, "hold out 1 chat rows; this run has 6 and 2"),
    (dict(), dict(kind=(0, 1, 2, 2)), "1 chat rows answered, --chat-heldout 1: remove .*rows-5"),
    (dict(), dict(kind=(1, 1, 2, 2)), "no held-out code prompt was answered: remove .*rows-5"),
])
def test_a_cut_short_run_that_could_not_go_on_stops_at_once(tmp_path, args, rows, match):
    eagle_data.save(tmp_path, _rows(5, **rows), LM)
    with pytest.raises(ValueError, match=match):
        rows_of(_args(tmp_path, **args), LM)


def test_what_is_not_a_folder_or_a_file_stops_the_run(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        rows_of(_args(tmp_path / "file"), LM)
    (tmp_path / "d" / "rows-5.safetensors").mkdir(parents=True)
    with pytest.raises(ValueError, match="rows-5.safetensors is not a plain file"):
        rows_of(_args(tmp_path / "d"), LM)


def test_a_hostile_file_stops_the_run_before_any_work(tmp_path):
    eagle_data.save(tmp_path, _rows(3), LM)
    (tmp_path / "rows-3.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="rows-3.safetensors: not a rows file"):
        rows_of(_args(tmp_path), LM)
