"""``rewriter run ART --tp N``: a split artifact run by N ranks (gloo on 127.0.0.1) prints
what the unsplit artifact prints in one process, started by the command itself or by two
torchrun "hosts"; a rank that raises or hangs ends every rank, with its error, in seconds;
a ``--tp`` that does not fit the artifact is refused by name before any rank starts.
Every launch is bounded by a subprocess timeout and is expected to end by itself."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

import rewriter
from rewriter.cli import main
from rewriter.passes import from_spec

from conftest import make_model

HERE = os.path.dirname(os.path.abspath(__file__))
BOUND = 300  # seconds a launch may take on a busy 2-core machine before the test fails
ENDS_WITHIN = 15  # seconds from a failure to the launch's end: 2-5 measured, the rest is load
STALL_TIMEOUT = 3  # seconds: --tp-timeout of the hung-peer test
IDS = "3,17,5,60,2"
RUN = ["--ids", IDS, "--max-new-tokens", "8"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "0",
            "--monitor-interval", "0.1"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(split over 2 ranks, the same model unsplit) as artifact directories."""
    model = make_model("llama-gqa-3l", initializer_range=0.2)
    root = tmp_path_factory.mktemp("tp_run")
    split = [from_spec("tensor_parallel:world_size=2")]
    rewriter.optimize(model, passes=split).save(root / "split")
    rewriter.optimize(model).save(root / "whole")
    return root / "split", root / "whole"


def _env() -> dict:
    # PYTHONSAFEPATH: the ranks import rewriter from PYTHONPATH, never from their directory
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"}


def _launch(cmd: list[str], cwd) -> tuple[subprocess.CompletedProcess, float]:
    start = time.time()
    done = subprocess.run(cmd, env=_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=BOUND)
    return done, time.time() - start


