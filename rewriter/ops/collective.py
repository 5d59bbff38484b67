"""The collectives tensor parallelism adds: a sum over ranks, and that sum fused with the
residual add and RMSNorm after it.

The IR ``TensorParallel`` returns holds whole weights: there a row-parallel projection
already computes the whole sum, so the reference of ``all_reduce`` is the identity (a sum
over one rank that holds everything) and the IR stays the model, callable and checked
against eager execution like every other. Each rank's program (``rewriter.ir.shard``) reads
its slice of the weights, and the runtime lowers these ops to ``torch.distributed``
collectives over the ranks (``runtime.collectives``).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from rewriter.ops.norms import _add_rms_norm_fake
from rewriter.ops.registry import REFERENCE, _register


@_register()
def all_reduce(x: Tensor, world_size: int) -> Tensor:
    """The sum of ``x`` over the ``world_size`` ranks of a tensor-parallel model
    (``TensorParallel``); on whole weights, ``x`` itself."""
    return x.clone()  # custom ops may not return an input as their output


def _fused_fake(x, residual, weight, eps, world_size, two_shot_tokens):
    return _add_rms_norm_fake(x, residual, weight, eps)


@_register(fake=_fused_fake)
def all_reduce_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                            world_size: int, two_shot_tokens: Optional[int]) -> tuple[Tensor, Tensor]:
    """``add_rms_norm(all_reduce(x), residual, weight, eps)``: the sum over ranks, the
    residual add and the norm after it as one op (``FuseAllReduceRMSNorm``). Ranks run it
    as all-reduce then add+norm, or from ``two_shot_tokens`` tokens up as reduce-scatter
    over tokens, add+norm of this rank's tokens, all-gather (``runtime.collectives``);
    ``None`` leaves the threshold to the rule for the device the ranks run on."""
    return REFERENCE["add_rms_norm"](x, residual, weight, eps)
