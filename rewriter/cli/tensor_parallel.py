"""``rewriter run ART --tp N``: a model ``TensorParallel`` split, run by N ranks.

Run outside a launcher, the command starts its N ranks itself through
``torch.distributed.run`` (torchrun's own code, in this process); it is

    torchrun --standalone --nproc-per-node N --max-restarts 0 --monitor-interval 0.1 \\
        -m rewriter run ART --tp N ...

Past one machine, torchrun is the way: on each host R of H,

    torchrun --nnodes H --node-rank R --nproc-per-node 1 --master-addr HOST0 \\
        --master-port PORT -m rewriter run ART --tp H ...

Each rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set) joins the process group with a
timeout on every collective (``--tp-timeout``), checks its size is ``--tp`` and the
artifact's, loads the artifact (each rank lowers its own shard of the whole weights),
generates; rank 0 prints. At the end one all-gather checks every rank produced the same
tokens. A rank that fails leaves its error where torchrun looks (``TORCHELASTIC_ERROR_FILE``);
torchrun then stops the others, and ``rewriter run --tp`` reports the first failure.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import traceback
from typing import Callable, Optional

from rewriter.errors import RewriterError

MAX_RANKS = 1024  # rewriter.ops.attributes.MAX_WORLD (not imported: the parser needs no torch)
DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for the slowest rank
LAUNCH = ["--standalone", "--max-restarts", "0", "--monitor-interval", "0.1"]


def tp_count(text: str) -> int:
    """``--tp``: ranks, an integer in [1, MAX_RANKS]; 1 runs in this process alone."""
    if not re.fullmatch(r"[0-9]{1,5}", text.strip()) or not 1 <= int(text) <= MAX_RANKS:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_RANKS}], "
                                         f"got {text!r:.40}")
    return int(text)


def tp_timeout(text: str) -> float:
    """``--tp-timeout``: seconds, checked as ``process_group.check_timeout`` does."""
    from rewriter.runtime.process_group import MAX_TIMEOUT, MIN_TIMEOUT, check_timeout
    try:
        return check_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in [{MIN_TIMEOUT:g}, {MAX_TIMEOUT:g}], "
                                         f"got {text!r:.40}") from None


def split_of(model: str) -> Optional[int]:
    """The ranks the artifact ``model`` is split over (its ``TensorParallel`` pass), None
    for an unsplit artifact or a checkpoint; read from the manifest, nothing loaded."""
    from rewriter.runtime.artifact_dir import is_artifact
    from rewriter.runtime.artifact_manifest import read_manifest
    if not is_artifact(model):
        return None
    for spec in read_manifest(model)["passes"]:
        if isinstance(spec, dict) and spec.get("name") == "TensorParallel":
            world = (spec.get("params") or {}).get("world_size")
            return world if isinstance(world, int) and not isinstance(world, bool) else -1
    return None


def check_split(model: str, tp: int, sampled: bool, seeded: bool) -> None:
    """Refuse, by name and before any rank starts, a ``--tp`` that does not fit ``model``."""
    world = split_of(model)
    how = f"`rewriter run {model} --tp {world}`"
    if world == -1:
        raise RewriterError(f"{model}: its TensorParallel pass records no world_size")
    if world is None and tp > 1:
        raise RewriterError(
            f"--tp {tp}: {model} is not split; split it with `rewriter optimize ... --pass "
            f"tensor_parallel:world_size={tp} --out DIR`, then `rewriter run DIR --tp {tp}`")
    if world is not None and tp == 1:
        raise RewriterError(f"{model} is split over {world} ranks (TensorParallel): run it "
                            f"with {how}, or under torchrun with --tp {world}")
    if world is not None and world != tp:
        raise RewriterError(f"{model} is split over {world} ranks, not {tp}: run it with {how}")
    if tp > 1 and sampled and not seeded:  # every rank must draw the same tokens
        raise RewriterError(f"--do-sample with --tp {tp} needs --seed: every rank draws "
                            f"the tokens, and they must draw alike")


def launch(tp: int, entry: list[str]) -> None:
    """Run ``entry`` (``-m rewriter run ...``, or a script and its arguments) on ``tp``
    ranks of this machine through ``torch.distributed.run``; a failed rank's error is
    raised here as one ``RewriterError`` naming the rank."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    args = get_args_parser().parse_args([*LAUNCH, "--nproc-per-node", str(tp), *entry])
    # the ranks share this machine's cores (torchrun would give each 1, with a warning)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores() // tp)))
    quiet = logging.getLogger("torch.distributed.elastic")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # its table repeats what the ranks printed; ours is below
    try:
        run(args)
    except ChildFailedError as e:
        raise RewriterError(failure_text(e, tp)) from None
    except SignalException:  # Ctrl-C (or a TERM): the launcher has stopped the ranks
        raise KeyboardInterrupt from None
    finally:
        quiet.setLevel(level)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def failure_text(e, tp: int) -> str:
    """The first rank to fail and its error. Ranks that recorded an error (``time``) come
    before ranks without one: those were stopped by the launcher, or died by a signal."""
    def when(item):
        data = item[1].error_file_data.get("message")
        info = data.get("extraInfo", {}) if isinstance(data, dict) else {}
        precise = info.get("time")
        if isinstance(precise, (int, float)):
            return (0, precise, item[0])
        return (1, item[1].timestamp, item[0])
    rank, failure = min(e.failures.items(), key=when)
    data = failure.error_file_data.get("message")
    text = data.get("message") if isinstance(data, dict) else None
    if not isinstance(text, str):  # no error file: killed by a signal, or died too early
        text = f"exit status {failure.exitcode}" + (
            f" ({failure.signal_name()})" if failure.exitcode < 0 else "")
    others = sorted(r for r in e.failures if r != rank)
    also = f" (then rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} " \
           f"ended too)" if others else ""
    return f"rank {rank} of {tp} failed: {text}{also}"


def run_rank(args, generate: Callable[[object], list[int]]) -> int:
    """This rank's part of ``rewriter run --tp``: join the group, run ``generate(out)``
    (rank 0 writes to stdout, the others to nowhere), check every rank got the same tokens,
    leave. A failure is recorded for the launcher, then raised."""
    from rewriter.runtime import process_group as pg
    try:
        rank, size = pg.start(args.tp_timeout)
        if size != args.tp:
            raise RewriterError(f"--tp {args.tp}, but torchrun started {size} rank"
                                f"{'s' if size != 1 else ''} (--nnodes x --nproc-per-node "
                                f"must be {args.tp})")
        tokens = generate(sys.stdout if rank == 0 else _Nowhere())
        pg.agree(" ".join(map(str, tokens)).encode(), "generated tokens")
        return 0
    except Exception as e:
        pg.record_failure(_error_text(e), traceback.format_exc())
        raise
    finally:
        pg.stop()


def _error_text(e: Exception) -> str:
    """The line ``rewriter: error:`` shows for ``e`` (cli.main's), or a bug's name."""
    from rewriter.cli import error_text
    text = error_text(e)
    return " ".join((text if text is not None else f"{type(e).__name__}: {e}").split())


class _Nowhere:
    """stdout of the ranks that print nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def rank_argv(argv: list[str]) -> list[str]:
    """What each rank runs: this command again; it finds torchrun's environment."""
    return ["-m", "rewriter", *argv]
