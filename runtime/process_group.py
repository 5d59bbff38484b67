"""The ranks of a split model: the default process group, started from the environment
``torchrun`` (``torch.distributed.run``) gives each rank, with a timeout on every
collective, and what a rank that fails leaves for the launcher to show. (torch is
imported where it is used: the command line checks its options with this module.)

    if launched():                       # RANK, WORLD_SIZE, LOCAL_RANK are set
        rank, size = start(timeout=60)   # gloo (nccl with cuda=True)
        ...                              # load the artifact: each rank takes its shard
        agree(tokens_bytes, "generated tokens")
        stop()

The timeout bounds every collective and the rendezvous: a rank that died or hangs ends
its peers with gloo's (or NCCL's) timeout error instead of torch's default of 30 minutes.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import time

from rewriter.errors import RewriterError

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # what torchrun sets in every rank
MIN_TIMEOUT = 1.0
MAX_TIMEOUT = 24 * 3600.0  # seconds: a collective a day late is a hang


def launched() -> bool:
    """Whether this process is a rank that ``torchrun`` started."""
    return all(name in os.environ for name in LAUNCHER_ENV)


def check_timeout(seconds) -> float:
    """A collective timeout in seconds: finite, at least a second (gloo counts whole
    milliseconds, and a rendezvous needs some), at most a day."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not MIN_TIMEOUT <= seconds <= MAX_TIMEOUT:  # NaN fails the comparison too
        raise ValueError(f"the collective timeout must be a number of seconds in "
                         f"[{MIN_TIMEOUT:g}, {MAX_TIMEOUT:g}], got {seconds!r}")
    return float(seconds)


def start(timeout: float, cuda: bool = False) -> tuple[int, int]:
    """Join the default process group that ``torchrun``'s environment describes, every
    collective bounded by ``timeout`` seconds: gloo on CPUs; NCCL with this rank's GPU
    (``LOCAL_RANK``) when ``cuda``. Returns (rank, size)."""
    import torch
    import torch.distributed as dist
    timeout = check_timeout(timeout)
    if not launched():
        raise RewriterError(f"no launcher: {', '.join(LAUNCHER_ENV)} must be set (start "
                            f"the ranks with torchrun)")
    if dist.is_initialized():
        raise RewriterError("a process group is running already in this process")
    backend, device = "gloo", None
    if cuda:
        device = torch.device("cuda", _local_rank())
        torch.cuda.set_device(device)
        backend = "nccl"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout),
                                device_id=device)
    except (RuntimeError, ValueError) as e:  # the store not reached, a bad RANK, ...
        raise RewriterError(f"the process group did not start ({backend}, timeout "
                            f"{timeout:g} s): {_one_line(e)}") from None
    return dist.get_rank(), dist.get_world_size()


def _local_rank() -> int:
    import torch
    text = os.environ["LOCAL_RANK"]
    if not text.isdigit() or int(text) >= max(torch.cuda.device_count(), 1):
        raise RewriterError(f"LOCAL_RANK={text!r:.20} names no GPU of this machine "
                            f"({torch.cuda.device_count()} present)")
    return int(text)


def agree(data: bytes, what: str) -> None:
    """Every rank holds the same ``data``, or every rank raises (``differing``)."""
    differ = differing(data)
    if differ:
        raise RewriterError(f"ranks {differ} got different {what} than rank 0")


def differing(data: bytes) -> list[int]:
    """The ranks whose ``data`` differs from rank 0's: one all-gather of its SHA-256 digest
    (bounded by the group's timeout), the same answer on every rank."""
    import torch
    import torch.distributed as dist
    digest = torch.tensor(list(hashlib.sha256(data).digest()), dtype=torch.uint8)  # [32]
    if dist.get_backend() == "nccl":
        digest = digest.to(torch.device("cuda", torch.cuda.current_device()))
    every = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(every, digest)
    return [r for r, d in enumerate(every) if not torch.equal(d, every[0])]


def stop() -> None:
    """Leave the default process group, if this process joined one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def record_failure(message: str, callstack: str = "") -> None:
    """Leave ``message`` where the launcher looks for this rank's error
    (``TORCHELASTIC_ERROR_FILE``, the JSON torch.distributed.elastic's ``record`` writes),
    so torchrun's failure report and ``rewriter run --tp`` show it. ``time`` is precise: a
    peer that failed because this rank went away fails in the same second, later."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack or message,
                                      "timestamp": str(int(now)), "time": now}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the report loses its text; the rank's own stderr still has it


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:500]
