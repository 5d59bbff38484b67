"""Passes and the pipeline that runs them.

A pass is a small object: parameters validated in ``__init__`` (bad ones raise
``ValueError`` there), a ``repr`` that shows them, and one method ``run(ir) -> ir``.
``run_pipeline`` runs passes in order; after each one it re-derives shapes and layer
spans and verifies the IR. A pass that fails, or leaves an IR that does not verify,
raises ``PassError`` naming the pass and the passes before it.

A pass that chooses by timing programs (a tree's shape, a skip set) says so
(``measures = True``) and takes ``run(ir, measurer)``: a ``Measurer`` answers its questions
on the backend and device the model will run on. The runtime implements it
(``rewriter.runtime.measurer``) and ``rewriter.optimize`` hands one over; passes import
nothing from the runtime. Where a chosen value rests on timings, the pass writes where they
were taken into ``ir.info["measured_on"]`` (``Pass.measurer``): they hold on that machine,
not on every one the artifact is loaded on.
"""
from __future__ import annotations

import inspect
import time
from typing import Callable, Optional, Protocol, Sequence

from torch import Tensor

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.verify import verify


class Measurer(Protocol):
    """The questions measuring passes ask of the machine that will run the model (module
    docstring): plain values in, program costs (against the one-token decode program) or
    seconds out."""

    def where(self) -> dict:
        """``{"backend", "device", "machine"}`` (strings): where the timings are taken."""

    def verify_cost(self, ir: IR, most: int, runs: int = 15, batch: int = 1) -> list[float]:
        """``[0, 1, c(2), .., c(most)]``: the decode program over S tokens a row at ``batch``
        rows, against one token."""

    def heads_cost(self, ir: IR, num_heads: int, hydra: bool, runs: int = 15,
                   batch: int = 1) -> float:
        """One call of the draft heads' program against one decode step."""

    def round_times(self, ir: IR, record, batches: Sequence[int],
                    vocab: Optional[Tensor] = None) -> dict[int, dict]:
        """``{batch: {"decode", "plain", "round", "fixed", "rounds"}}`` in seconds: rounds of
        the tree strategy ``record`` (a ``rewriter.decoding.TreeDecoding``) against plain
        steps (``rewriter.measure.round_cost``)."""


class Pass:
    """Base class: subclasses set their parameters as attributes and implement ``run``."""
    measures = False  # True: ``run(ir, measurer)`` (the module docstring)

    def run(self, ir: IR) -> IR:
        raise NotImplementedError

    def measurer(self, ir: IR, measurer: Optional[Measurer]) -> Measurer:
        """``measurer``, once this pass knows it will choose by timing, with where it times
        written into ``ir.info["measured_on"]``; ``PassError`` without one."""
        if measurer is None:
            raise PassError(f"{self!r} times programs to choose its strategy and needs a "
                            f"measurer: rewriter.optimize() gives one, run_pipeline(..., "
                            f"measurer=...) too")
        if "tensor_parallel" in ir.info:  # one process cannot run it; ranks would time apart
            raise PassError(f"{self!r} times programs to choose, and a model TensorParallel "
                            f"split runs only on its ranks (each timing its own would choose "
                            f"apart): run {self.name} before TensorParallel, or give it its "
                            f"choice so that it need not time")
        before = ir.info.get("measured_on") or {"passes": []}
        ir.info["measured_on"] = {**measurer.where(), "passes": [*before["passes"], self.name]}
        return measurer

    @property
    def name(self) -> str:
        return type(self).__name__

    def params(self) -> dict:
        """The constructor's parameters with their current values (stored with artifacts)."""
        sig = inspect.signature(type(self).__init__)
        return {k: getattr(self, k) for k in sig.parameters if k != "self" and hasattr(self, k)}

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.params().items() if v is not None)
        return f"{self.name}({shown})"


def run_pipeline(ir: IR, passes: Sequence[Pass], check: bool = True,
                 on_step: Callable[[str, IR], None] | None = None,
                 measurer: Optional[Measurer] = None) -> list[dict]:
    """Run ``passes`` over ``ir`` in place; return one record per pass. ``measurer`` goes
    to the passes that measure (``Pass.measures``)."""
    history = []
    for i, p in enumerate(passes):
        if not isinstance(p, Pass):
            raise TypeError(f"passes[{i}] is {p!r}, not a rewriter Pass")
        start = time.perf_counter()
        before = ", ".join(repr(q) for q in passes[:i]) or "none"
        try:
            result = p.run(ir, measurer) if p.measures else p.run(ir)
            if result is not ir:  # passes may rebuild the IR; keep one object for the caller
                ir.gm, ir.info = result.gm, result.info
        except ValueError:
            raise  # a parameter that does not fit this model: the pass's own message says which
        except Exception as e:
            raise PassError(f"pass {p!r} failed: {e} (passes before it: lift, {before})") from e
        try:
            if check:
                verify(ir, shapes=False)  # lint and weights first: shapes need a sound graph
            ir.refresh()
            if check:
                verify(ir)
        except Exception as e:
            raise PassError(f"pass {p!r} left an IR that does not verify: {e} "
                            f"(passes before it: lift, {before})") from e
        history.append({"pass": p.name, "params": p.params(), "repr": repr(p),
                        "seconds": time.perf_counter() - start})
        if on_step is not None:
            on_step(p.name, ir)
    return history
