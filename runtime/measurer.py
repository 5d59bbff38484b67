"""``RuntimeMeasurer``: the runtime's answers to what measuring passes ask
(``rewriter.ir.pass_manager.Measurer``), timed on the backend and device the model runs on.

``verify_cost`` and ``heads_cost`` time the step programs alone, in units of the decode
program's time; ``decoding.tuning.round_times`` times whole tree rounds and plain steps
(``rewriter.measure.round_cost`` says why both). On CUDA the programs are timed as the
engine's rounds call them there: on fixed buffers, replayed from a CUDA graph
(``runtime.replay``), where an eager call is mostly kernel launches.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional, Sequence

import torch

from rewriter.ir.core import IR
from rewriter.measure.calibrate import prompt_length
from rewriter.measure.machine import device_name
from rewriter.measure.round_cost import NEW

from .attention import Step
from .decoding.tuning import round_times, sync
from .engine import BACKENDS
from .kv_cache import KVCache, cache_table
from .lower import logits_node, lower
from .lower_heads import lower_heads
from .replay import Replay


class RuntimeMeasurer:
    """Times programs lowered for ``backend`` on ``device`` (the model's); ``static``: as
    the engine's static loops run them (the default on CUDA)."""

    def __init__(self, backend: str = "torch", device: torch.device | str = "cpu",
                 static: Optional[bool] = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
        if static is not None and not isinstance(static, bool):
            raise ValueError(f"static must be None, True or False, got {static!r}")
        self.backend, self.device, self.static = backend, _device(device), static

    def __repr__(self) -> str:
        return f"RuntimeMeasurer({self.backend!r}, {str(self.device)!r})"

    def where(self) -> dict:
        return {"backend": self.backend, "device": str(self.device),
                "machine": device_name(self.device)}

    def verify_cost(self, ir: IR, most: int, runs: int = 15, batch: int = 1) -> list[float]:
        _counts(most=most, runs=runs, batch=batch)
        return verify_cost(self._on_device(ir), most, runs, batch, self.static, self.backend)

    def heads_cost(self, ir: IR, num_heads: int, hydra: bool, runs: int = 15,
                   batch: int = 1) -> float:
        _counts(num_heads=num_heads, runs=runs, batch=batch)
        return heads_cost(self._on_device(ir), num_heads, hydra, runs, batch, self.static,
                          self.backend)

    def round_times(self, ir: IR, record, batches: Sequence[int],
                    vocab: Optional[torch.Tensor] = None, new: int = NEW) -> dict[int, dict]:
        return round_times(self._on_device(ir), record, batches, vocab, new, self.static,
                           self.backend)

    def _on_device(self, ir: IR) -> IR:
        """``ir``, whose weights must be where the timings are said to be taken."""
        device = _weight(ir).device
        if device.type != self.device.type or (self.device.index is not None
                                               and device != self.device):
            raise ValueError(f"{self!r} times programs on {self.device}, the IR's weights are "
                             f"on {device}")
        return ir


def _device(device) -> torch.device:
    """``device`` as a torch device this machine has, else a ``ValueError`` naming it."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"RuntimeMeasurer: {device!r} is not a device (cpu, cuda, cuda:N)") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"RuntimeMeasurer: {device!r}: this machine has no CUDA device")
    return d


def _counts(**counts) -> None:
    """Each count an int >= 1, else a ``ValueError`` naming it."""
    for name, v in counts.items():
        if type(v) is not int or v < 1:
            raise ValueError(f"RuntimeMeasurer: {name} must be an int >= 1, got {v!r}")


def verify_cost(ir: IR, most: int, runs: int = 15, batch: int = 1,
                static: Optional[bool] = None, backend: str = "torch") -> list[float]:
    """``[0, 1, c(2), ..., c(most)]``: the decode program's time over S tokens a row at
    ``batch`` rows after a 64-token prompt (shorter where the context is), divided by its
    time over one token a row (medians of ``runs``). ``static`` (the default on CUDA):
    timed on fixed buffers and replayed from a CUDA graph (``_replayed``)."""
    program = lower(ir, False, backend, {})
    weight = _weight(ir)
    device = weight.device
    static = device.type == "cuda" if static is None else static
    at = prompt_length(ir, most)
    cache = KVCache(cache_table(ir.gm), batch, at + most, weight.dtype, device)
    start = torch.full((batch,), at, device=device)  # [B]: a static step's per-row start
    calls = {}
    for s in range(1, most + 1):
        ids = torch.zeros(batch, s, dtype=torch.long, device=device)
        positions = torch.arange(at, at + s, device=device)[None].expand(batch, s)
        if static:
            calls[s] = _replayed(lambda ids, positions, start, s=s: program(  # noqa: E731
                Step(cache, start, s, None, end=cache.max_len), ids, positions),
                (ids, positions, start))
        else:
            calls[s] = _eager(program, lambda s=s: Step(cache, at, s, None), ids, positions)
    times: dict[int, list[float]] = {s: [] for s in calls}
    warm = 2 if static else 1  # a replay's first call runs eagerly, its second captures
    for r in range(runs + warm):  # interleaved, so drifts hit every length alike
        for s, call in calls.items():
            seconds = _timed(call, device)
            if r >= warm:
                times[s].append(seconds)
    one = statistics.median(times[1])
    return [0.0] + [statistics.median(times[s]) / one for s in times]


def heads_cost(ir: IR, num_heads: int, hydra: bool, runs: int = 15, batch: int = 1,
               static: Optional[bool] = None, backend: str = "torch") -> float:
    """One call of the draft heads' program (Medusa: all heads on a row; Hydra: one head on
    four paths a row, a level's typical call) over one decode step, at ``batch`` rows
    (medians); ``static`` as for ``verify_cost``."""
    decode = lower(ir, False, backend, {})
    heads = lower_heads(ir, backend, {}, head=0 if hydra else None)
    weight = _weight(ir)
    device = weight.device
    static = device.type == "cuda" if static is None else static
    h = logits_node(ir).args[0].meta["val"]
    rows = 4 if hydra else 1
    x = torch.zeros(batch, rows, h.shape[-1], dtype=h.dtype, device=device)
    args = (x, torch.zeros(batch, rows, num_heads, dtype=torch.long, device=device)) \
        if hydra else (x,)
    cache = KVCache(cache_table(ir.gm), batch, 65, weight.dtype, device)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    at = prompt_length(ir, 1)
    positions = torch.full((batch, 1), at, device=device)
    if static:
        start = torch.full((batch,), at, device=device)  # [B]
        step = _replayed(lambda ids, positions, start: decode(  # noqa: E731
            Step(cache, start, 1, None, end=cache.max_len), ids, positions), (ids, positions, start))
        head = _replayed(heads, args)
    else:
        step = _eager(decode, lambda: Step(cache, at, 1, None), ids, positions)

        def head():
            with torch.inference_mode():
                return heads(*args)
    step_t, head_t = [], []
    warm = 2 if static else 1  # a replay's first call runs eagerly, its second captures
    for r in range(runs + warm):
        step_s, head_s = _timed(step, device), _timed(head, device)
        if r >= warm:
            step_t.append(step_s)
            head_t.append(head_s)
    return statistics.median(head_t) / statistics.median(step_t)


def _weight(ir: IR) -> torch.Tensor:
    """The IR's largest floating-point weight: its dtype and device are the model's."""
    return max((t for t in ir.weights().values() if t.is_floating_point()), key=torch.Tensor.numel)


def _timed(call, device: torch.device) -> float:
    """Seconds of ``call()``, its device work included."""
    sync(device)
    t = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - t


def _eager(program, step, *inputs):
    """A no-argument call of ``program(step(), *inputs)``."""
    def call():
        with torch.inference_mode():
            return program(step(), *inputs)
    return call


def _replayed(run, inputs: tuple):
    """A no-argument call of ``run(*inputs)`` through a ``Replay`` (``runtime.replay``):
    fixed buffers, and a CUDA graph on CUDA."""
    def inside(*buffers):
        with torch.inference_mode():
            return run(*buffers)
    replay = Replay(inside, inputs, inputs[0].device.type == "cuda", "timed call")
    return lambda: replay(*inputs)
