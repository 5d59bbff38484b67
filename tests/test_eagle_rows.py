"""``benchmarks/eagle_gpu.py --data``: each run keeps its rows (``eagle_rows``), later runs
train on them too, a cut-short run takes its own back, and a hostile file stops the run
with its name."""
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import eagle_gpu  # noqa: E402
import eagle_rows  # noqa: E402

VOCAB = 50


def _rows(seed=5, n=4, width=12, new_tokens=6):
    g = torch.Generator().manual_seed(seed)
    return eagle_rows.Rows(tokens=torch.randint(0, VOCAB, (n, width), generator=g),
                           start=torch.full((n,), width - new_tokens),
                           kind=torch.tensor([0, 1, 2, 1][:n]), seed=seed, new_tokens=new_tokens,
                           chat_heldout=1)


def test_rows_round_trip(tmp_path):
    rows = _rows()
    path = eagle_rows.save(tmp_path / "d", rows, VOCAB)
    assert path.name == "rows-5.safetensors" and not list((tmp_path / "d").glob("*.tmp"))
    back = eagle_rows.load(path, VOCAB)
    for k in ("tokens", "start", "kind"):
        assert torch.equal(getattr(back, k), getattr(rows, k))
    assert (back.seed, back.new_tokens, back.chat_heldout) == (5, 6, 1)


def test_earlier_runs_are_the_other_seeds_with_the_same_answers(tmp_path):
    for seed in (3, 5, 7):
        eagle_rows.save(tmp_path, _rows(seed), VOCAB)
    (tmp_path / "notes.txt").write_text("not a rows file")  # other files are not read
    assert [r.seed for r in eagle_rows.earlier(tmp_path, 5, VOCAB, 6)] == [3, 7]
    with pytest.raises(eagle_rows.RowsError, match="answers of 6 tokens, this run's --new-tokens is 9"):
        eagle_rows.earlier(tmp_path, 5, VOCAB, 9)


def _hostile(tmp_path, tensors, **meta):
    path = tmp_path / "rows-5.safetensors"
    meta = {"seed": "5", "new_tokens": "6", "vocab": str(VOCAB), "chat_heldout": "1", **meta}
    save_file(tensors, str(path), metadata=meta)
    return path


@pytest.mark.parametrize("change, match", [
    (dict(tokens=torch.full((2, 12), VOCAB)), r"token ids outside \[0, 50\)"),
    (dict(tokens=torch.full((2, 12), -1)), r"token ids outside"),
    (dict(start=torch.tensor([6, 7])), "no room for its 6 tokens"),
    (dict(start=torch.tensor([0, 6])), "leaves no prompt"),
    (dict(kind=torch.tensor([1, 4])), "kinds must be"),
    (dict(kind=torch.tensor([1])), "start, kind"),
    (dict(tokens=torch.zeros(2, 12, dtype=torch.int32)), "all int64"),
    (dict(tokens=torch.zeros(2, 12, 1, dtype=torch.int64)), r"tokens must be \[N, L\]"),
])
def test_a_hostile_file_is_refused_by_name(tmp_path, change, match):
    t = {"tokens": torch.zeros(2, 12, dtype=torch.int64), "start": torch.tensor([6, 6]),
         "kind": torch.tensor([1, 2]), **change}
    with pytest.raises(eagle_rows.RowsError, match=match):
        eagle_rows.load(_hostile(tmp_path, t), VOCAB)


def test_a_torn_or_foreign_file_is_refused_by_name(tmp_path):
    t = {"tokens": torch.zeros(2, 12, dtype=torch.int64), "start": torch.tensor([6, 6]),
         "kind": torch.tensor([1, 2])}
    with pytest.raises(eagle_rows.RowsError, match="made for a vocabulary of 99"):
        eagle_rows.load(_hostile(tmp_path, t, vocab="99"), VOCAB)
    with pytest.raises(eagle_rows.RowsError, match="does not carry its seed 8"):
        eagle_rows.load(_hostile(tmp_path, t, seed="8"), VOCAB)
    with pytest.raises(eagle_rows.RowsError, match="rows-5.safetensors: not a rows file"):
        eagle_rows.load(_hostile(tmp_path, t, new_tokens="six"), VOCAB)
    torn = tmp_path / "rows-5.safetensors"
    torn.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(eagle_rows.RowsError, match="not a rows file"):
        eagle_rows.load(torn, VOCAB)


def test_padded_rows_of_several_runs():
    a, b = torch.ones(2, 3, dtype=torch.int64), torch.full((1, 5), 2)
    assert eagle_rows.padded([a, b]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [2] * 5]


def _args(tmp_path, seed=5, new_tokens=6, init=None):
    return types.SimpleNamespace(data=str(tmp_path), seed=seed, new_tokens=new_tokens, init=init)


def test_a_cut_short_run_takes_its_own_rows_back(tmp_path):
    eagle_rows.save(tmp_path, _rows(5), VOCAB)
    eagle_rows.save(tmp_path, _rows(3), VOCAB)
    earlier, resumed = eagle_gpu.rows_of(_args(tmp_path), VOCAB)
    assert [e.seed for e in earlier] == [3] and resumed.seed == 5
    assert eagle_gpu.rows_of(_args(tmp_path, seed=9), VOCAB)[1] is None
    with pytest.raises(SystemExit, match="answers of 6 tokens, --new-tokens is 7"):
        eagle_rows.save(tmp_path / "only", _rows(5), VOCAB)
        eagle_gpu.rows_of(_args(tmp_path / "only", new_tokens=7), VOCAB)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="exists and is not a folder"):
        eagle_gpu.rows_of(_args(tmp_path / "file"), VOCAB)
    assert eagle_gpu.rows_of(types.SimpleNamespace(data=None), VOCAB) == ([], None)


def test_a_hostile_file_stops_the_run_before_any_work(tmp_path):
    eagle_rows.save(tmp_path, _rows(3), VOCAB)
    (tmp_path / "rows-3.safetensors").write_bytes(b"garbage")
    with pytest.raises(SystemExit, match="rows-3.safetensors: not a rows file"):
        eagle_gpu.rows_of(_args(tmp_path), VOCAB)
