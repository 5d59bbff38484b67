"""``TensorParallel``: the model split over ``world_size`` ranks, Megatron's way.

    o = linear(attention(...), Wo)            ->  o = all_reduce(linear(attention(...), Wo))
    d = linear(swiglu(linear(x, Wgu)), Wd)    ->  d = all_reduce(linear(swiglu(...), Wd))

Each attention's q/k/v projections are split by columns with whole KV groups per rank
(SmolLM2's 3 KV heads on 2 ranks: heads 0-1 with query heads 0-5, and head 2 with 6-8),
its output projection by rows; each MLP's gate/up (or fc) by columns and down (or proj)
by rows; a sum over ranks (``rw.all_reduce``) follows every row-parallel projection, two
per layer. Embeddings, norms and the LM head stay whole on every rank.

The IR this pass returns keeps whole weights (its sums are the identity there: the IR is
still the model), so it prints, dumps, saves and checks like any other; each rank takes
its slices when its programs are built (``rewriter.ir.shard``), from the same walk this
pass runs for every rank first, so a split that cannot be made (more ranks than KV heads,
an op between the projections it does not know) is refused here, by name. Exact up to
the order of float sums.
"""
from __future__ import annotations

import torch

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.nodes import call, mark
from rewriter.ir.pass_manager import Pass
from rewriter.ir.shard import plan, row_projections
from rewriter.ops.attributes import MAX_WORLD
from rewriter.values import is_int


class TensorParallel(Pass):
    def __init__(self, world_size: int = 2):
        if not is_int(world_size) or not 2 <= world_size <= MAX_WORLD:
            raise ValueError(f"TensorParallel: world_size must be an integer in [2, {MAX_WORLD}], "
                             f"got {world_size!r}")
        self.world_size = world_size

    def run(self, ir: IR) -> IR:
        if "tensor_parallel" in ir.info:
            raise PassError(f"{self!r}: the IR is split already "
                            f"(world_size={ir.info['tensor_parallel']['world_size']})")
        if not ir.is_causal_lm:
            raise PassError(f"{self!r}: only causal language models are split")
        rows = row_projections(ir)
        if not rows:
            raise PassError(f"{self!r}: the IR has no attention or MLP projections to split")
        for rank in range(self.world_size):  # every rank's split, before anything changes
            plan(ir, rows, rank, self.world_size)
        for row in rows:
            _sum_after(ir, row, self.world_size, self.name)
        ir.info["tensor_parallel"] = {"world_size": self.world_size}
        return ir


def _sum_after(ir: IR, row, world: int, pass_name: str) -> None:
    users = list(row.users)
    with ir.graph.inserting_after(row):
        total = mark(call(ir, torch.ops.rw.all_reduce.default, (row, world), "all_reduce"),
                     row, pass_name)
    for user in users:
        user.replace_input_with(row, total)
