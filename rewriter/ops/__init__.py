"""The canonical ops of the IR.

Each op is a ``torch.library`` custom op in the ``rw`` namespace, so a lifted graph stays
an executable ``fx.GraphModule`` (``torch.ops.rw.attention(...)`` runs the reference
implementation) and shape propagation works on fake tensors with symbolic sizes. The
reference implementations are plain torch: they define what each op means, and every
backend is checked against them.

Layouts: activations are ``[B, S, features]``; attention inputs and output keep heads
folded into the last dimension (``[B, S, H * D]``) so the IR needs no view nodes and each
backend picks its own cache layout.

``OPS`` maps each op's short name to its overload: the printer and the artifact format
resolve op names through it, never through ``eval``.

The modules: ``registry`` (the tables, ``_register``, ``ShapeError``), ``dense``
(embedding, projections, activations), ``norms``, ``positions`` (RoPE), ``attend`` (the
attention op and its masks), ``selection`` (TidalDecode's and Quest's selections), ``eagle``
(the EAGLE draft layer), ``collective`` (tensor parallelism's sums) and ``attributes`` (the rules for every op's non-tensor arguments).
No module is named after an op, so ``rewriter.ops.<op>`` is always the op. Importing this
package registers every op.
"""
from rewriter.ops.registry import OPS, REFERENCE, ShapeError, short_name
from rewriter.ops.dense import embedding, gelu, linear, linear_int4, next_tokens, silu, swiglu
from rewriter.ops.norms import add_rms_norm, head_rms_norm, layer_norm, rms_norm
from rewriter.ops.positions import rope, rotary
from rewriter.ops.attend import (attention, attention_mask, default_scale, selected_mask,
                                    sink_attention)
from rewriter.ops.selection import (page_scores, pages_to_tokens, select_pages, select_tokens,
                                    top_tokens, with_recent)
from rewriter.ops.eagle import EAGLE_WEIGHTS, eagle_layer
from rewriter.ops.collective import all_reduce, all_reduce_add_rms_norm
from rewriter.ops.attributes import (ATTRIBUTES, CONTEXT_BOUNDED, check_arguments,
                                     check_context, op_arguments)

__all__ = [
    "OPS", "REFERENCE", "ShapeError", "short_name",
    "embedding", "next_tokens", "linear", "linear_int4", "silu", "gelu", "swiglu",
    "rms_norm", "head_rms_norm", "layer_norm", "add_rms_norm", "rotary", "rope",
    "attention", "attention_mask", "selected_mask", "sink_attention", "default_scale",
    "select_tokens", "select_pages", "with_recent", "page_scores", "pages_to_tokens",
    "top_tokens", "EAGLE_WEIGHTS", "eagle_layer", "all_reduce", "all_reduce_add_rms_norm",
    "ATTRIBUTES", "CONTEXT_BOUNDED", "check_context", "op_arguments", "check_arguments",
]