def _one_process(whole, capsys) -> str:
    assert main(["run", str(whole), *RUN]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_tp_2_prints_what_one_process_prints(artifacts, capsys, tmp_path):
    split, whole = artifacts
    expect = _one_process(whole, capsys)
    assert len(expect.split()) == 5 + 8
    done, wall = _launch([sys.executable, "-m", "rewriter", "run", str(split), "--tp", "2",
                          *RUN], tmp_path)
    print(f"rewriter run --tp 2: {wall:.1f} s")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expect  # rank 0 printed, once; rank 1 printed nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_hosts_on_127_0_0_1(artifacts, capsys, tmp_path):
    """The documented way past one machine: one torchrun per host, node ranks 0 and 1."""
    split, whole = artifacts
    expect = _one_process(whole, capsys)
    port = _free_port()
    start = time.time()
    hosts = [subprocess.Popen(
        [*TORCHRUN, "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "rewriter", "run", str(split), "--tp", "2", *RUN],
        env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)]
    try:
        outs = [h.communicate(timeout=BOUND) for h in hosts]
    finally:
        for h in hosts:
            h.kill()  # only if the bound was hit: both have ended otherwise
    print(f"two torchrun hosts: {time.time() - start:.1f} s")
    assert [h.returncode for h in hosts] == [0, 0], outs[0][1] + outs[1][1]
    assert outs[0][0] == expect and outs[1][0] == ""


def _stamp(text: str, what: str) -> float:
    found = re.findall(rf"{what} at ([0-9.]+)", text)
    assert found, text
    return float(found[0])


def _fail_worker(mode: str, timeout: float, tmp_path):
    """``tp_fail_worker.py`` on 2 ranks through ``rewriter run --tp``'s launcher, its
    error reported as the command reports it."""
    code = ("import sys\nfrom rewriter.cli.tensor_parallel import launch\n"
            "from rewriter.errors import RewriterError\n"
            "try:\n    launch(2, sys.argv[1:])\n"
            "except RewriterError as e:\n    sys.exit(f'rewriter: error: {e}')\n")
    return _launch([sys.executable, "-c", code, os.path.join(HERE, "tp_fail_worker.py"),
                    mode, str(timeout)], tmp_path)


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_with_its_error(tmp_path):
    """Rank 1 raises before a collective rank 0 waits at: ``rewriter run --tp``'s launcher
    ends both in seconds and names rank 1 and its error (not rank 0's lost connection)."""
    done, wall = _fail_worker("raise", 60, tmp_path)
    ended = time.time()
    print(f"a raising rank: launch {wall:.1f} s, ended "
          f"{ended - _stamp(done.stderr, 'raised'):.1f} s after the raise")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rewriter: error: rank 1 of 2 failed: RuntimeError: rank 1 fails "
                           "on purpose"), last
    assert ended - _stamp(done.stderr, "raised") < ENDS_WITHIN


@pytest.mark.slow
def test_a_hung_rank_ends_every_rank_at_the_timeout(tmp_path):
    """Rank 1 alive but silent: rank 0's collective fails with gloo's timeout after
    STALL_TIMEOUT seconds, and torchrun (plain, as a user runs it) stops rank 1 and shows
    rank 0's error, from its error file."""
    done, wall = _launch([*TORCHRUN, "--standalone", "--nproc-per-node", "2",
                          os.path.join(HERE, "tp_fail_worker.py"), "stall", str(STALL_TIMEOUT)],
                         tmp_path)
    ended = time.time()
    waited = ended - _stamp(done.stderr, "waiting")
    print(f"a hung rank: launch {wall:.1f} s, ended {waited:.1f} s after rank 0 began to wait")
    assert done.returncode != 0
    assert re.search(r"Root Cause[\s\S]*rank\s*: 0[\s\S]*Timed out waiting 3000ms", done.stderr)
    assert STALL_TIMEOUT <= waited < STALL_TIMEOUT + ENDS_WITHIN


@pytest.mark.slow
def test_ranks_that_got_different_results_fail(tmp_path):
    """``process_group.agree`` (the check of the generated tokens at the end of a run)."""
    done, wall = _fail_worker("differ", 60, tmp_path)
    print(f"ranks that disagree: {wall:.1f} s")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0
    assert re.fullmatch(r"rewriter: error: rank [01] of 2 failed: RewriterError: ranks \[1\] got "
                        r"different test bytes than rank 0.*", last), last


@pytest.mark.slow
def test_a_process_group_of_the_wrong_size_is_refused(artifacts, tmp_path):
    split, _ = artifacts
    done, wall = _launch([*TORCHRUN, "--standalone", "--nproc-per-node", "1", "-m", "rewriter",
                          "run", str(split), "--tp", "2", *RUN], tmp_path)
    print(f"torchrun with 1 rank for --tp 2: {wall:.1f} s")
    assert done.returncode != 0 and done.stdout == ""
    assert "rewriter: error: --tp 2, but torchrun started 1 rank" in done.stderr


@pytest.mark.parametrize("args,message", [
    (["split"], "is split over 2 ranks (TensorParallel): run it with `rewriter run"),
    (["split", "--tp", "4"], "is split over 2 ranks, not 4: run it with"),
    (["whole", "--tp", "2"], "is not split; split it with `rewriter optimize ... --pass "
                             "tensor_parallel:world_size=2"),
    (["default", "--tp", "2"], "--tp 2: default is not split"),
    (["no/such/dir", "--tp", "2"], "no/such/dir: no such artifact or checkpoint"),
    (["split", "--tp", "2", "--do-sample"], "--do-sample with --tp 2 needs --seed"),
    (["split", "--tp", "0"], "argument --tp: must be an integer in [1, 1024], got '0'"),
    (["split", "--tp", "1025"], "argument --tp: must be an integer in [1, 1024]"),
    (["split", "--tp", "2.0"], "argument --tp: must be an integer"),
    (["split", "--tp", "99999999999999999999"], "argument --tp: must be an integer"),
    (["split", "--tp", "2", "--tp-timeout", "0"], "argument --tp-timeout: must be a number"),
    (["split", "--tp", "2", "--tp-timeout", "nan"], "argument --tp-timeout: must be a number"),
    (["split", "--tp", "2", "--tp-timeout", "inf"], "argument --tp-timeout: must be a number"),
    (["split", "--tp", "2", "--tp-timeout", "1e9"], "argument --tp-timeout: must be a number"),
    (["split", "--tp", "2", "--tp-timeout", "-1"], "argument --tp-timeout: must be a number"),
    (["split", "--tp", "2", "--tp-timeout", "0.0001"], "argument --tp-timeout: must be a number"),
])
def test_a_tp_that_does_not_fit_is_refused_by_name(artifacts, args, message, capsys):
    """Refused in this process, before any rank starts or any weight loads."""
    split, whole = artifacts
    named = {"split": str(split), "whole": str(whole)}
    assert main(["run", named.get(args[0], args[0]), *args[1:], *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rewriter: error: ") and message in err[0], err


def test_the_torchrun_command_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "torchrun --standalone --nproc-per-node N" in out and "--node-rank R" in out
