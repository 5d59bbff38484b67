"""Runtime state sized by untrusted numbers (issue 57, item 1).

The runtime sizes a layer's state by a few counts: a ring's ``sinks + window`` (its slots,
and the sink layout every step builds, ``runtime.ring_cache``), a selection's ``top_k`` or
``budget``, plus ``recent`` (its width, ``rw.select_tokens`` / ``rw.select_pages``), and the
tokens Hydra's path reads (``rw.next_tokens``). Each was accepted up to 2**31 - 1 from every
entry point and allocated at the first ``generate`` (17 GB for 2**31 - 1 sinks). Now each
is bounded by the model where it is accepted: by the pass when it runs on an IR (its
``__init__`` does not know the model), by the IR verifier after every pass, and by the same
verifier when an artifact is loaded. The counts of one layer add up to at most the context
length (``rewriter.values.within_context``): no sequence the model was made for holds more
tokens, so no ring or selection needs more; the path at most ``MAX_HEADS`` tokens.

Every input that could allocate runs in one child process. It first runs the same models
normally; then its address space may grow by ``HEADROOM`` at most (``RLIMIT_AS``), so that a
regression fails there with an allocation error instead of swapping the machine, and its
peak RSS after each hostile input may exceed the normal run's by ``MARGIN`` at most (they
add less than 8 MiB).
"""
import contextlib
import copy
import io
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rewriter
from artifact_tools import artifact_files, reseal
from conftest import make_model
from rewriter.cli import main
from rewriter.ops import OPS, op_arguments
from rewriter.api.optimized import OptimizedModel
from rewriter.ir.pass_manager import run_pipeline
from rewriter.passes import (DuoAttention, HydraHeads, Quest, StreamingAttention, TidalDecode,
                             from_spec)
from test_artifact_contents import tiny_llama
from test_checkpoints import tiny_llama as tiny_checkpoint

HEADROOM = 1 << 30  # bytes the child's address space may grow by after the normal run
MARGIN = 64 << 20  # bytes of peak RSS a hostile input may add to the normal run's
HUGE = 2**31 - 1
ROWS = [[3, 17, 42, 5, 9, 8, 60, 7, 9], [1, 2, 3]]  # ids < 64: the tiny Llama's too
GATES = [[0.9, 0.1], [0.1, 0.1], [0.9, 0.9]]  # llama-gqa-3l: 3 layers of 2 KV heads
# one worker runs the whole file: its child process (every case) starts once, not on each
pytestmark = pytest.mark.xdist_group("runtime_bounds")


# ---------------------------------------------------------------- the child's cases
# Each builds a model the way a user would and, if that succeeds, runs it: a call (the
# whole-sequence graph) and generate (the KV-cache runtime). A refusal raises before either.

def with_passes(base: OptimizedModel, passes: list) -> OptimizedModel:
    """``base`` with ``passes`` run on a copy of its IR, as ``rewriter.optimize`` runs them
    (each verified after it), without tracing again."""
    ir = copy.deepcopy(base.ir)
    opt = OptimizedModel(ir, passes, run_pipeline(ir, passes), "torch")
    opt.lower()
    return opt


_TRACED = {}


def _optimized(*passes) -> list:
    """llama-gqa-3l (128 tokens of context; traced once) with ``passes``, run."""
    if not _TRACED:
        _TRACED["model"] = rewriter.optimize(make_model("llama-gqa-3l"))
    return _exercise(with_passes(_TRACED["model"], list(passes)))


def _exercise(m) -> list:
    m(torch.tensor([ROWS[0]]))
    return m.generate(ROWS, max_new_tokens=4, eos_token_id=[]).tolist()


class WriteSinks(rewriter.Pass):
    """A pass that writes sinks itself: the verifier, not the pass, must refuse them."""

    def run(self, ir):
        for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"]):
            args = op_arguments("attention", tuple(n.args), dict(n.kwargs))
            kept = {k: v for k, v in args.items() if k not in ("q", "k", "v") and v is not None}
            n.args, n.kwargs = tuple(n.args[:3]), {**kept, "window": 4, "sinks": HUGE}
        return ir


def _cli_run(path: str) -> list:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["run", path, "--ids", "3,17,42", "--max-new-tokens", "4"])
    return [status, err.getvalue()]


