"""Static layer skipping: remove whole decoder layers from the IR.

``LayerSkip(layers=[...])`` drops the named layers. ``LayerSkip(speedup=s)`` keeps
``round(L / s)`` layers (half rounds up) chosen as the Unified Layer Skipping paper does: the first and the
last layer always stay, and the kept ones are spread evenly through the middle.
A skipped layer's output is replaced by its input (the residual stream passes through),
so its nodes and its weights leave the graph.
"""
from __future__ import annotations

import math
from typing import Sequence

from rewriter.errors import PassError
from rewriter.ir.sharing import readers_of
from rewriter.ir.skip import layer_joining_fusion
from rewriter.ir.core import IR
from rewriter.ops import OPS
from rewriter.ir.pass_manager import Pass
from rewriter.values import is_int


class LayerSkip(Pass):
    def __init__(self, layers: Sequence[int] | None = None, speedup: float | None = None):
        if (layers is None) == (speedup is None):
            raise ValueError("LayerSkip takes exactly one of layers=[...] or speedup=s")
        if layers is not None:
            if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)):
                raise ValueError(f"LayerSkip: layers must be a list of layer indices, got {layers!r}")
            layers = [_as_index(i) for i in layers]
            if len(set(layers)) != len(layers):
                raise ValueError(f"LayerSkip: layers {layers} names a layer twice")
            if not layers:
                raise ValueError("LayerSkip: layers=[] skips nothing; give at least one index")
        if speedup is not None:
            if isinstance(speedup, bool) or not isinstance(speedup, (int, float)):
                raise ValueError(f"LayerSkip: speedup must be a number, got {speedup!r}")
            if not math.isfinite(speedup):
                raise ValueError(f"LayerSkip: speedup must be a finite number, got {speedup}")
            if not speedup >= 1.0:
                raise ValueError(f"LayerSkip: speedup must be >= 1, got {speedup}")
        self.layers = sorted(layers) if layers is not None else None
        self.speedup = float(speedup) if speedup is not None else None

    def choose(self, present: list[int]) -> list[int]:
        """The layer indices to skip, out of the ``present`` ones."""
        if self.layers is not None:
            missing = [i for i in self.layers if i not in present]
            if missing:
                raise ValueError(f"LayerSkip: layer {missing[0]} is out of range; the model has "
                                 f"layers {_ranges(present)}")
            if len(self.layers) == len(present):
                raise ValueError(f"LayerSkip: layers={self.layers} would skip every layer")
            return list(self.layers)
        keep = kept_positions(len(present), self.speedup)
        return [idx for pos, idx in enumerate(present) if pos not in keep]

    def run(self, ir: IR) -> IR:
        if not ir.layers:
            raise PassError(f"{self!r} needs decoder layers, and the frontend found none in "
                            f"this {ir.info.get('family', 'model')}")
        joined = layer_joining_fusion(ir)
        if joined:
            raise PassError(f"{self!r} must run before {joined}: a fused add + norm "
                            f"joins two layers, so neither can be skipped alone")
        if any(ir.graph.find_nodes(op="call_function", target=OPS["select_tokens"])):
            raise PassError(f"{self!r} must run before TidalDecode: a skipped layer may be the "
                            f"one whose cache the token selection reads")
        spans = {s["index"]: s for s in ir.layers}
        skip = self.choose(sorted(spans))
        read = {o: [r for r in rs if r not in skip] for o, rs in readers_of(ir.graph, skip).items()}
        read = {o: rs for o, rs in read.items() if rs}
        if read:
            owner = min(read)
            raise PassError(f"{self!r}: layer {owner} owns the KV cache that layers {read[owner]} "
                            f"read (ShareKV): it cannot be removed while they stay")
        bypass = {}  # skipped layer's output -> the stream that now flows past it
        for index in skip:  # ascending, so a run of skipped layers chains through
            out, inp = ir.node(spans[index]["output"]), ir.node(spans[index]["input"])
            bypass[out] = bypass.get(inp, inp)
            out.replace_all_uses_with(bypass[out])
        ir.prune()
        ir.info["skipped_layers"] = sorted(set(ir.info.get("skipped_layers", [])) | set(skip))
        return ir


def kept_positions(num_layers: int, speedup: float) -> set[int]:
    """Positions kept for a target speedup: first, last, and evenly spaced between."""
    wanted = int(num_layers / speedup + 0.5)  # round half up: 2.5 layers -> 3
    keep = min(num_layers, max(min(2, num_layers), wanted))
    if keep == 1:
        return {0}
    return {round(i * (num_layers - 1) / (keep - 1)) for i in range(keep)}


def _as_index(i) -> int:
    if not is_int(i) or i < 0:  # numpy integers too, as generate takes them
        raise ValueError(f"LayerSkip: layers must hold non-negative integers, got {i!r}")
    return int(i)


def _ranges(present: list[int]) -> str:
    if present == list(range(len(present))):
        return f"0..{len(present) - 1}"
    return str(present)
