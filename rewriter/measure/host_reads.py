"""What a piece of code reads back from tensors and copies to them from the host, counted.

On a GPU every read back (``tolist``, ``item``, ``bool`` of a tensor) and every copy from
pageable host memory waits for the work queued before it, so their number, not the ops'
cost, bounds how fast a decoding round goes there. The same calls are made on a CPU, so
they can be counted there (``tests/test_host_reads.py``; ``benchmarks/round_reads.py`` at
commit ef67032).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter]:
    """Within the block, count ``reads`` (the calls of ``READS`` on any tensor) and
    ``copies`` (``torch.tensor`` calls) into the Counter it yields. Not thread-safe: it
    patches ``torch`` for the whole process while the block runs."""
    count: collections.Counter = collections.Counter()
    real = {name: getattr(torch.Tensor, name) for name in READS}
    tensor = torch.tensor

    def reading(name):
        def read(self, *args, **kwargs):
            count["reads"] += 1
            return real[name](self, *args, **kwargs)
        return read

    def copying(*args, **kwargs):
        count["copies"] += 1
        return tensor(*args, **kwargs)
    try:
        for name in READS:
            setattr(torch.Tensor, name, reading(name))
        torch.tensor = copying
        yield count
    finally:
        for name in READS:
            setattr(torch.Tensor, name, real[name])
        torch.tensor = tensor
