"""A program called with the same shapes every time, replayed from a CUDA graph.

A decoding loop calls its programs with inputs whose shapes are fixed for a given round:
the decode step (one token a row), a self-speculative draft step, the verification of
``k + 1`` tokens or of a token tree of ``m`` nodes, the draft heads. ``Replay`` holds
fixed input buffers and builds the call on them (the step included, whose write
positions are device tensors: a ``Step`` whose start is a device scalar or a ``[B]``
tensor, and whose ``end`` is the cache's length), so every call runs the same kernels on the same
addresses. On CUDA the first call runs eagerly (compiling and warming everything), the
second is captured in a CUDA graph, and from then on a call is a buffer copy and
``graph.replay()``: no per-kernel launch cost, which is what a small model's step on a GPU
is made of. Elsewhere the same fixed-shape call runs eagerly (testable on a CPU).

The outputs of a replayed graph are its own tensors, overwritten by the next replay: a
caller reads them before calling the same ``Replay`` again.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import Tensor


class Replay:
    """``run(*buffers)`` (a program call built on ``buffers``), callable with new values
    for the buffers: ``replay(*values)`` copies them in and runs (or replays) the call.

    ``inputs`` give the buffers' shapes, dtypes and device (their values are copied). The
    eager call runs on the stream the capture will use: libraries that create handles per
    stream on first use (cuBLAS, cuBLASLt) must not do so inside the capture. A call that
    cannot be captured warns once and runs eagerly from then on."""

    def __init__(self, run: Callable[..., Any], inputs: Sequence[Tensor], cuda_graph: bool,
                 name: str = "step"):
        self.run, self.name, self.cuda_graph = run, name, cuda_graph
        self.buffers = [t.detach().clone() for t in inputs]
        self.graph, self.outputs = None, None
        self.calls, self.warm = 0, False  # calls; whether an eager call ran on CUDA
        self.stream = torch.cuda.Stream(self.buffers[0].device) if cuda_graph else None

    def __call__(self, *values: Tensor):
        if len(values) != len(self.buffers):
            raise TypeError(f"{self.name}: {len(values)} inputs for {len(self.buffers)} buffers")
        for buffer, value in zip(self.buffers, values):
            if value.shape != buffer.shape:  # copy_ would broadcast it, silently
                raise ValueError(f"{self.name}: an input of shape {list(value.shape)} for a "
                                 f"buffer of {list(buffer.shape)}")
            buffer.copy_(value)
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        if not self.cuda_graph:
            return self.run(*self.buffers)
        self.stream.wait_stream(torch.cuda.current_stream())  # the copies above
        if not self.warm:
            with torch.cuda.stream(self.stream):
                out = self.run(*self.buffers)
            torch.cuda.current_stream().wait_stream(self.stream)
            for t in _tensors(out):
                t.record_stream(torch.cuda.current_stream())  # used there, made here
            self.warm = True  # the next call captures
            return out
        graph = torch.cuda.CUDAGraph()  # kept only once its capture has succeeded
        try:
            with torch.cuda.graph(graph, stream=self.stream):  # recorded, not run
                outputs = self.run(*self.buffers)
        except RuntimeError as e:  # a call that cannot be captured still runs, eagerly
            warnings.warn(f"the {self.name} could not be captured as a CUDA graph and runs "
                          f"without one: {str(e).splitlines()[0]}", RuntimeWarning, stacklevel=2)
            torch.cuda.synchronize(self.stream.device)
            self.cuda_graph = False
            # run() builds a fresh step: the failed capture left recorded, never computed
            # values in the old one's per-step cache (masks, indices)
            return self.run(*self.buffers)
        self.graph, self.outputs = graph, outputs
        self.graph.replay()
        return self.outputs


class Replays:
    """The replays an engine keeps across generations for its current cache (``bind``), by
    key (a program and its shapes): made on first use, the least recently used dropped
    beyond ``limit`` (each may hold a CUDA graph and its memory; an adaptive tree verifies
    many sub-trees). A call holds the cache and a program: the engine binds a new cache, and
    clears the store when its programs are rebuilt. Loops on another cache (a stream paused
    while a later call got a cache of its own) keep replays of their own (``serves``)."""

    def __init__(self, limit: int = 16):
        self.limit, self.items, self.cache = limit, {}, None

    def bind(self, cache) -> None:
        """Serve ``cache`` from now on; the replays of the one before are dropped."""
        self.items.clear()
        self.cache = cache

    def serves(self, cache) -> bool:
        return cache is self.cache

    def get(self, key, make: Callable[[], Replay]) -> Replay:
        replay = self.items.pop(key, None)
        if replay is None:
            replay = make()
            while len(self.items) >= self.limit:
                del self.items[next(iter(self.items))]
        self.items[key] = replay  # the most recent last
        return replay

    def clear(self) -> None:
        self.items.clear()

    def __len__(self) -> int:
        return len(self.items)

    def keys(self) -> list:
        return list(self.items)


def _tensors(out) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    return [t for t in out if isinstance(t, Tensor)] if isinstance(out, (tuple, list)) else []
