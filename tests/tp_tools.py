"""Launching the tensor-parallel tests' ranks: ``torch.distributed.run`` starts
``tp_worker.py`` in two processes (gloo on 127.0.0.1), bounded by a timeout, and their
results come back per rank."""
from __future__ import annotations

import os
import subprocess
import sys

from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH_TIMEOUT = 600  # seconds: two ranks on a busy 2-core machine, far past a normal run


def launch(tmp_path, names: list[str], world: int = 2, timeout: int = LAUNCH_TIMEOUT,
           extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``tp_worker.py`` on ``world`` ranks for the scenarios ``names``; ends by itself."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "--max-restarts=0", "--monitor-interval=0.1",
           os.path.join(HERE, "tp_worker.py"), str(tmp_path), *names]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=HERE)


def launch_every_scenario(out) -> list[dict]:
    """Every scenario of ``tp_scenarios`` in one launch (the ranks' start-up, ~20 CPU
    seconds, costs more than most scenarios), the split artifact the ``artifact`` scenario
    loads saved first; the ranks' results. Tests read them through the session fixture
    ``tp_ranks`` (tests/conftest.py)."""
    import rewriter
    from conftest import make_model
    from rewriter.passes import FuseQKV, FuseSwiGLU, TensorParallel
    from tp_scenarios import SCENARIOS, UNEVEN
    art = os.path.join(out, "art")
    split = rewriter.optimize(make_model("llama-gqa-3l", **UNEVEN),
                              passes=[FuseQKV(), FuseSwiGLU(), TensorParallel(2)])
    split.save(art)
    done = launch(out, list(SCENARIOS), timeout=2 * LAUNCH_TIMEOUT,  # ~45 scenarios
                  extra_env={"TP_COMPOSE_ARTIFACT": art})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return rank_results(out)


def refusal(ranks: list[dict], name: str) -> list[str]:
    """Each rank's recorded refusal of scenario ``name`` ('' where it ran)."""
    key = f"{name}.refused"
    return [bytes(r[key].tolist()).decode() if key in r else "" for r in ranks]


def rank_results(tmp_path, world: int = 2) -> list[dict]:
    return [load_file(os.path.join(tmp_path, f"rank{r}.safetensors")) for r in range(world)]


def same_as_one_process(ranks: list[dict], names: list[str]) -> list[dict]:
    """For each of ``names`` (run on 2 ranks by ``launch_every_scenario``), every rank's
    greedy tokens equal one process's, log-probabilities within float32 rounding of one
    process's (sums in another order) and bit-equal between the ranks. Returns the ranks'
    results."""
    import torch
    from tp_scenarios import run_whole
    for name in names:
        whole = run_whole(name)
        for r in ranks:
            assert torch.equal(r[f"{name}.tokens"], whole["tokens"]), name
            torch.testing.assert_close(r[f"{name}.logprobs"], whole["logprobs"], rtol=1e-5,
                                       atol=1e-5, msg=name)
        assert torch.equal(ranks[0][f"{name}.logprobs"], ranks[1][f"{name}.logprobs"]), name
    return ranks
