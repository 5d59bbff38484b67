"""The sums over ranks of a tensor-parallel model, on ``torch.distributed``.

``rw.all_reduce`` lowers to the functional all-reduce (``_c10d_functional``, the ops
``torch.compile`` and DTensor emit: a pure graph, a result to wait on), and
``rw.all_reduce_add_rms_norm`` to one of two forms, chosen per call from shapes alone, so
every rank chooses alike without a word between them:

- *reference*: all-reduce, then the backend's fused add + RMSNorm on every token;
- *two-shot* (from ``two_shot_tokens`` tokens up, and at least one token per rank):
  reduce-scatter over tokens, add + RMSNorm of this rank's share of the tokens, all-gather
  of the normed rows and the new residual (TensorRT-LLM's two-shot kernel, vLLM's
  sequence-parallel rewrite, TokenWeave's split, here on plain collectives).

``two_shot_tokens=None`` leaves the threshold to the device the ranks run on
(``TWO_SHOT_FROM``): on CUDA two-shot above 128 tokens (TensorRT-LLM's rule), on CPUs never
(with gloo the two-shot form took 1.5-3.8x the reference's time at 8-2048 tokens of width
576: two collectives cost more than the add + norm they save; docs/tensor_parallel.md).
The ranks of a group run on one kind of device, so every rank reads the same entry.

The ranks are the default process group's (``torch.distributed.init_process_group``, which
``rewriter run --tp`` calls with a timeout); its size must be the model's ``world_size``.
"""
from __future__ import annotations

import hashlib
import json

import torch
from torch import Tensor

from rewriter.errors import RewriterError
from rewriter.ir.core import IR

from .process_group import differing

_C10D = torch.ops._c10d_functional


def world(ir: IR) -> int | None:
    """The ranks ``ir`` is split over (``TensorParallel``), or None."""
    tp = ir.info.get("tensor_parallel")
    return tp["world_size"] if tp else None