def _loaded(name: str):
    return lambda spec: _exercise(rewriter.load(spec["artifacts"][name]))


# name -> what it runs, given the spec (the gates files' and artifacts' paths)
CASES = {
    # StreamingAttention: the input, more of the kind, the command line's spec
    "streaming sinks 2**31-1": lambda _: _optimized(StreamingAttention(sinks=HUGE)),
    "streaming sinks 10**8": lambda _: _optimized(StreamingAttention(sinks=10**8, window=4)),
    "streaming window 2**31-1": lambda _: _optimized(StreamingAttention(sinks=4, window=HUGE)),
    "streaming one past": lambda _: _optimized(StreamingAttention(sinks=4, window=125)),
    "streaming spec": lambda _: _optimized(from_spec(f"streaming_attention:sinks={HUGE}")),
    # DuoAttention: sinks given, sinks or window from a gates file
    "duo sinks 10**8": lambda _: _optimized(DuoAttention(GATES, sinks=10**8, window=4)),
    "duo gates file sinks": lambda s: _optimized(DuoAttention(s["gates_sinks"])),
    "duo gates file window": lambda s: _optimized(DuoAttention(s["gates_window"])),
    # a pass that writes the attribute itself: the IR verifier
    "verifier sinks": lambda _: _optimized(WriteSinks()),
    # the same class: the selections' widths
    "quest budget": lambda _: _optimized(Quest(budget=HUGE, dense_layers=1)),
    "quest page": lambda _: _optimized(Quest(page=2**30, budget=2**30, dense_layers=1)),
    "quest recent": lambda _: _optimized(Quest(page=4, budget=8, recent=HUGE, dense_layers=1)),
    "tidal top_k": lambda _: _optimized(TidalDecode(top_k=HUGE)),
    "tidal recent": lambda _: _optimized(TidalDecode(top_k=4, recent=HUGE)),
    "tidal spec": lambda _: _optimized(from_spec("tidal_decode:top_k=100,recent=29")),
    # resealed artifacts (a tiny Llama of 64 tokens of context)
    "artifact sinks": _loaded("sinks"),
    "artifact window": _loaded("window"),
    "artifact duo sinks": _loaded("duo"),
    "artifact quest budget": _loaded("quest"),
    "artifact tidal top_k": _loaded("tidal"),
    "artifact next_tokens": _loaded("next_tokens"),
    "cli run artifact sinks": lambda s: _cli_run(s["artifacts"]["sinks"]),
    # an artifact that raises its own context with its sinks: loads (its numbers agree),
    # and the ring still allocates by its slots, not its sinks
    "artifact raised context": _loaded("raised"),
    "artifact plain": _loaded("plain"),
    # the same for the selections, whose whole-sequence ops (engine(ids)) were sized by
    # top_k and by Quest's page and budget: a model of 50,000 tokens, so the size bound
    # (16x its largest weight at one token) lets 10**7-wide selections through
    "artifact raised tidal": _loaded("raised tidal"),
    "artifact raised quest": _loaded("raised quest"),
    "artifact wide plain": _loaded("wide plain"),
    # within the bounds: as before
    "streaming at the bound": lambda _: _optimized(StreamingAttention(sinks=4, window=124)),
    "quest at the bound": lambda _: _optimized(Quest(page=4, budget=120, recent=8, dense_layers=1)),
}

# What the child runs first, normally: its peak RSS is the baseline.
BASELINE = [lambda _: _optimized(StreamingAttention(sinks=2, window=4)),
            lambda _: _optimized(Quest(page=2, budget=4, dense_layers=1)),
            lambda _: _optimized(TidalDecode(top_k=4)),
            lambda _: _optimized(DuoAttention(GATES, sinks=2, window=4)),
            _loaded("plain"), _loaded("wide plain"), lambda s: _cli_run(s["artifacts"]["plain"])]


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _cap_address_space() -> None:
    """From now on the address space may grow by ``HEADROOM`` at most."""
    status = Path("/proc/self/status").read_text()
    size = int(re.search(r"VmSize:\s+(\d+) kB", status).group(1)) << 10
    resource.setrlimit(resource.RLIMIT_AS, (size + HEADROOM, size + HEADROOM))


