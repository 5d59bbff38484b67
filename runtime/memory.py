"""Room for the copies of the weights the lowered programs read instead of them.

The torch backend keeps derived copies beside a model's weights: float32 weights
transposed (``kernels.linear_t``), bfloat16 weights packed for oneDNN
(``runtime.packed_linear``). Each set is as large as the weights it copies, so a model of
more than about a third of the memory would not fit twice: such copies are made only where
they fit in half the memory the machine has available, and a program that finds no room
keeps ``F.linear`` (slower, but there).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

MEMINFO = "/proc/meminfo"


def available_bytes() -> Optional[int]:
    """Linux's ``MemAvailable``, in bytes; None where it is not known (another system)."""
    try:
        with open(MEMINFO) as f:
            kb = next((int(line.split()[1]) for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        return None
    return None if kb is None else kb * 1024


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
    copies are made again at every call."""

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

    def __call__(self, weight: Tensor) -> Tensor:
        if weight.is_inference():
            return self._make(weight)
        if not self.has(weight):
            with torch.no_grad():
                self._kept[weight] = (self._stamp(weight), self._make(weight.detach()))
        return self._kept[weight][1]
