"""``rewriter train-eagle --init``: a run goes on from an earlier draft file, which must
fit the model and must not have been trained on this run's questions (the same seed)."""
import types

import pytest
import torch

from rewriter.drafts import eagle, eagle_file
from rewriter.drafts.heads import draft_vocab
from rewriter.training.eagle_layer import DraftLayer
from rewriter.training.train_eagle_checks import counts_of, start_of

SHAPE = eagle.Shape(hidden=16, heads=4, kv_heads=2, intermediate=24)


def _file(tmp_path, lm, seed=11, shape=SHAPE, name="d.safetensors"):
    g = torch.Generator().manual_seed(1)
    p = eagle.init(shape, g)
    p["fc.bias"] = torch.randn(shape.hidden, generator=g)
    path = tmp_path / name
    eagle_file.made(p, shape, lm, trained={"seed": seed, "steps": 7},
                    counts=torch.arange(lm.shape[0])).save(path)
    return path, p


def _args(path, seed=12):
    return types.SimpleNamespace(init=str(path), seed=seed)


def _model(lm, eps=1e-5):
    """What ``start_of`` reads of a model: its LM head and its config (``SHAPE``'s layer;
    a GGUF's epsilon is float32's rounding of 1e-5)."""
    config = types.SimpleNamespace(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=24, rms_norm_eps=eps, rope_theta=10000.0)
    return types.SimpleNamespace(lm_head=types.SimpleNamespace(weight=lm), config=config)


def test_no_init_is_a_random_start():
    assert start_of(types.SimpleNamespace(init=None, seed=11), None) is None


def test_the_layer_starts_from_the_files(tmp_path):
    lm = torch.randn(40, SHAPE.hidden)
    path, p = _file(tmp_path, lm)
    init = start_of(_args(path), _model(lm, eps=float(torch.tensor(1e-5))))
    draft = types.SimpleNamespace(shape=SHAPE, device=torch.device("cpu"),
                                  p={n: torch.zeros(1) for n in eagle_file.NAMES})
    DraftLayer.start_from(draft, init)
    for n in eagle_file.NAMES:
        torch.testing.assert_close(draft.p[n], p[n], rtol=0, atol=0)
        assert draft.p[n].requires_grad and draft.p[n].dtype == torch.float32
    assert init.counts.tolist() == list(range(40))  # added to the run's own counts


def test_the_files_own_seed_is_refused(tmp_path):
    lm = torch.randn(40, SHAPE.hidden)
    path, _ = _file(tmp_path, lm, seed=12)
    with pytest.raises(ValueError, match="with --seed 12: the same questions"):
        start_of(_args(path, seed=12), _model(lm))


def test_a_draft_for_another_model_is_refused(tmp_path):
    path, _ = _file(tmp_path, torch.randn(40, SHAPE.hidden))
    with pytest.raises(ValueError, match="--init .*the draft was trained for"):
        start_of(_args(path), _model(torch.randn(40, SHAPE.hidden)))


def test_a_missing_or_torn_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no such draft file"):
        start_of(_args(tmp_path / "none.safetensors"), _model(torch.zeros(3, 4)))
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ValueError, match="torn.safetensors"):
        start_of(_args(torn), _model(torch.zeros(3, 4)))


def test_a_seed_of_a_file_it_went_on_from_is_refused(tmp_path):
    """A goes on to B (seed 12), B to C: C may not ask A's questions (seed 11) again."""
    lm = torch.randn(40, SHAPE.hidden)
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "b.safetensors"
    eagle_file.made(eagle.init(SHAPE, g), SHAPE, lm,
                    trained={"seed": 12, "init": {"file": "a", "seed": 11, "steps": 5}}).save(path)
    with pytest.raises(ValueError, match="with --seed 11: the same questions"):
        start_of(_args(path, seed=11), _model(lm))
    assert start_of(_args(path, seed=13), _model(lm)) is not None


def test_a_layer_of_another_shape_is_refused_before_any_work(tmp_path):
    lm = torch.randn(40, SHAPE.hidden)
    other = eagle.Shape(hidden=16, heads=2, kv_heads=2, intermediate=24)
    path, _ = _file(tmp_path, lm, shape=other)
    with pytest.raises(ValueError, match="is not this model's"):
        start_of(_args(path), _model(lm))
    init = eagle_file.load(path)
    draft = types.SimpleNamespace(shape=SHAPE, device=torch.device("cpu"), p={})
    with pytest.raises(ValueError, match="is not this model's"):
        DraftLayer.start_from(draft, init)