def child(spec: dict) -> dict:
    """Run the baseline, then every case; ``{"baseline": bytes, "results": {name: [kind,
    text or value, peak bytes]}}``."""
    for run in BASELINE:
        run(spec)
    _cap_address_space()
    out = {"baseline": _peak(), "results": {}}
    for name in spec["cases"]:
        try:
            got = ["ok", CASES[name](spec)]
        except Exception as e:  # what it raised is the result
            got = [type(e).__name__, str(e)]
        out["results"][name] = got + [_peak()]
    return out


# ---------------------------------------------------------------- the parent's side

def _artifact(root: Path, name: str, model, change=None, manifest=None) -> str:
    """``model`` saved as ``root/name``, its ``ir.json`` (and manifest) edited, resealed."""
    path = root / name
    model.save(path)
    for file, edit in (("ir.json", change), ("manifest.json", manifest)):
        if edit is not None:
            f = artifact_files(path)[file]
            data = json.loads(f.read_text())
            edit(data)
            f.write_text(json.dumps(data))
    reseal(path)
    return str(path)


def _set(target: str, index: int = 0, **kwargs):
    """An ``ir.json`` edit: the ``index``-th node calling ``target`` gets ``kwargs``."""
    def change(data):
        nodes = [n for n in data["graph"] if n.get("target") == target]
        nodes[index]["kwargs"] = {**nodes[index].get("kwargs", {}), **kwargs}
    return change


def _path_count(count: int):
    """An ``ir.json`` edit: Hydra's ``rw.next_tokens`` reads ``count`` tokens."""
    def change(data):
        (path,) = [n for n in data["graph"] if n.get("target") == "rw.next_tokens"]
        path["args"][1] = count
    return change


def _raise_context(data):
    """An ``ir.json`` or manifest edit: the model's context is 2**31 - 1 tokens."""
    config = data["info"]["config"] if "info" in data else data["model"]["config"]
    config["max_position_embeddings"] = HUGE


def _gates_file(path: Path, sinks: int, window: int, gates: list = GATES) -> str:
    path.write_text(json.dumps({"format": "rewriter-duo-gates", "version": 1, "sinks": sinks,
                                "window": window, "gates": gates}))
    assert path.stat().st_size < 300  # the "300-byte gates file"
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Gates files and resealed artifacts of a tiny Llama (64 tokens of context)."""
    root = tmp_path_factory.mktemp("bounds")
    plain = rewriter.optimize(tiny_llama())
    ring = with_passes(plain, [StreamingAttention(sinks=2, window=4)])
    duo = with_passes(plain, [DuoAttention([[0.9, 0.1], [0.1, 0.1]], sinks=2, window=4)])
    return {
        "gates_sinks": _gates_file(root / "sinks.json", HUGE, 64),
        "gates_window": _gates_file(root / "window.json", 16, 10**9),
        "artifacts": {
            "plain": _artifact(root, "plain", plain),
            "sinks": _artifact(root, "sinks", ring, _set("rw.attention", sinks=HUGE)),
            "window": _artifact(root, "window", ring, _set("rw.attention", 1, window=10**9)),
            "duo": _artifact(root, "duo", duo, _set("rw.attention", sinks=10**8)),
            "quest": _artifact(root, "quest", with_passes(plain, [Quest(page=2, budget=4, dense_layers=1)]),
                               _set("rw.select_pages", budget=60, recent=10)),
            "tidal": _artifact(root, "tidal", with_passes(plain, [TidalDecode(selection_layers=[0], top_k=4)]),
                               _set("rw.select_tokens", top_k=65)),
            # Hydra's path: 32768 tokens is the most the size bound lets this model have
            "next_tokens": _artifact(root, "next_tokens", with_passes(plain, [HydraHeads(num_heads=2)]),
                                     _path_count(32768)),
            "raised": _artifact(root, "raised", ring,
                                lambda d: (_raise_context(d), _set("rw.attention", sinks=2**30)(d)),
                                _raise_context),
            **_raised_selections(root),
        }}


def _raised_selections(root: Path) -> dict:
    """Artifacts of a tiny Llama with a 50,000-token vocabulary whose context is raised to
    2**31 - 1 with a TidalDecode top_k or a Quest page and budget of 10**7."""
    wide = rewriter.optimize(tiny_checkpoint(tie=True, vocab_size=50_000))
    tidal = with_passes(wide, [TidalDecode(selection_layers=[0], top_k=4)])
    quest = with_passes(wide, [Quest(page=2, budget=4, dense_layers=1)])
    raise_with = lambda target, **kw: lambda d: (_raise_context(d), _set(target, **kw)(d))
    return {"wide plain": _artifact(root, "wide_plain", wide),
            "raised tidal": _artifact(root, "raised_tidal", tidal,
                                      raise_with("rw.select_tokens", top_k=10**7), _raise_context),
            "raised quest": _artifact(root, "raised_quest", quest,
                                      raise_with("rw.select_pages", page=10**7, budget=10**7),
                                      _raise_context)}


@pytest.fixture(scope="module")
def results(files):
    """Every case, in one child process (this file run as a script)."""
    spec = {**files, "cases": list(CASES)}
    env = {**os.environ, "REWRITER_BOUNDS_SPEC": json.dumps(spec)}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(results, name: str, kind: str, pattern: str):
    """Case ``name`` ended in ``kind`` with a message matching ``pattern`` (or, for "ok",
    returned that value), and its peak RSS stayed within ``MARGIN`` of the normal run's."""
    got, text, peak = results["results"][name]
    assert got == kind and re.search(pattern, str(text)), (name, got, str(text)[:500])
    assert peak - results["baseline"] <= MARGIN, (name, peak - results["baseline"])
    return text


