"""The file that stores a trained EAGLE draft layer (``rewriter.drafts.eagle``).

Safetensors (no pickle): the parameters under ``rewriter.drafts.eagle``'s names (``LAYER``, then
``fc.weight``, ``fc.bias``, ``norm.weight``), float32 or bfloat16 (read as float32: a
shipped draft is stored in bfloat16, half the bytes), optionally ``counts`` (int64
``[V]``: how often the model produced each token in the training data, from which a
trimmed draft vocabulary keeps the most frequent), and metadata: the format tag, the
layer's ``Shape``, the model it was trained for (vocabulary, a probe of its LM head's
weights, as a heads file has), each draft step's held-out top-1 and how it was trained.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor

from rewriter.drafts import eagle
from rewriter.drafts.heads import (PROBE, counts_problem, dtype_problem, metadata_json, probe_of,
                                   unfit)

FORMAT = "rewriter-eagle-draft"
VERSION = "1"
NAMES = (*eagle.LAYER, "fc.weight", "fc.bias", "norm.weight")
STORED = (torch.float32, torch.bfloat16)  # what a file may hold; loaded as float32
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "eagle"
SHIPPED = ("smollm2",)  # assets/eagle/{name}.safetensors


class DraftFileError(ValueError):
    """A draft file cannot be used: the message names the file and the reason."""


@dataclass
class Draft:
    params: dict  # {name: float32 tensor}, NAMES
    shape: eagle.Shape
    vocab: int
    probe: list  # the LM head's [:4, :8], as trained
    accuracy: list = field(default_factory=list)  # held-out top-1 of each draft step
    trained: dict = field(default_factory=dict)
    counts: Optional[Tensor] = None  # [vocab] int64: tokens the model produced (VocabTrim)

    def save(self, path: Union[str, os.PathLike], dtype: torch.dtype = torch.float32) -> None:
        """Write the file (``tensor_files.save``: a temporary name, then renamed: a reader
        never sees half a file, and a link at ``path`` is replaced, not followed);
        ``dtype``: the parameters' on disk, float32 or bfloat16."""
        from rewriter.files import tensor_files
        if dtype not in STORED:
            raise ValueError(f"eagle_file: a draft is stored in float32 or bfloat16, got {dtype}")
        meta = {"format": FORMAT, "version": VERSION, "shape": json.dumps(asdict(self.shape)),
                "vocab": str(self.vocab), "probe": json.dumps(self.probe),
                "accuracy": json.dumps(self.accuracy), "trained": json.dumps(self.trained)}
        path = Path(path)
        tensors = {n: self.params[n].detach().cpu().to(dtype).contiguous() for n in NAMES}
        if self.counts is not None:
            tensors["counts"] = self.counts.cpu().to(torch.int64).contiguous()
        # what load would refuse is never written (a diverged run's NaN, a float32 value
        # past bfloat16's range)
        why = _check(tensors, self.shape, self.vocab, self.probe, self.accuracy, self.trained)
        if why:
            raise DraftFileError(f"{path}: not saved: {why}")
        tensor_files.save(path, tensors, meta)

    def fits(self, lm_head: Tensor, where: str) -> None:
        """Raise ``DraftFileError`` unless this draft was trained for this LM head."""
        why = unfit(lm_head, self.vocab, self.shape.hidden, self.probe)
        if why:
            raise DraftFileError(f"{where}: the draft was trained for {why}")


def made(params: dict, shape: eagle.Shape, lm_head: Tensor, **kw) -> Draft:
    return Draft(params, shape, lm_head.shape[0], probe_of(lm_head), **kw)


def resolve(weights: Union[str, os.PathLike]) -> Path:
    """A draft file's path: a shipped name (``smollm2``) or a path."""
    if isinstance(weights, str) and weights in SHIPPED:
        return ASSETS / f"{weights}.safetensors"
    return Path(weights)


def load(weights: Union[str, os.PathLike]) -> Draft:
    """The draft in a file or a shipped one's name, every field checked (``DraftFileError``
    names the problem); its parameters as float32."""
    path = resolve(weights)
    if not path.is_file():
        raise DraftFileError(f"{path}: no such draft file")
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            if meta.get("format") != FORMAT:
                raise DraftFileError(f"{path}: not an EAGLE draft file (format "
                                     f"{meta.get('format')!r}, expected {FORMAT!r})")
            if meta.get("version") != VERSION:
                raise DraftFileError(f"{path}: draft file version {meta.get('version')!r}; "
                                     f"this rewriter reads version {VERSION}")
            if keys - {"counts"} != set(NAMES):
                raise DraftFileError(f"{path}: the tensors must be exactly {sorted(NAMES)} (and "
                                     f"counts); missing {sorted(set(NAMES) - keys)}, unexpected "
                                     f"{sorted(keys - set(NAMES) - {'counts'})}")
            params = {n: f.get_tensor(n) for n in NAMES}
            counts = f.get_tensor("counts") if "counts" in keys else None
        shape = eagle.Shape(**metadata_json(meta, "shape"))
        if not re.fullmatch(r"[1-9][0-9]{0,9}", meta.get("vocab", "")):
            raise DraftFileError(f"{path}: vocab must be a positive integer, got "
                                 f"{meta.get('vocab')!r}")
        vocab, probe = int(meta["vocab"]), metadata_json(meta, "probe")
        accuracy = metadata_json(meta, "accuracy", "[]")
        trained = metadata_json(meta, "trained", "{}")
    except DraftFileError:
        raise
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, SafetensorError) as e:  # torn or odd
        raise DraftFileError(f"{path}: unreadable draft file ({type(e).__name__}: {e})") from None
    why = _check(params, shape, vocab, probe, accuracy, trained) or counts_problem(counts, vocab)
    if why:
        raise DraftFileError(f"{path}: {why}")
    params = {n: t.float() for n, t in params.items()}
    return Draft(params, shape, vocab, probe, accuracy, trained, counts)


def sizes(shape: eagle.Shape) -> dict:
    h, kv, m = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    return {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h),
            "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, h), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (m, h), "mlp.up_proj.weight": (m, h),
            "mlp.down_proj.weight": (h, m), "fc.weight": (h, 2 * h), "fc.bias": (h,),
            "norm.weight": (h,)}


def _finite(x) -> bool:
    """A JSON number (not a boolean) that is a finite float; a huge integer is not."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _check(params, shape, vocab, probe, accuracy, trained) -> str | None:
    for name, size in sizes(shape).items():
        t = params[name]
        why = dtype_problem(name, t, STORED)
        if why or tuple(t.shape) != size:
            return why or f"{name} must be float32 or bfloat16 {list(size)}, got {list(t.shape)}"
        if not bool(torch.isfinite(t).all()):
            return f"{name} holds NaN or infinite values"
    if type(vocab) is not int or vocab < 1:
        return f"vocab must be a positive int, got {vocab!r}"
    if not isinstance(probe, list) or len(probe) != PROBE[0] or not all(
            isinstance(r, list) and len(r) == PROBE[1] and all(_finite(x) for x in r) for r in probe):
        return f"probe must be {PROBE[0]} rows of {PROBE[1]} finite numbers"
    if not isinstance(accuracy, list) or not all(_finite(a) and 0 <= a <= 1 for a in accuracy):
        return "accuracy must be a list of numbers in [0, 1]"
    if not isinstance(trained, dict):
        return "trained must be a JSON object"
    return None
