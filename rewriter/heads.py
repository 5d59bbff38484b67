"""Medusa draft heads: their math, and the file that stores trained ones.

Head ``k`` (0-based) reads the base model's last hidden state ``h`` at position ``t`` (the
input of the LM head, after the final norm) and guesses the token at ``t + k + 2``: the
LM head itself guesses ``t + 1``. It is Medusa-1's residual block followed by the model's
own (frozen, shared) LM head::

    r_k = h + SiLU(W_k h + b_k)          W_k [H, H] zero-initialised: r_k = h at first
    logits_k = lm_head(r_k)               (or the trimmed draft vocabulary's rows of it)

A heads file is safetensors (no pickle): ``w`` ``[K, H, H]``, ``b`` ``[K, H]`` and
metadata: the format tag, the model it was trained for (hidden size, vocabulary, a probe
of the LM head's weights) and, from training, each head's rank accuracies on held-out
text (``accuracy[k][r]``: how often the head's ``r``-th best token was the right one),
which choose the verification tree (``rewriter.tree.choose_tree``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor

FORMAT = "rewriter-medusa-heads"
VERSION = "1"
PROBE = (4, 8)  # the LM head's first rows and columns, to recognise the model
MAX_HEADS = 8
ASSETS = Path(__file__).resolve().parent / "assets" / "heads"
SHIPPED = {"default": "default-medusa.safetensors", "smollm2": "smollm2-medusa.safetensors"}


class HeadsFileError(ValueError):
    """A heads file cannot be used: the message names the file and the reason."""


@dataclass
class Heads:
    w: Tensor  # [K, H, H]
    b: Tensor  # [K, H]
    vocab: int
    probe: list  # the LM head's [:4, :8], as trained
    accuracy: list = field(default_factory=list)  # [K][ranks]
    trained: dict = field(default_factory=dict)  # how (tokens, time, seed, corpus)
    counts: Optional[Tensor] = None  # [V] how often the model produced each token (VocabTrim)

    @property
    def num_heads(self) -> int:
        return self.w.shape[0]

    @property
    def hidden(self) -> int:
        return self.w.shape[1]

    def save(self, path: Union[str, os.PathLike]) -> None:
        from safetensors.torch import save_file
        meta = {"format": FORMAT, "version": VERSION, "vocab": str(self.vocab),
                "probe": json.dumps(self.probe), "accuracy": json.dumps(self.accuracy),
                "trained": json.dumps(self.trained)}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {"w": self.w.contiguous(), "b": self.b.contiguous()}
        if self.counts is not None:
            tensors["counts"] = self.counts.to(torch.int64).contiguous()
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)  # a reader never sees half a file

    def fits(self, lm_head: Tensor, where: str) -> None:
        """Raise ``HeadsFileError`` unless these heads were trained for this LM head."""
        vocab, hidden = lm_head.shape
        if (vocab, hidden) != (self.vocab, self.hidden):
            raise HeadsFileError(f"{where}: the heads were trained for a model with hidden size "
                                 f"{self.hidden} and {self.vocab} tokens; this one has {hidden} "
                                 f"and {vocab}")
        probe = lm_head[:PROBE[0], :PROBE[1]].float()
        if not torch.allclose(probe, torch.tensor(self.probe), rtol=0.02, atol=0.02):
            raise HeadsFileError(f"{where}: the heads were trained for another model (its LM "
                                 f"head's weights differ from this model's)")


def resolve(weights: Union[str, os.PathLike]) -> Path:
    """A heads file's path: a shipped name (``default``, ``smollm2``) or a path."""
    if isinstance(weights, str) and weights in SHIPPED:
        return ASSETS / SHIPPED[weights]
    return Path(weights)


def load(weights: Union[str, os.PathLike]) -> Heads:
    """The heads in a file, every field checked (``HeadsFileError`` names the problem)."""
    path = resolve(weights)
    if not path.is_file():
        raise HeadsFileError(f"{path}: no such heads file")
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            if keys not in ({"w", "b"}, {"w", "b", "counts"}):
                raise HeadsFileError(f"{path}: a heads file holds the tensors w, b (and "
                                     f"counts), this one {sorted(keys)}")
            w, b = f.get_tensor("w"), f.get_tensor("b")
            counts = f.get_tensor("counts") if "counts" in keys else None
    except HeadsFileError:
        raise
    except Exception as e:  # safetensors' own parse errors: a truncated or foreign file
        raise HeadsFileError(f"{path}: not a safetensors heads file ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise HeadsFileError(f"{path}: not a {FORMAT} file of version {VERSION}")
    if w.dim() != 3 or w.shape[1] != w.shape[2] or not 1 <= w.shape[0] <= MAX_HEADS \
            or b.shape != w.shape[:2] or not w.is_floating_point() or b.dtype != w.dtype:
        raise HeadsFileError(f"{path}: w must be [K, H, H] and b [K, H] of one float dtype, "
                             f"K in [1, {MAX_HEADS}]; got {list(w.shape)} and {list(b.shape)}")
    if not (torch.isfinite(w).all() and torch.isfinite(b).all()):
        raise HeadsFileError(f"{path}: the weights hold NaN or infinite values")
    try:
        vocab = int(meta["vocab"])
        probe = json.loads(meta["probe"])
        accuracy = json.loads(meta.get("accuracy", "[]"))
        trained = json.loads(meta.get("trained", "{}"))
    except (KeyError, ValueError) as e:
        raise HeadsFileError(f"{path}: bad metadata ({e})") from None
    if vocab < 1 or not _matrix(probe, *PROBE) or not isinstance(trained, dict):
        raise HeadsFileError(f"{path}: bad metadata (vocab, probe or trained)")
    if counts is not None and (counts.shape != (vocab,) or counts.dtype != torch.int64
                               or bool((counts < 0).any())):
        raise HeadsFileError(f"{path}: counts must be [{vocab}] non-negative int64")
    if accuracy and not (len(accuracy) == w.shape[0] and all(
            isinstance(a, list) and a and all(_prob(p) for p in a) and sum(a) <= 1 + 1e-6
            for a in accuracy)):
        raise HeadsFileError(f"{path}: accuracy must hold one list of rank probabilities "
                             f"(summing to at most 1) per head")
    return Heads(w, b, vocab, probe, accuracy, trained, counts)


def probe_of(lm_head: Tensor) -> list:
    return lm_head[:PROBE[0], :PROBE[1]].float().tolist()


def apply(h: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Every head's residual block on ``h`` ``[..., H]`` -> ``[..., K, H]`` (training's
    form of what the pass writes into the IR)."""
    a = torch.einsum("...h,koh->...ko", h, w) + b  # [..., K, H]
    return h[..., None, :] + torch.nn.functional.silu(a)


def _matrix(v, rows: int, cols: int) -> bool:
    return (isinstance(v, list) and len(v) == rows and all(
        isinstance(r, list) and len(r) == cols and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in r)
        for r in v))


def _prob(p) -> bool:
    return isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p <= 1.0
