"""The named step programs a decoding strategy runs, lowered together.

- ``prefill``: the prompt, logits of the last position only;
- ``decode``: any number of tokens per row, logits at every position: one token in plain
  decoding, the last token and the draft (k + 1) when verifying;
- the strategy's own (``runtime.decoding``), e.g. ``draft``, ``verify``, ``heads``.

They share the weights, and the derived copies of them (transposed, int4-packed) through
one dict (``Lowering``). ``Engine.programs()`` returns their code and ``dump()`` writes it.
"""
from __future__ import annotations

from typing import Optional

from torch import fx

from rewriter.ir.core import IR

from .lower import lower
from .lower_heads import lower_heads


class Lowering:
    """Lowers one IR's programs for ``backend``, sharing one derived copy of each weight
    among them; ``kernel_sources``: stored kernels to run as they are (``lower``)."""

    def __init__(self, backend: str, kernel_sources: dict):
        self.backend, self.kernel_sources, self.shared = backend, kernel_sources, {}

    def step(self, ir: IR, last_only: bool, hidden: bool | str = False) -> fx.GraphModule:
        """A step program (``lower``): with ``hidden``, it returns the LM head's input too."""
        return lower(ir, last_only, self.backend, self.shared, self.kernel_sources, hidden=hidden)

    def heads(self, ir: IR, head: Optional[int] = None) -> fx.GraphModule:
        """The draft heads alone, or head ``head`` alone (``lower_heads``)."""
        return lower_heads(ir, self.backend, self.shared, head=head)


def build_programs(ir: IR, backend: str, kernel_sources: dict,
                   strategy) -> dict[str, fx.GraphModule]:
    """``prefill``, ``decode`` and the programs of ``strategy`` (a ``runtime.decoding``
    strategy, which the caller looks up: the builder names none)."""
    lowering = Lowering(backend, kernel_sources)
    programs = {"prefill": lowering.step(ir, True), "decode": lowering.step(ir, False)}
    programs.update(strategy.programs(ir, lowering))
    return programs