def test_a_cut_short_run_may_go_on_from_its_own_checkpoint(tmp_path):
    """With its own rows kept (``--data``), a run of seed 12 trains on what its checkpoint
    was trained on: the same questions, not new ones asked again. Only its own checkpoint:
    a draft of another seed that went on from a seed-12 draft is refused."""
    lm = torch.randn(40, SHAPE.hidden)
    path, _ = _file(tmp_path, lm, seed=12)
    assert start_of(_args(path, seed=12), _model(lm), resuming=True) is not None
    g = torch.Generator().manual_seed(1)
    later = tmp_path / "later.safetensors"
    eagle_file.made(eagle.init(SHAPE, g), SHAPE, lm,
                    trained={"seed": 13, "init": {"file": "a", "seed": 12}}).save(later)
    with pytest.raises(ValueError, match="was not made by a run of --seed 12"):
        start_of(_args(later, seed=12), _model(lm), resuming=True)
    twice = tmp_path / "twice.safetensors"  # cut short twice: its own chain of checkpoints
    eagle_file.made(eagle.init(SHAPE, g), SHAPE, lm,
                    trained={"seed": 12, "init": {"seed": 12, "init": {"seed": 11}}}).save(twice)
    assert start_of(_args(twice, seed=12), _model(lm), resuming=True) is not None
    with pytest.raises(ValueError, match="with --seed 12: the same questions"):
        start_of(_args(twice, seed=12), _model(lm))  # not resuming: refused


def test_the_seeds_of_the_rows_a_draft_trained_on_are_refused(tmp_path):
    """A draft trained with ``--data`` on seed 11's rows (held-out ones included): a run of
    seed 11 may not measure it on them, at any depth of the chain."""
    lm = torch.randn(40, SHAPE.hidden)
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "b.safetensors"
    eagle_file.made(eagle.init(SHAPE, g), SHAPE, lm,
                    trained={"seed": 14, "data_seeds": [9],
                             "init": {"seed": 12, "data_seeds": [11]}}).save(path)
    for seed in (9, 11):
        with pytest.raises(ValueError, match=f"with --seed {seed}: the same questions"):
            start_of(_args(path, seed=seed), _model(lm))
    assert start_of(_args(path, seed=15), _model(lm)) is not None
    own = tmp_path / "own.safetensors"  # its own checkpoint, trained on seed 12's rows too
    eagle_file.made(eagle.init(SHAPE, g), SHAPE, lm, trained={"seed": 12, "data_seeds": [12]}).save(own)
    with pytest.raises(ValueError, match="with --seed 12: the same questions"):
        start_of(_args(own, seed=12), _model(lm), resuming=True)


def test_a_resumed_run_keeps_its_checkpoints_counts_and_vocabulary(tmp_path):
    """A run's file counts its rows plus ``--init``'s; cut short and resumed from that file,
    it keeps the file's counts (its rows are in them already): counted again they would
    rank other tokens first, and it would go on training on another vocabulary."""
    lm = torch.randn(40, SHAPE.hidden)
    before = torch.zeros(40, dtype=torch.int64)
    before[:10] = 3  # the draft it began from: tokens 0-9
    own = torch.zeros(40, dtype=torch.int64)
    own[20:26] = 2  # its own rows: tokens 20-25
    counts = counts_of(own, types.SimpleNamespace(counts=before), resuming=False)
    assert counts.tolist() == (before + own).tolist()
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "checkpoint.safetensors"
    eagle_file.made(eagle.init(SHAPE, g), SHAPE, lm, counts=counts,
                    trained={"seed": 12, "train_vocab": 10, "init": {"seed": 11}}).save(path)
    init = start_of(types.SimpleNamespace(init=str(path), seed=12, train_vocab=10),
                              _model(lm), resuming=True)
    again = counts_of(own, init, resuming=True)
    assert torch.equal(again, counts)
    assert torch.equal(draft_vocab(again, 10), draft_vocab(counts, 10))
    doubled = own + init.counts  # what counting its rows twice would choose
    assert not torch.equal(draft_vocab(doubled, 10), draft_vocab(counts, 10))
    assert counts_of(own, None, resuming=False) is own
    for other in (0, 4096):
        with pytest.raises(ValueError, match="trained with --train-vocab 10"):
            start_of(types.SimpleNamespace(init=str(path), seed=12, train_vocab=other),
                               _model(lm), resuming=True)