def context(names: str, values: str, limit: int) -> str:
    """The message of ``within_context``: the counts, their values and the bound."""
    return (rf"{names} = {values}( = \d+)? exceeds the model's context length, {limit} "
            rf"tokens; {names} must be at most {limit}")


RING, SELECTION = r"sinks \+ window", r"top_k \+ recent"
PAGES = r"budget \+ recent"
STREAMING = {"streaming sinks 2**31-1": context(RING, rf"{HUGE} \+ 1020", 128),
             "streaming sinks 10**8": context(RING, r"100000000 \+ 4", 128),
             "streaming window 2**31-1": context(RING, rf"4 \+ {HUGE}", 128),
             "streaming one past": context(RING, r"4 \+ 125", 128),
             "streaming spec": context(RING, rf"{HUGE} \+ 1020", 128)}
DUO = {"duo sinks 10**8": r"^DuoAttention: " + context(RING, r"100000000 \+ 4", 128),
       "duo gates file sinks": r"^DuoAttention \(gates .*sinks\.json\): "
                               + context(RING, rf"{HUGE} \+ 64", 128),
       "duo gates file window": r"^DuoAttention \(gates .*window\.json\): "
                                + context(RING, r"16 \+ 1000000000", 128)}
SELECTIONS = {"quest budget": r"^Quest: " + context(PAGES, rf"{HUGE} \+ 0", 128),
              "quest page": r"^Quest: " + context(PAGES, r"1073741824 \+ 0", 128),
              "quest recent": r"^Quest: " + context(PAGES, rf"8 \+ {HUGE}", 128),
              "tidal top_k": r"^TidalDecode: " + context(SELECTION, rf"{HUGE} \+ 0", 128),
              "tidal recent": r"^TidalDecode: " + context(SELECTION, rf"4 \+ {HUGE}", 128),
              "tidal spec": r"^TidalDecode: " + context(SELECTION, r"100 \+ 29", 128)}
ARTIFACTS = {  # ir.json: the node, the op, the attribute(s), the values and the bound
    "artifact sinks": r"attention: rw\.attention: " + context(RING, rf"{HUGE} \+ 4", 64),
    "artifact window": r"attention_1: rw\.attention: " + context(RING, r"2 \+ 1000000000", 64),
    "artifact duo sinks": r"attention: rw\.attention: " + context(RING, r"100000000 \+ 4", 64),
    "artifact quest budget": r"\w+: rw\.select_pages: " + context(PAGES, r"60 \+ 10", 64),
    "artifact tidal top_k": r"\w+: rw\.select_tokens: " + context(SELECTION, r"65 \+ 0", 64),
    "artifact next_tokens": r"hydra_path: rw\.next_tokens: count must be an integer in \[1, 8\], got 32768"}


@pytest.mark.parametrize("name", STREAMING)
def test_streaming_attention_is_bounded_by_the_context(results, name):
    check(results, name, "ValueError", r"^StreamingAttention: " + STREAMING[name])


