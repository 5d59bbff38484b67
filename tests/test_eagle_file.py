"""The EAGLE draft file: a round trip, and every way a hostile file is refused by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rewriter.drafts import eagle, eagle_file

SHAPE = eagle.Shape(hidden=32, heads=4, kv_heads=2, intermediate=48, rope_theta=500.0, eps=1e-6)


def _draft(vocab: int = 50):
    g = torch.Generator().manual_seed(0)
    lm = torch.randn(vocab, SHAPE.hidden, generator=g)
    p = eagle.init(SHAPE, g)
    return eagle_file.made(p, SHAPE, lm, accuracy=[0.5, 0.4], trained={"steps": 3}), lm


def _rewrite(src, dst, tensors=None, meta=None):
    with safe_open(str(src), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = dict(f.metadata())
    t.update(tensors or {})
    t = {k: v for k, v in t.items() if v is not None}
    m.update(meta or {})
    save_file(t, str(dst), metadata=m)


def test_round_trip_and_fit(tmp_path):
    d, lm = _draft()
    d.save(tmp_path / "d.safetensors")
    got = eagle_file.load(tmp_path / "d.safetensors")
    assert got.shape == SHAPE and got.vocab == 50 and got.accuracy == [0.5, 0.4]
    assert got.trained == {"steps": 3}
    for name in eagle_file.NAMES:
        torch.testing.assert_close(got.params[name], d.params[name])
    got.fits(lm, "d")
    with pytest.raises(eagle_file.DraftFileError, match="another model"):
        got.fits(lm + 1, "d")
    with pytest.raises(eagle_file.DraftFileError, match="hidden size 32 and 50 tokens"):
        got.fits(lm[:40], "d")


@pytest.mark.parametrize("tensors, meta, match", [
    ({}, {"format": "rewriter-medusa-heads"}, "not an EAGLE draft file"),
    ({}, {"version": "9"}, "version '9'"),
    ({"fc.bias": None}, {}, "missing \\['fc.bias'\\]"),
    ({"extra": torch.zeros(1)}, {}, "unexpected \\['extra'\\]"),
    ({"counts": torch.zeros(49, dtype=torch.int64)}, {}, "counts must be \\[50\\] non-negative int64"),
    ({"counts": torch.full((50,), -1, dtype=torch.int64)}, {}, "counts must be"),
    ({"counts": torch.zeros(50)}, {}, "counts must be"),
    ({"fc.weight": torch.zeros(32, 32)}, {}, "fc.weight must be float32 or bfloat16 \\[32, 64\\]"),
    ({"fc.bias": torch.zeros(32, dtype=torch.float64)}, {}, "fc.bias must be float32 or bfloat16"),
    ({"norm.weight": torch.full((32,), float("nan"))}, {}, "norm.weight holds NaN"),
    ({}, {"shape": json.dumps({"hidden": 32, "heads": 5, "kv_heads": 1, "intermediate": 48})},
     "unreadable draft file.*split into 5 heads"),
    ({}, {"shape": "[1, 2]"}, "unreadable draft file"),
    ({}, {"probe": "[[1]]"}, "probe must be"),
    ({}, {"probe": json.dumps([[10 ** 400] * 8] * 4)}, "probe must be"),
    ({}, {"probe": json.dumps([[True] * 8] * 4)}, "probe must be"),
    ({}, {"probe": json.dumps([[float("nan")] * 8] * 4)}, "probe must be"),
    ({}, {"accuracy": "[true]"}, "accuracy must be"),
    ({}, {"trained": "[1]"}, "trained must be a JSON object"),
    ({}, {"vocab": "0"}, "vocab must be a positive integer"),
    ({}, {"vocab": " 50 "}, "vocab must be a positive integer"),
    ({}, {"shape": json.dumps({"hidden": 32, "heads": 4, "kv_heads": 2, "intermediate": 48,
                               "rope_theta": 10 ** 400})}, "rope_theta must be"),
    ({}, {"accuracy": "[2.0]"}, "accuracy must be"),
    ({}, {"vocab": "many"}, "vocab must be a positive integer"),
])
def test_a_bad_file_is_refused_by_name(tmp_path, tensors, meta, match):
    d, _ = _draft()
    d.save(tmp_path / "d.safetensors")
    _rewrite(tmp_path / "d.safetensors", tmp_path / "bad.safetensors", tensors, meta)
    with pytest.raises(eagle_file.DraftFileError, match=match):
        eagle_file.load(tmp_path / "bad.safetensors")


def test_missing_metadata_is_refused(tmp_path):
    d, _ = _draft()
    d.save(tmp_path / "d.safetensors")
    with safe_open(str(tmp_path / "d.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        m = {k: v for k, v in f.metadata().items() if k != "shape"}
    save_file(t, str(tmp_path / "bad.safetensors"), metadata=m)
    with pytest.raises(eagle_file.DraftFileError, match="unreadable draft file.*shape"):
        eagle_file.load(tmp_path / "bad.safetensors")


def test_a_missing_or_torn_file_is_refused(tmp_path):
    with pytest.raises(eagle_file.DraftFileError, match="no such draft file"):
        eagle_file.load(tmp_path / "none.safetensors")
    d, _ = _draft()
    d.save(tmp_path / "d.safetensors")
    data = (tmp_path / "d.safetensors").read_bytes()
    (tmp_path / "torn.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(eagle_file.DraftFileError, match="unreadable draft file"):
        eagle_file.load(tmp_path / "torn.safetensors")


def test_counts_round_trip(tmp_path):
    d, lm = _draft()
    d.counts = torch.arange(50, dtype=torch.int64)
    d.save(tmp_path / "c.safetensors")
    assert torch.equal(eagle_file.load(tmp_path / "c.safetensors").counts, d.counts)
    bare, _ = _draft()
    bare.save(tmp_path / "b.safetensors")
    assert eagle_file.load(tmp_path / "b.safetensors").counts is None


def test_a_draft_stored_in_bfloat16_loads_as_float32(tmp_path):
    """Half the bytes on disk (the shipped draft); read back as float32, each parameter its
    bfloat16 rounding; any other dtype refused, on saving and on loading."""
    d, lm = _draft()
    d.save(tmp_path / "h.safetensors", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "h.safetensors"), "pt") as f:
        assert {f.get_tensor(n).dtype for n in eagle_file.NAMES} == {torch.bfloat16}
    got = eagle_file.load(tmp_path / "h.safetensors")
    for name in eagle_file.NAMES:
        assert got.params[name].dtype == torch.float32
        assert torch.equal(got.params[name], d.params[name].to(torch.bfloat16).float())
    got.fits(lm, "h")
    with pytest.raises(ValueError, match="stored in float32 or bfloat16, got torch.float16"):
        d.save(tmp_path / "x.safetensors", dtype=torch.float16)
    assert not (tmp_path / "x.safetensors").exists()
    _rewrite(tmp_path / "h.safetensors", tmp_path / "f16.safetensors",
             {"fc.bias": torch.zeros(32, dtype=torch.float16)})
    with pytest.raises(eagle_file.DraftFileError, match="fc.bias must be float32 or bfloat16"):
        eagle_file.load(tmp_path / "f16.safetensors")


def test_the_shipped_draft_is_packaged_and_loads():
    """``weights="smollm2"``: the packaged file, SmolLM2's shape and vocabulary, with the
    token counts a trimmed vocabulary needs, bfloat16 on disk and float32 once loaded; any
    other string (``./smollm2`` too) is a path."""
    assert eagle_file.resolve("smollm2") == eagle_file.ASSETS / "smollm2.safetensors"
    for path in ("smollm2.safetensors", "./smollm2", "../smollm2"):
        assert str(eagle_file.resolve(path)) == str(__import__("pathlib").Path(path))
    d = eagle_file.load("smollm2")
    assert (d.shape.hidden, d.shape.heads, d.shape.kv_heads, d.vocab) == (576, 9, 3, 49152)
    # the counts of every run in its chain: each went on from the one before (``init``)
    chain, positions = d.trained, 0
    while isinstance(chain, dict):
        positions, chain = positions + chain["positions"], chain.get("init")
    assert d.counts is not None and int(d.counts.sum()) == positions >= d.trained["positions"] > 0
    assert {t.dtype for t in d.params.values()} == {torch.float32}
    assert len(d.accuracy) == 4 and d.accuracy[0] > 0.5  # held-out chat top-1, as trained
    with safe_open(str(eagle_file.ASSETS / "smollm2.safetensors"), "pt") as f:
        assert {f.get_tensor(n).dtype for n in eagle_file.NAMES} == {torch.bfloat16}


def test_what_load_would_refuse_is_never_saved(tmp_path):
    """A diverged run's NaN, or a float32 value past bfloat16's range, is refused by name
    before a byte is written."""
    d, _ = _draft()
    d.params["fc.bias"] = torch.full((32,), float("nan"))
    with pytest.raises(eagle_file.DraftFileError, match="not saved: fc.bias holds NaN"):
        d.save(tmp_path / "n.safetensors")
    d, _ = _draft()
    d.params["norm.weight"] = torch.full((32,), torch.finfo(torch.float32).max)
    d.save(tmp_path / "big.safetensors")  # float32 holds it
    with pytest.raises(eagle_file.DraftFileError, match="not saved: norm.weight holds NaN or infinite"):
        d.save(tmp_path / "big16.safetensors", dtype=torch.bfloat16)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]
