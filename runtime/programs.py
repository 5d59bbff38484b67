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

from torch import Tensor, fx

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


def kernel_files(programs: dict, templates: bool = False) -> dict[str, str]:
    """File name -> Triton source of every kernel generated for ``programs`` (and, with
    ``templates``, of the template modules they build on)."""
    out = {f"{k.name}.py": k.source for program in programs.values()
           for k in program.generated_kernels}
    if templates:
        import inspect
        from rewriter.codegen import TEMPLATES
        out.update({f"templates/{m.__name__.rsplit('.', 1)[-1]}.py": inspect.getsource(m)
                    for m in TEMPLATES})
    return out


def lowering_key(ir: IR) -> tuple:
    """What programs lowered from ``ir`` go stale with: the IR's version (``ir.refresh()``),
    its nodes (added or removed by hand), and its weights, written in place or replaced
    (the programs read derived copies of them: transposed, packed, 4-bit tables)."""
    return getattr(ir, "version", 0), tuple(map(id, ir.graph.nodes)), _weights_stamp(ir)


def _weights_stamp(ir: IR) -> tuple:
    """What changes when any of the IR's weights is written in place (its version counter)
    or replaced (its address, e.g. ``param.data = new``). Tensors made under
    ``inference_mode`` count by address alone (they keep no version), tensors without an
    address (sparse, uninitialised) by identity. (A weight replaced twice between calls
    could land at its first address again: not seen.)"""
    return tuple((_address(t), None if t.is_inference() else t._version)
                 for t in ir.weights().values())


def _address(t: Tensor) -> int:
    try:
        return t.data_ptr()
    except (RuntimeError, ValueError):
        return id(t)
