"""The named step programs a decoding strategy runs, lowered together.

- ``prefill``: the prompt, logits of the last position only;
- ``decode``: any number of tokens per row, logits at every position: one token in plain
  decoding, the last token and the draft (k + 1) when verifying;
- ``draft`` (self-speculative): the IR with its skip set bypassed (``rewriter.ir.skip``),
  its linears 4-bit with ``draft_weights="int4"``, last-position logits;
- ``tree_prefill``, ``verify`` and ``heads`` (draft heads): prefill and decode that also
  return the LM head's input ``h``, and the heads alone on ``h`` (run on the accepted
  position only, not on every node of the tree); Hydra: ``head0`` .. one per head, on
  ``h`` and the tree's paths, level by level; EAGLE: ``eagle``, the draft layer's weights
  (``runtime.eagle_rows``: it keeps a cache per row, so it is no lowered graph), with
  ``tree_prefill`` giving ``h`` at every prompt position; prompt lookup: ``tree_prefill``
  and ``verify`` alone.

They share the weights, and the derived copies of them (transposed, int4-packed) through
one dict. ``Engine.programs()`` returns their code and ``dump()`` writes it.
"""
from __future__ import annotations

from torch import fx

from rewriter.decoding import strategy_of
from rewriter.ir.core import IR
from rewriter.ir.skip import check_skip_set, skipped

from .eagle_rows import EagleProgram
from .lower import lower, lower_heads


def build_programs(ir: IR, backend: str, kernel_sources: dict) -> dict[str, fx.GraphModule]:
    shared: dict = {}  # one derived copy of each weight for every program
    programs = {"prefill": lower(ir, True, backend, shared, kernel_sources),
                "decode": lower(ir, False, backend, shared, kernel_sources)}
    s = strategy_of(ir.info)
    if s.name != "plain":
        check_no_ring(ir, s.name)
    if s.name == "self_speculative":
        # the record against this IR: a later pass, or an edited artifact, may not fit it
        check_skip_set(ir, s.skip_layers, s.skip_attention, s.skip_mlp,
                       empty_ok=s.draft_weights != "dense")
        draft = skipped(ir, s.skip_layers, s.skip_attention, s.skip_mlp)
        if s.draft_weights == "int4":
            draft = int4_draft(draft)
        programs["draft"] = lower(draft, True, backend, shared, kernel_sources)
    if s.name == "medusa":
        check_heads(ir, s)
    if s.name in ("medusa", "lookup"):  # rounds of a token tree (lookup: a copied chain)
        # an EAGLE draft catches up over the prompt's every position
        every = "all" if s.name == "medusa" and s.arch == "eagle" else True
        programs["tree_prefill"] = lower(ir, True, backend, shared, kernel_sources, hidden=every)
        programs["verify"] = lower(ir, False, backend, shared, kernel_sources, hidden=True)
    if s.name == "medusa":
        if s.arch == "eagle":  # not a lowered graph: the layer with a cache per row
            programs["eagle"] = EagleProgram.of(ir)
        elif s.arch == "hydra":  # one program per head: drafting goes level by level
            for k in range(s.num_heads):
                programs[f"head{k}"] = lower_heads(ir, backend, shared, head=k)
        else:
            programs["heads"] = lower_heads(ir, backend, shared)
    return programs


def int4_draft(draft: IR) -> IR:
    """``draft`` (a copy: ``skipped`` makes one) with its linears' weights in 4 bits, as
    ``Int4Weights`` stores them; the LM head stays dense, as there."""
    from rewriter.errors import PassError, RewriterError
    from rewriter.passes.int4_weights import Int4Weights
    try:
        return Int4Weights().run(draft)
    except PassError as e:  # e.g. the model's linears are 4-bit already
        raise RewriterError(f"the self_speculative draft_weights='int4' draft has nothing to "
                            f"quantize: {e}") from None
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:  # an artifact's odd names
        raise RewriterError(f"the self_speculative draft_weights='int4' draft cannot be made "
                            f"from these weights: {e}") from None


def check_no_ring(ir: IR, strategy: str) -> None:
    """Speculative strategies roll rejected tokens back by length; a sink + window ring
    has overwritten the keys they replaced, so the two do not go together."""
    from rewriter.errors import RewriterError
    from .kv_cache import cache_table
    rings = [i for i, spec in cache_table(ir.gm).items() if spec.ring]
    from rewriter.ops import OPS
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
    """The draft heads the record describes are the ones in the graph: ``(logits, draft)``
    with ``draft`` ``[B, S, num_heads, V or draft_vocab]``, and a draft vocabulary of
    distinct ids inside the model's."""
    import torch
    from rewriter.errors import RewriterError
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
    heads = 1 if s.arch == "eagle" else s.num_heads  # EAGLE: its first level, teacher-forced
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
