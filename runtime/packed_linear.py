"""bfloat16 linears on a CPU with their weights packed once for oneDNN.

ATen's bfloat16 ``F.linear`` on a CPU calls oneDNN, which reorders the weight into its
own blocked layout on every call. For a decode step's few rows that reorder is most of
the product: on the project's 2-core Xeon (AMX), a ``[1, 576] x [576, 1536]`` product
took 0.11 ms through ``F.linear`` and 0.05 ms with the weight packed beforehand, and
SmolLM2's 210 linears a step 22.3 ms against 15.5 (weights read from memory, not cache).
So the lowered programs read a packed copy of each bfloat16 CPU weight, made once and
shared by a model's programs (``runtime.lower``), and call oneDNN's linear on it.

Only on a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX), where the values
are oneDNN's either way: the same kernel, given the same layout, equal to ``F.linear`` bit
for bit on every shape the tests try (where oneDNN emulates bfloat16 they differ by a unit
on some shapes). Packing is checked on the machine once a process (``pays``): its values
against ``F.linear``'s on a few products, then its time; kept unless it measures clearly
slower. ``REWRITER_PACKED_LINEAR=on|off`` fixes the choice by hand (``on`` still packs
only where the machine can).
"""
from __future__ import annotations

import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from . import memory

ENV = "REWRITER_PACKED_LINEAR"
# Whether this machine can pack ("machine") and whether packing pays ("bfloat16"): asked at
# the first lowering that could pack (``_probe``), then kept for the process.
_PAYS: dict = {}
# The measured products: one row through 4 weights of SmolLM2's MLP shape (7 MB in all,
# more than a core's cache, as a step's weights are), each side's fastest pass of
# ``_RUNS``. Packing removes work F.linear does on every call, and the two give the same
# values, so it is kept unless it measures clearly slower: a busy machine's timings (on
# 2 cores with another job running, a pass took 10x its time and the faster side flipped
# between runs) then leave the packing in place rather than decide by noise.
_PROBE = (4, 1536, 576)  # weights, out, in
_RUNS = 15
_MARGIN = 1.15
_clock = time.perf_counter  # the probe's clock (a test's fake one)
_LOCK = threading.Lock()


def linear_packed(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """``rw.linear`` on a weight packed by ``pack``: ``x`` ``[..., in]`` -> ``[..., out]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def supported(weight: Tensor) -> bool:
    """Whether ``weight`` can be packed here: a 2-d bfloat16 CPU tensor, and a torch and
    CPU with oneDNN's bfloat16 linear."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.numel() > 0 and _machine_ok())


def _machine_ok() -> bool:
    """A torch with oneDNN's bfloat16 linear, on a CPU that multiplies bfloat16 natively
    (``_native_bf16``): elsewhere oneDNN emulates it, and its packed and unpacked products
    round differently (one bfloat16 unit on some shapes, with AVX-512 alone). Asked once a
    process (every weight of every lowering asks)."""
    if "machine" not in _PAYS:
        _PAYS["machine"] = _machine_check()
    return _PAYS["machine"]


def _machine_check() -> bool:
    mkldnn = torch.ops.mkldnn
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_linear_pointwise")
                and hasattr(mkldnn, "_reorder_linear_weight") and mkldnn._is_mkldnn_bf16_supported()
                and _native_bf16())
    except (AttributeError, RuntimeError):  # an op this torch does not have
        return False


# oneDNN's ISA limits (``ONEDNN_MAX_CPU_ISA``) that keep its native bfloat16 instructions
_NATIVE_ISAS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX",
                "AVX512_CORE_AMX_FP16", "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
                "AVX10_2_512", "AVX10_2_512_AMX_2")


_CPUINFO = "/proc/cpuinfo"


def _native_bf16() -> bool:
    """Whether the CPU has AVX512-BF16 or AMX-BF16 (Linux's ``/proc/cpuinfo`` flags; False
    where there is none to read) and oneDNN is not limited below them."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL"))
    if limit.strip().upper() not in _NATIVE_ISAS:
        return False
    try:
        with open(_CPUINFO) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pays() -> bool:
    """Whether the programs pack their bfloat16 weights: as ``REWRITER_PACKED_LINEAR``
    fixes it (``on`` packs wherever ``supported``), else as measured here."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"{ENV} must be auto, on or off, got {os.environ[ENV]!r}")
    if setting != "auto":
        return setting == "on"
    if "bfloat16" not in _PAYS:
        with _LOCK:
            if "bfloat16" not in _PAYS:
                _PAYS["bfloat16"] = _machine_ok() and _probe()
    return _PAYS["bfloat16"]


def _probe() -> bool:
    """``_same`` and ``_measure``; False where either raises (an op this build lacks)."""
    try:
        return _same() and _measure()
    except (RuntimeError, NotImplementedError):
        return False


def _same() -> bool:
    """Whether packed products give ``F.linear``'s values here, on random weights of two
    shapes and a few row counts (the ones where an emulating oneDNN was seen to differ)."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for out, inner in ((1536, 576), (576, 1536)):
            w = torch.randn(out, inner, generator=g).to(torch.bfloat16)
            packed = pack(w)
            for rows in (1, 2, 7):
                x = torch.randn(rows, inner, generator=g).to(torch.bfloat16)
                if not torch.equal(linear_packed(x, packed), F.linear(x, w)):
                    return False
    return True


def _measure() -> bool:
    """Time ``F.linear`` and packed linears on ``_PROBE``'s products, interleaved: a few
    ms, once a process. False only where packing was clearly slower."""
    n, out, inner = _PROBE
    with torch.inference_mode():
        # the values do not change the time: constant weights are made fastest
        weights = [torch.full((out, inner), 0.01, dtype=torch.bfloat16) for _ in range(n)]
        packed = [pack(w) for w in weights]
        x = torch.full((1, inner), 0.5, dtype=torch.bfloat16)
        calls = {"linear": lambda: [F.linear(x, w) for w in weights],
                 "packed": lambda: [linear_packed(x, p) for p in packed]}
        times: dict = {name: [] for name in calls}
        for run in range(_RUNS + 1):  # a warm-up pass each
            for name, call in calls.items():
                start = _clock()
                call()
                if run:
                    times[name].append(_clock() - start)
    return min(times["packed"]) <= min(times["linear"]) * _MARGIN


def room_for(nbytes: int) -> bool:
    """Whether ``nbytes`` of packed copies fit (``runtime.memory.room_for``: half the
    available memory). ``REWRITER_PACKED_LINEAR=on`` packs regardless."""
    return os.environ.get(ENV, "auto").strip().lower() == "on" or memory.room_for(nbytes)


def _reorder(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# ``weight`` ``[out, in]`` in oneDNN's layout for ``linear_packed`` (an opaque
# ``torch._mkldnn`` tensor of the same shape), made once per weight and version; shared by
# a model's programs, as ``runtime.lower``'s transposed copies are
pack = memory.Copies(_reorder)
