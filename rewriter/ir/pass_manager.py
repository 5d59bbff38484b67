"""Passes and the pipeline that runs them.

A pass is a small object: parameters validated in ``__init__`` (bad ones raise
``ValueError`` there), a ``repr`` that shows them, and one method ``run(ir) -> ir``.
``run_pipeline`` runs passes in order; after each one it re-derives shapes and layer
spans and verifies the IR. A pass that fails, or leaves an IR that does not verify,
raises ``PassError`` naming the pass and the passes before it.
"""
from __future__ import annotations

import inspect
import time
from typing import Callable, Sequence

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.verify import verify


class Pass:
    """Base class: subclasses set their parameters as attributes and implement ``run``."""

    def run(self, ir: IR) -> IR:
        raise NotImplementedError

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
                 on_step: Callable[[str, IR], None] | None = None) -> list[dict]:
    """Run ``passes`` over ``ir`` in place; return one record per pass."""
    history = []
    for i, p in enumerate(passes):
        if not isinstance(p, Pass):
            raise TypeError(f"passes[{i}] is {p!r}, not a rewriter Pass")
        start = time.perf_counter()
        before = ", ".join(repr(q) for q in passes[:i]) or "none"
        try:
            result = p.run(ir)
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
