"""``backend="triton"``: the step programs call the Triton templates in ``rewriter.codegen``.

Norms, SwiGLU, RoPE and attention over the cache run as Triton kernels
(``runtime/triton_attention.py`` holds the attention); matrix multiplies and embeddings
stay with torch; pointwise groups no template covers become generated kernels
(``codegen/pointwise.py``, scheduled by ``lower``). On a CPU the kernels run only under
``TRITON_INTERPRET=1`` (set before ``rewriter`` is imported), which is how the tests run
them. This module imports no Triton itself, so ``available`` can say why it is missing.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from rewriter.ops import REFERENCE


def available(device: torch.device) -> Optional[str]:
    """None when Triton kernels can run on ``device``, else the reason they cannot."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "backend='triton' needs the triton package: pip install 'rewriter[triton]'"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"backend='triton' runs on CUDA devices (the model is on {device}); on a CPU, set "
            f"TRITON_INTERPRET=1 before importing rewriter to use Triton's interpreter")


def kernels() -> tuple[dict, Callable]:
    """(op name -> kernel, the cached attention): imported here, once per lowering."""
    from rewriter.codegen import norm, rope, swiglu

    from .triton_attention import cached_attention
    table = {**REFERENCE, "rms_norm": norm.rms_norm,
             "add_rms_norm": lambda x, r, w, eps, unit_offset=False:
                 norm.add_rms_norm(x, r, w, eps, unit_offset),
             "swiglu": swiglu.swiglu, "rope": rope.rope}
    return table, cached_attention