def distributed() -> bool:
    """Whether this process has joined a default process group."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def this_rank(ir: IR) -> int:
    """This process's rank in the default group, checked against the ranks ``ir`` is split
    for: a model split for 2 run by 1 or 4 processes is refused by name."""
    size = world(ir)
    import torch.distributed as dist
    if not distributed():
        raise RewriterError(
            f"this model is split over {size} ranks (TensorParallel(world_size={size})): "
            f"run it in {size} processes, e.g. `rewriter run ARTIFACT --tp {size}` or "
            f"`torchrun --nproc-per-node {size} ...` with torch.distributed.init_process_group "
            f"called first")
    if dist.get_world_size() != size:
        raise RewriterError(f"this model is split over {size} ranks, but the process group "
                            f"has {dist.get_world_size()}")
    return dist.get_rank()


def with_collectives(ir: IR, table: dict) -> dict:
    """``table`` (op name -> kernel) with the sums over ranks of a rank's IR as collectives;
    a whole IR (the pass's result, not one rank's shard) cannot be lowered."""
    tp = ir.info.get("tensor_parallel")
    if tp is None:
        return table
    if "rank" not in tp:
        raise RewriterError(f"this IR holds whole weights for {tp['world_size']} ranks; each "
                            f"rank lowers its own shard (rewriter.ir.shard.shard)")
    add_norm = table["add_rms_norm"]

    def fused(x, residual, weight, eps, world_size, two_shot_tokens):
        return all_reduce_add_rms_norm(x, residual, weight, eps, world_size, two_shot_tokens,
                                       tp["rank"], add_norm)
    return {**table, "all_reduce": all_reduce, "all_reduce_add_rms_norm": fused}


def _group() -> str:
    import torch.distributed as dist
    return dist.group.WORLD.group_name


def all_reduce(x: Tensor, world_size: int) -> Tensor:
    """The sum of ``x`` over the ranks."""
    return _C10D.wait_tensor(_C10D.all_reduce(x.contiguous(), "sum", _group()))


# device type -> the fewest tokens the two-shot form runs on when the IR leaves it open
# (``two_shot_tokens=None``); a device not listed never runs it. CUDA: TensorRT-LLM's
# ``kOneShotMaxToken = 128`` (one-shot up to 128 tokens, two-shot above).
TWO_SHOT_FROM = {"cuda": 129}


def two_shot(tokens: int, world_size: int, two_shot_tokens: int | None, device_type: str) -> bool:
    """The rule every rank applies to the same shapes: two-shot from ``two_shot_tokens``
    tokens (None: from ``TWO_SHOT_FROM[device_type]``, or never), when every rank gets at
    least one."""
    least = TWO_SHOT_FROM.get(device_type) if two_shot_tokens is None else two_shot_tokens
    return least is not None and tokens >= least and tokens >= world_size


def all_reduce_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                            world_size: int, two_shot_tokens: int | None, rank: int,
                            add_norm) -> tuple[Tensor, Tensor]:
    """``add_norm(sum over ranks of x, residual, weight, eps)`` -> (normed, new residual),
    in the form ``two_shot`` picks. Tokens are every row of ``x`` (batch and sequence
    flattened); a count that does not divide by the ranks is padded with zero rows, whose
    norm is 0 (eps > 0), and cut off after the gather."""
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    if not two_shot(tokens, world_size, two_shot_tokens, x.device.type):
        return add_norm(all_reduce(x, world_size), residual, weight, eps)
    share = -(-tokens // world_size)  # rows per rank, the last padded
    pad = share * world_size - tokens
    rows = x.reshape(tokens, hidden)  # [T, H]
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, hidden)])  # [T + pad, H]
    mine = _C10D.wait_tensor(_C10D.reduce_scatter_tensor(rows.contiguous(), "sum", world_size,
                                                         _group()))  # [share, H]
    start = rank * share
    res = residual.reshape(tokens, hidden)[start:start + share]  # [<= share, H]
    if res.shape[0] < share:
        res = torch.cat([res, res.new_zeros(share - res.shape[0], hidden)])
    normed, total = add_norm(mine, res, weight, eps)  # [share, H] each
    if normed.dtype == total.dtype:  # one gather of [normed | total]
        both = _gather(torch.cat([normed, total], dim=-1), world_size)[:tokens]  # [T, 2H]
        normed, total = both[:, :hidden], both[:, hidden:]
    else:
        normed, total = (_gather(t, world_size)[:tokens] for t in (normed, total))
    return normed.reshape(x.shape), total.reshape(x.shape)


def _gather(t: Tensor, world_size: int) -> Tensor:
    return _C10D.wait_tensor(_C10D.all_gather_into_tensor(t.contiguous(), world_size, _group()))


# ``info`` keys that say where things came from, not what runs: the draft's file path
# (each rank may read its own copy), where a pass timed, the frontend's notes
PROVENANCE = ("medusa", "measured_on", "lift_report")


def program_digest(ir: IR, backend: str) -> bytes:
    """What every rank must hold alike: the graph, ``info`` (the decoding choices timing
    passes record there: skipped layers, draft lengths, trees), the backend and every
    weight's bytes. SHA-256; the weights are read once, at the first lowering."""
    h = hashlib.sha256()
    h.update(str(ir).encode())
    run = {k: v for k, v in ir.info.items() if k not in PROVENANCE}
    h.update(json.dumps(run, sort_keys=True, default=str).encode())
    h.update(backend.encode())
    for name, t in sorted(ir.weights().items()):
        h.update(f"{name} {t.dtype} {list(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
    return h.digest()


def check_same_program(digest: bytes) -> None:
    """Every rank runs the same IR, or none runs: ranks that lowered different programs
    (a pass that chose by timing, run on each rank; another artifact on another host)
    would pair unlike collectives, or wait on each other until the timeout. One
    all-gather of ``program_digest``, at lowering (``process_group.differing``)."""
    differ = differing(digest)
    if differ:
        raise RewriterError(f"ranks {differ} hold a different model than rank 0 (its graph, "
                            f"decoding choices or weights): every rank must run the same "
                            f"optimized model (load one artifact on every rank)")
