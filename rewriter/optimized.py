"""``optimize()`` and the ``OptimizedModel`` it returns."""
from __future__ import annotations

import copy
import os
from typing import Sequence

import torch
from torch import fx, nn

from .frontend import build_ir
from .ir.core import IR
from .ir.dump import Dumper
from .ir.verify import verify
from .pass_manager import Pass, run_pipeline

BACKENDS = ("torch",)


class OptimizedModel:
    """The optimized program: call it for logits, print ``.ir``, ``dump()`` every pass."""

    def __init__(self, ir: IR, passes: list[Pass], history: list[dict], backend: str,
                 snapshots: list[tuple[str, IR]] | None = None):
        self.ir = ir
        self.passes = passes
        self.history = history
        self.backend = backend
        self._snapshots = snapshots or []

    def __call__(self, *inputs: torch.Tensor, positions: torch.Tensor | None = None):
        if not self.ir.is_causal_lm:
            return self.ir.gm(*inputs)
        (input_ids,) = inputs
        check_token_ids(input_ids, self.ir.info["config"].get("vocab_size"))
        if positions is None:
            b, s = input_ids.shape
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        with torch.no_grad():
            return self.ir.gm(input_ids, positions)

    def dump(self, directory: str | os.PathLike) -> None:
        """Write the IR after every pass (text, DOT, op diff) into ``directory``."""
        dumper = Dumper(directory)
        for name, ir in self._snapshots:
            dumper.write(name, ir)

    def __repr__(self) -> str:
        return f"OptimizedModel({self.ir.summary()}, passes={self.passes}, backend={self.backend!r})"


def optimize(model: nn.Module, passes: Sequence[Pass] = (), backend: str = "torch",
             check: bool = True, dump: str | os.PathLike | None = None,
             example_inputs: tuple | None = None) -> OptimizedModel:
    """Trace ``model``, lift it into the canonical IR, and run ``passes`` in order.

    ``check`` verifies the IR after every pass; ``dump`` (or ``$REWRITER_DUMP``) writes the
    IR after every pass into a directory. ``example_inputs`` is needed only for modules that
    are not Hugging Face causal LMs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    passes = list(passes)
    ir = build_ir(model, example_inputs)
    if check:
        verify(ir)
    snapshots = [("lift", _snapshot(ir))]
    history = run_pipeline(ir, passes, check=check,
                           on_step=lambda name, cur: snapshots.append((name, _snapshot(cur))))
    opt = OptimizedModel(ir, passes, history, backend, snapshots)
    dump = dump or os.environ.get("REWRITER_DUMP")
    if dump:
        opt.dump(dump)
    return opt


def _snapshot(ir: IR) -> IR:
    """A copy of the graph (nodes copied, weights and fake values shared) for dumps, so
    later passes do not change what an earlier step shows."""
    graph = fx.Graph()
    out = graph.graph_copy(ir.gm.graph, {})
    graph.output(out)
    return IR(fx.GraphModule(ir.gm, graph), copy.deepcopy(ir.info))


def check_token_ids(ids: torch.Tensor, vocab: int | None) -> None:
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got "
                         f"{ids.dtype} {list(ids.shape)}")
    if ids.numel() and vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab})")