@pytest.mark.parametrize("name", DUO)
def test_duo_attention_sinks_given_or_from_a_gates_file_are_bounded(results, name):
    check(results, name, "ValueError", DUO[name])


def test_the_verifier_refuses_sinks_a_pass_writes_itself(results):
    check(results, "verifier sinks", "PassError",
          r"does not verify: attention: rw\.attention: " + context(RING, rf"{HUGE} \+ 4", 128))


@pytest.mark.parametrize("name", SELECTIONS)
def test_selection_widths_are_bounded_by_the_context(results, name):
    check(results, name, "ValueError", SELECTIONS[name])


@pytest.mark.parametrize("name", ARTIFACTS)
def test_a_resealed_artifact_with_such_a_number_is_refused_at_load(results, name):
    check(results, name, "ArtifactError", r"ir\.json: (node )?" + ARTIFACTS[name])


def test_the_cli_run_of_such_an_artifact_is_one_error_line(results):
    status, err = check(results, "cli run artifact sinks", "ok", "")[:2]
    assert status == 2 and err.count("\n") == 1 and err.startswith("rewriter: error: "), err
    assert re.search(r"ir\.json: (node )?attention: rw\.attention: sinks \+ window = 2147483647", err)


def test_a_raised_context_cannot_make_the_ring_allocate_by_its_sinks(results):
    # 2**30 sinks in a model that says its context is 2**31 - 1: within what it says, so it
    # loads; every token of these short rows is a sink (attention is dense), and the ring's
    # sink layout is sized by its slots, not by the sinks
    tokens = check(results, "artifact raised context", "ok", "")
    assert tokens == check(results, "artifact plain", "ok", "")


def test_a_raised_context_cannot_make_a_selection_allocate_by_its_width(results):
    # selections wider than these rows keep every earlier key: dense attention, the plain
    # model's tokens, with nothing sized by the width
    plain = check(results, "artifact wide plain", "ok", "")
    for name in ("artifact raised tidal", "artifact raised quest"):
        assert check(results, name, "ok", "") == plain, name


def test_no_input_allocates_past_the_bound(results):
    # an allocation past HEADROOM fails (the address space is capped), one within it shows
    # in the peak RSS
    capped = {name: str(text)[:200] for name, (kind, text, _) in results["results"].items()
              if kind == "MemoryError" or re.search(r"can't allocate|out of memory", str(text))}
    assert not capped, capped
    grew = {name: (peak - results["baseline"]) >> 20 for name, (_, _, peak) in results["results"].items()}
    assert max(grew.values()) <= MARGIN >> 20, grew  # MiB over the normal run's peak


def test_values_at_the_bound_still_work(results):
    for name in ("streaming at the bound", "quest at the bound"):
        assert len(check(results, name, "ok", "")) == len(ROWS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Hugging Face Llama checkpoint (64 tokens of context, 2 layers of 2 KV heads)
    with a gates file of huge sinks beside it."""
    path = tmp_path_factory.mktemp("cli")
    tiny_checkpoint().save_pretrained(path / "ckpt")
    shutil.copy(rewriter.models.checkpoints.DEFAULT_MODEL_DIR / "tokenizer.json", path / "ckpt")
    _gates_file(path / "gates.json", HUGE, 64, [[0.9, 0.1], [0.1, 0.1]])
    return path


CLI = {f"streaming_attention:sinks={HUGE}": context(RING, rf"{HUGE} \+ 1020", 64),
       "duo_attention:gates=GATES": context(RING, rf"{HUGE} \+ 64", 64),
       "quest:budget=60,recent=5,dense_layers=1": context(PAGES, r"60 \+ 5", 64)}


@pytest.mark.parametrize("spec", CLI)
def test_the_cli_saves_no_artifact_with_such_a_number(checkpoint, capsys, spec):
    before = sorted(p.name for p in checkpoint.iterdir())
    status = main(["optimize", str(checkpoint / "ckpt"), "--out", str(checkpoint / "out"),
                   "--pass", spec.replace("GATES", str(checkpoint / "gates.json"))])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and err.startswith("rewriter: error: "), err
    assert re.search(CLI[spec], err), err
    assert sorted(p.name for p in checkpoint.iterdir()) == before  # no out, nothing written


if __name__ == "__main__":  # the child
    print(json.dumps(child(json.loads(os.environ["REWRITER_BOUNDS_SPEC"]))))
