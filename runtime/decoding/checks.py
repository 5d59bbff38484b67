"""Checks a speculative strategy makes of the IR before its programs are lowered: that
its caches can roll rejected drafts back, and that the draft heads its record describes
are the graph's."""
from __future__ import annotations

import torch
from torch import fx

from rewriter.errors import RewriterError
from rewriter.ir.core import IR
from rewriter.ops import OPS

from ..kv_cache import cache_table


def check_no_ring(ir: IR, strategy: str) -> None:
    """Speculative strategies roll rejected tokens back by length; a sink + window ring
    has overwritten the keys they replaced, so the two do not go together."""
    rings = [i for i, spec in cache_table(ir.gm).items() if spec.ring]
    if any(ir.graph.find_nodes(op="call_function", target=OPS[op])
           for op in ("select_tokens", "select_pages")):
        raise RewriterError(f"the {strategy} strategy cannot run with TidalDecode's or Quest's "
                            f"token selection: its verify steps span several tokens, which are "
                            f"attended densely, so drafts would be checked against another model")
    if rings:
        raise RewriterError(f"the {strategy} strategy cannot run with sink + window caches "
                            f"(StreamingAttention or DuoAttention, caches {rings}): rolling back rejected "
                            f"drafts needs the keys the ring has overwritten")


def check_heads(ir: IR, s) -> None:
    """The draft heads the record ``s`` describes are the ones in the graph: ``(logits,
    draft)`` with ``draft`` ``[B, S, depth, V or draft_vocab]`` (EAGLE: its first level,
    teacher-forced), and a draft vocabulary of distinct ids inside the model's."""
    (out,) = ir.graph.find_nodes(op="output")
    value = out.args[0]
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise RewriterError("the decoding record asks for draft heads, but the graph returns "
                            "no draft logits beside the logits")
    logits, draft = (v.meta.get("val") if isinstance(v, fx.Node) else None for v in value)
    if logits is None or draft is None or draft.dim() != 4:
        raise RewriterError("the draft logits must be [B, S, heads, vocabulary]")
    vocab = logits.shape[-1]
    width = s.draft_vocab if s.draft_vocab is not None else vocab
    heads = 1 if s.drafter == "eagle" else s.depth
    if draft.shape[2] != heads or draft.shape[3] != width:
        raise RewriterError(f"the draft logits are {list(draft.shape)}, the decoding record "
                            f"says {heads} heads over {width} tokens")
    if max(p[-1] for p in s.tree) >= width:
        raise RewriterError(f"the tree asks for ranks beyond the {width}-token draft vocabulary")
    has_vocab = _has_weight(ir, "medusa.vocab")
    if (s.draft_vocab is not None) != has_vocab:
        raise RewriterError("the decoding record's draft_vocab and the weight medusa.vocab must "
                            "come together (both or neither)")
    if has_vocab:
        ids = ir.weight("medusa.vocab")
        if (ids.dtype != torch.int64 or ids.shape != (width,) or bool((ids < 0).any())
                or bool((ids >= vocab).any()) or len(ids.unique()) != width):
            raise RewriterError(f"medusa.vocab must hold {width} distinct int64 token ids in "
                                f"[0, {vocab})")


def _has_weight(ir: IR, name: str) -> bool:
    try:
        ir.weight(name)
    except AttributeError:
        return False
    return True
