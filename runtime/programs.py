"""The named step programs a decoding strategy runs, lowered together.

- ``prefill``: the prompt, logits of the last position only;
- ``decode``: any number of tokens per row, logits at every position: one token in plain
  decoding, the last token and the draft (k + 1) when verifying;
- ``draft`` (self-speculative): the IR with its skip set bypassed (``rewriter.ir.skip``),
  last-position logits.

They share the weights, and the derived copies of them (transposed, int4-packed) through
one dict. ``Engine.programs()`` returns their code and ``dump()`` writes it.
"""
from __future__ import annotations

from torch import fx

from rewriter.decoding import strategy_of
from rewriter.ir.core import IR
from rewriter.ir.skip import check_skip_set, skipped

from .lower import lower


def build_programs(ir: IR, backend: str, kernel_sources: dict) -> dict[str, fx.GraphModule]:
    shared: dict = {}  # one derived copy of each weight for every program
    programs = {"prefill": lower(ir, True, backend, shared, kernel_sources),
                "decode": lower(ir, False, backend, shared, kernel_sources)}
    s = strategy_of(ir.info)
    if s.name == "self_speculative":
        # the record against this IR: a later pass, or an edited artifact, may not fit it
        check_skip_set(ir, s.skip_layers, s.skip_attention, s.skip_mlp)
        draft = skipped(ir, s.skip_layers, s.skip_attention, s.skip_mlp)
        programs["draft"] = lower(draft, True, backend, shared, kernel_sources)
    return programs
