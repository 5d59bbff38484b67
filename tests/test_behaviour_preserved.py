"""Decoding gives the tokens recorded before issue 58's restructuring of the decoding
strategies (``tests/golden/behaviour``), and artifacts saved then still load and decode the
same tokens (``tests/golden/artifacts``).

The fast half of ``tests/golden/behaviour/record.py --check``: the default model, one or two
cases of each strategy family (plain, self-speculative, draft-head trees, EAGLE, prompt
lookup, sparse attention), regenerated and compared with ``default.json``. The whole check
(every case, and SmolLM2) is::

    python tests/golden/behaviour/record.py --model default --check tests/golden/behaviour/default.json
    python tests/golden/behaviour/record.py --model smollm2 --check tests/golden/behaviour/smollm2.json
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import rewriter

# one worker: its module fixtures are built once under --dist loadgroup
pytestmark = pytest.mark.xdist_group("behaviour_preserved")

GOLDEN = Path(__file__).parent / "golden"
BEHAVIOUR = GOLDEN / "behaviour"
ARTIFACTS = GOLDEN / "artifacts"

# one or two cases per family; each runs in 1-3 s on one CPU thread
CASES = ["plain", "self_speculative", "self_speculative_int4", "medusa_typical",
         "hydra_adaptive_lookup", "hydra_chains_only", "eagle_lookup", "prompt_lookup_adaptive",
         "streaming", "quest"]
FIXTURES = ["hydra_adaptive", "eagle"]


def _record_module():
    spec = importlib.util.spec_from_file_location("behaviour_record", BEHAVIOUR / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


record = _record_module()
EXPECTED = json.loads((BEHAVIOUR / "default.json").read_text())


@pytest.fixture
def one_thread():
    """The recordings were made on one thread (float32 sums may be ordered otherwise on
    more, and a near tie then breaks the other way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """The default model traced once, and the seeded random EAGLE draft the recording used."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base, draft, about = record.setup("default", tmp_path_factory.mktemp("behaviour"),
                                          log=lambda *a: None)
    finally:
        torch.set_num_threads(threads)
    return base, draft, about


def test_the_recording_covers_every_family():
    assert set(CASES) <= set(EXPECTED)
    assert EXPECTED["_meta"]["model"] == "default" and EXPECTED["_meta"]["threads"] == 1
    # record.py still defines every recorded case (none dropped or renamed since)
    assert set(EXPECTED) - {"_meta"} <= set(record.cases("default", "<draft>"))


def test_the_random_eagle_draft_is_the_recorded_one(traced):
    _, _, about = traced
    assert about == EXPECTED["eagle"]["params"]["eagle"]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_are_the_recorded_ones(traced, one_thread, case):
    base, draft, about = traced
    meta = EXPECTED["_meta"]
    got = record.run_cases("default", base, draft, about, meta["ids"], [case],
                           meta["max_new_tokens"], log=lambda *a: None)
    diffs, _ = record.compare(EXPECTED, got)
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("name", FIXTURES)
def test_artifacts_saved_before_the_restructuring_decode_the_same_tokens(one_thread, name):
    expected = json.loads((ARTIFACTS / f"{name}.json").read_text())
    engine = rewriter.load(ARTIFACTS / name)
    engine.fallback = False
    ids, kwargs = expected["ids"], expected["generate"]
    batch1 = [engine.generate([p], **kwargs)[0, len(p):].tolist() for p in ids]
    assert batch1 == expected["batch1"]
    width = max(map(len, ids))
    assert engine.generate(ids, **kwargs)[:, width:].tolist() == expected["ragged"]
