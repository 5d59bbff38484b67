"""Room for the copies of the weights the lowered programs read instead of them.

The torch backend keeps derived copies beside a model's weights: float32 weights
transposed (``kernels.linear_t``), bfloat16 weights packed for oneDNN
(``runtime.packed_linear``). Each set is as large as the weights it copies, so a model of
more than about a third of the memory would not fit twice: such copies are made only where
they fit in half the memory the machine has available, and a model whose programs find no
room keeps ``F.linear`` (slower, but there).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

MEMINFO = "/proc/meminfo"
CGROUP = "/sys/fs/cgroup"  # a container's memory limit (cgroup v2), where there is one
SELF_CGROUP = "/proc/self/cgroup"


def available_bytes() -> Optional[int]:
    """What the process may still use, in bytes: Linux's ``MemAvailable``, or less where a
    cgroup's limit leaves less (a container sees the host's memory in ``/proc/meminfo``);
    None where neither is known (another system)."""
    known = [b for b in (_meminfo_available(), _cgroup_available()) if b is not None]
    return min(known) if known else None


def _meminfo_available() -> Optional[int]:
    try:
        with open(MEMINFO) as f:
            kb = next((int(line.split()[1]) for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        return None
    return None if kb is None else kb * 1024


def _cgroup_available() -> Optional[int]:
    """What this process's cgroups (v2) still allow: the least headroom of its own cgroup
    and each parent up to ``CGROUP``, a level's headroom being its limit (``memory.max``,
    or ``memory.high`` where lower: past it the kernel throttles and reclaims) less what it
    uses (``memory.current``), reclaimable file cache (``inactive_file``) not counted as
    used, as ``MemAvailable`` does not count it (a model read from disk leaves its file in
    the cache). None where no level sets a limit; a level whose files do not parse is
    passed over."""
    known = [b for b in map(_level_available, _levels()) if b is not None]
    return min(known) if known else None


def _level_available(folder: str) -> Optional[int]:
    limits = []
    for name in ("memory.max", "memory.high"):
        try:
            with open(f"{folder}/{name}") as f:
                value = f.read().strip()
            if value != "max":
                limits.append(int(value))
        except (OSError, ValueError):
            pass
    if not limits:
        return None
    try:
        with open(f"{folder}/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    try:
        with open(f"{folder}/memory.stat") as f:
            used -= next((int(line.split()[1]) for line in f if line.startswith("inactive_file ")), 0)
    except (OSError, ValueError, IndexError):
        pass
    return max(0, min(limits) - used)


def _levels() -> list[str]:
    """The folders of this process's cgroup (``/proc/self/cgroup``'s ``0::PATH``) and its
    parents, down from ``CGROUP`` itself (inside a container, the container's own). Where
    the path is not one under ``CGROUP`` (a process outside its cgroup namespace's root is
    shown ``/../x``; a container without a namespace is shown the host's path, which it
    does not mount), ``CGROUP`` alone."""
    try:
        with open(SELF_CGROUP) as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), "")
    except OSError:
        path = ""
    parts = [p for p in path.split("/") if p and p != "."] if path.startswith("/") else []
    if ".." in parts or not os.path.isdir(os.path.join(CGROUP, *parts)):
        parts = []
    return [os.path.join(CGROUP, *parts[:i]) for i in range(len(parts) + 1)]


def room_for(nbytes: int) -> bool:
    """Whether ``nbytes`` of new copies fit: at most half the available memory (unknown:
    yes, as before the check existed)."""
    if nbytes <= 0:
        return True
    available = available_bytes()
    return available is None or nbytes <= available // 2


class Copies:
    """One derived copy per weight (``make(weight)``), kept while the weight lives and is
    not written in place: a pass that times its programs lowers a model a dozen times, and
    copying every weight each time was a fifth of ``optimize()`` for SmolLM2 on a CPU. The
    stamp is the weight's version counter and address (``param.data = new``, as
    ``module.to()`` does, keeps the object and its version; the address tells that change).
    A write through ``.data`` bypasses the counter, as it does autograd's: replace the
    weight instead. Weights made under ``inference_mode`` have no counter to trust: their
    copies are made again at every call, never kept (each lowering counts them as new)."""

    def __init__(self, make):
        self._make = make
        self._kept = WeakIdKeyDictionary()

    @staticmethod
    def _stamp(weight: Tensor) -> tuple:
        return weight._version, weight.data_ptr(), weight.dtype, weight.device

    def has(self, weight: Tensor) -> bool:
        """Whether the weight's current copy exists (making it costs no new memory)."""
        if weight.is_inference():
            return False
        kept = self._kept.get(weight)
        return kept is not None and kept[0] == self._stamp(weight)

    def sweep(self) -> None:
        """Drop the copies whose weights were written or replaced since: they are never
        read again, and the memory they hold is what new copies would need."""
        for weight, (stamp, _) in list(self._kept.items()):
            if stamp != self._stamp(weight):
                del self._kept[weight]

    def __call__(self, weight: Tensor) -> Tensor:
        if weight.is_inference():
            return self._make(weight)
        if not self.has(weight):
            self._kept.pop(weight, None)  # a stale copy: not held beside the new one
            with torch.no_grad():
                self._kept[weight] = (self._stamp(weight), self._make(weight.detach()))
        return self._kept[weight][1]
