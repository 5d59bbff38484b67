"""Draft heads (Medusa, Hydra): their math, and the file that stores trained ones.

Head ``k`` (0-based) reads the base model's last hidden state ``h`` at position ``t`` (the
input of the LM head, after the final norm) and guesses the token at ``t + k + 2``: the
LM head itself guesses ``t + 1``. It is Medusa-1's residual block followed by the model's
own (frozen, shared) LM head::

    r_k = h + SiLU(W_k h + b_k)          W_k [H, H] zero-initialised: r_k = h at first
    logits_k = lm_head(r_k)               (or the trimmed draft vocabulary's rows of it)

Hydra's heads are sequentially dependent: head ``k`` also reads the embeddings ``e_j`` of
the tokens already on its path, the token at ``t + 1`` (the model's own) and the ``k``
drafted before it, so siblings deeper in the tree get different guesses::

    r_k = h + SiLU(W_k [h, e_0, .., e_k] + b_k)    W_k [H, H (k + 2)] zero-initialised

(Hydra proper maps the concatenation back with a learned projection; this keeps
Medusa's residual on ``h``, so an untrained head is the LM head, as in Medusa.)

Heads of ``B`` blocks (Medusa's ``medusa_num_layers``, Hydra++'s ``hydra_num_layers``)
run ``B - 1`` more residual blocks on ``r_k`` before the LM head, each zero-initialised
(the identity at first), so deeper heads can start from trained shallower ones::

    r_k = r_k + SiLU(V_{l,k} r_k + c_{l,k})    V_{l,k} [H, H], l = 1 .. B - 1

A heads file is safetensors (no pickle): ``w`` ``[K, H, H]`` (Hydra: ``w0`` .. ``w{K-1}``,
``[H, H (k + 2)]``), ``b`` ``[K, H]``, with more than one block ``deep_w`` ``[B - 1, K, H,
H]`` and ``deep_b`` ``[B - 1, K, H]``, and metadata: the architecture, the format tag, the model it was trained for (hidden size, vocabulary, a probe
of the LM head's weights) and, from training, each head's rank accuracies on held-out
text (``accuracy[k][r]``: how often the head's ``r``-th best token was the right one),
which choose the verification tree (``rewriter.drafts.tree.choose_tree``).
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

from rewriter.values import parse_json

FORMAT = "rewriter-medusa-heads"
VERSION = "1"
PROBE = (4, 8)  # the LM head's first rows and columns, to recognise the model
MAX_HEADS = 8
MAX_BLOCKS = 8  # residual blocks per head
DEEP = ("deep_w", "deep_b")  # the blocks after each head's first
ASSETS = Path(__file__).resolve().parent.parent / "assets" / "heads"
SHIPPED = ("default", "smollm2")  # assets/heads/{name}-{arch}.safetensors
ARCHS = ("medusa", "hydra")
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # a file's weights


class HeadsFileError(ValueError):
    """A heads file cannot be used: the message names the file and the reason."""


@dataclass
class Heads:
    w: Union[Tensor, list]  # medusa: [K, H, H]; hydra: K tensors [H, H (k + 2)]
    b: Tensor  # [K, H]
    vocab: int
    probe: list  # the LM head's [:4, :8], as trained
    accuracy: list = field(default_factory=list)  # [K][ranks]
    trained: dict = field(default_factory=dict)  # how (tokens, time, seed, corpus)
    counts: Optional[Tensor] = None  # [V] how often the model produced each token (VocabTrim)
    arch: str = "medusa"
    deep: Optional[tuple] = None  # (deep_w [B - 1, K, H, H], deep_b [B - 1, K, H]), or None

    @property
    def num_heads(self) -> int:
        return self.b.shape[0]

    @property
    def blocks(self) -> int:
        """Residual blocks per head."""
        return 1 + (self.deep[0].shape[0] if self.deep is not None else 0)

    @property
    def hidden(self) -> int:
        return self.b.shape[1]

    def save(self, path: Union[str, os.PathLike]) -> None:
        from rewriter.files import tensor_files
        meta = {"format": FORMAT, "version": VERSION, "arch": self.arch, "vocab": str(self.vocab),
                "probe": json.dumps(self.probe), "accuracy": json.dumps(self.accuracy),
                "trained": json.dumps(self.trained)}
        tensors = {"b": self.b.contiguous()}
        if self.arch == "hydra":
            tensors.update({f"w{k}": w.contiguous() for k, w in enumerate(self.w)})
        else:
            tensors["w"] = self.w.contiguous()
        if self.deep is not None:
            tensors.update({n: t.contiguous() for n, t in zip(DEEP, self.deep)})
        if self.counts is not None:
            tensors["counts"] = self.counts.to(torch.int64).contiguous()
        tensor_files.save(path, tensors, meta)  # a reader never sees half a file

    def fits(self, lm_head: Tensor, where: str) -> None:
        """Raise ``HeadsFileError`` unless these heads were trained for this LM head."""
        why = unfit(lm_head, self.vocab, self.hidden, self.probe)
        if why:
            raise HeadsFileError(f"{where}: the heads were trained for {why}")


def resolve(weights: Union[str, os.PathLike], arch: str = "medusa") -> Path:
    """A heads file's path: a shipped name (``default``, ``smollm2``) or a path."""
    if isinstance(weights, str) and weights in SHIPPED:
        return ASSETS / f"{weights}-{arch}.safetensors"
    return Path(weights)


def load(weights: Union[str, os.PathLike], want: Optional[str] = None) -> Heads:
    """The heads in a file, every field checked (``HeadsFileError`` names the problem);
    with ``want``, heads of that architecture only."""
    path = resolve(weights, want or "medusa")
    if not path.is_file():
        raise HeadsFileError(f"{path}: no such heads file")
    meta, arch, w, b, counts, deep = _read(path)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise HeadsFileError(f"{path}: not a {FORMAT} file of version {VERSION}")
    why = _check_dtypes(arch, w, b, deep) or _check_shapes(arch, w, b) or _check_deep(deep, b)
    if why:
        raise HeadsFileError(f"{path}: {why}")
    if not all(torch.isfinite(t).all() for t in
               [*(w if arch == "hydra" else [w]), b, *(deep if deep is not None else ())]):
        raise HeadsFileError(f"{path}: the weights hold NaN or infinite values")
    vocab, probe, accuracy, trained = _metadata(path, meta, b.shape[0], counts)
    if want is not None and arch != want:
        raise HeadsFileError(f"{path}: holds {arch} heads, not {want} heads "
                             f"({'HydraHeads' if arch == 'hydra' else 'MedusaHeads'} reads them)")
    return Heads(w, b, vocab, probe, accuracy, trained, counts, arch, deep)


def _read(path: Path) -> tuple:
    """``(metadata, arch, w, b, counts, deep)`` as a heads file holds them, its architecture
    known and its tensors' names the architecture's (their values not checked yet)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            arch = meta.get("arch", "medusa")  # files from before Hydra name no arch
            keys = set(f.keys())
            if arch not in ARCHS:
                raise HeadsFileError(f"{path}: unknown heads architecture {arch!r} (known: "
                                     f"{', '.join(ARCHS)})")
            names = _weight_names(arch, keys)
            if names is None:
                raise HeadsFileError(f"{path}: a {arch} heads file holds the tensors "
                                     f"{'w0, w1, ..' if arch == 'hydra' else 'w'}, b (and counts; "
                                     f"deeper heads: deep_w, deep_b), "
                                     f"this one {sorted(keys)}")
            w = [f.get_tensor(n) for n in names] if arch == "hydra" else f.get_tensor("w")
            b = f.get_tensor("b")
            counts = f.get_tensor("counts") if "counts" in keys else None
            if len(keys & set(DEEP)) == 1:
                raise HeadsFileError(f"{path}: deeper heads hold both {' and '.join(DEEP)}; "
                                     f"this file holds one")
            deep = tuple(f.get_tensor(n) for n in DEEP) if DEEP[0] in keys else None
    except HeadsFileError:
        raise
    except Exception as e:  # safetensors' own parse errors: a truncated or foreign file
        raise HeadsFileError(f"{path}: not a safetensors heads file ({e})") from None
    return meta, arch, w, b, counts, deep


def _metadata(path: Path, meta: dict, num_heads: int, counts: Optional[Tensor]) -> tuple:
    """``(vocab, probe, accuracy, trained)`` from a heads file's metadata, checked, with the
    token ``counts`` it holds against its vocabulary and ``accuracy`` against its heads."""
    try:
        vocab = int(meta["vocab"])
        probe = metadata_json(meta, "probe")
        accuracy = metadata_json(meta, "accuracy", "[]")
        trained = metadata_json(meta, "trained", "{}")
    except (KeyError, ValueError) as e:
        raise HeadsFileError(f"{path}: bad metadata ({e})") from None
    if vocab < 1 or not is_matrix(probe, *PROBE) or not isinstance(trained, dict):
        raise HeadsFileError(f"{path}: bad metadata (vocab, probe or trained)")
    why = counts_problem(counts, vocab)
    if why:
        raise HeadsFileError(f"{path}: {why}")
    if accuracy and not (len(accuracy) == num_heads and all(
            isinstance(a, list) and a and all(_prob(p) for p in a) and sum(a) <= 1 + 1e-6
            for a in accuracy)):
        raise HeadsFileError(f"{path}: accuracy must hold one list of rank probabilities "
                             f"(summing to at most 1) per head")
    return vocab, probe, accuracy, trained


def _weight_names(arch: str, keys: set) -> Optional[list]:
    """The weight tensors' names in file order, or None when ``keys`` do not fit ``arch``."""
    rest = keys - {"b", "counts", *DEEP}
    if "b" not in keys:
        return None
    if arch == "medusa":
        return ["w"] if rest == {"w"} else None
    names = [f"w{k}" for k in range(len(rest))]
    return names if rest and set(names) == rest else None


def metadata_json(meta: dict, key: str, default: Optional[str] = None):
    """The JSON value of a safetensors metadata field (``default``'s where it is absent),
    nested at most ``values.MAX_JSON_DEPTH`` deep; a ``ValueError`` names the field."""
    text = meta.get(key, default)
    if text is None:
        raise ValueError(f"no {key!r} field")
    try:
        return parse_json(text)
    except ValueError as e:
        raise ValueError(f"{key!r} is not JSON ({e})") from None


def dtype_problem(name: str, t: Tensor, expected) -> Optional[str]:
    """Why tensor ``name`` is not of a dtype in ``expected``, naming what it is: checked
    before its shape, so a tensor of the right shape and the wrong dtype is called that."""
    if t.dtype in expected:
        return None
    names = [_dtype_name(d) for d in expected]
    wanted = " or ".join(names) if len(names) < 3 else f"one of {', '.join(names)}"
    return f"{name} must be {wanted}, got {_dtype_name(t.dtype)}"


def counts_problem(counts: Optional[Tensor], vocab: int) -> Optional[str]:
    """Why ``counts`` (a draft file's token counts, or None) is not ``[vocab]`` non-negative
    int64, or None."""
    if counts is None:
        return None
    want = f"counts must be [{vocab}] non-negative int64"
    if counts.dtype != torch.int64:  # the dtype first: shape and sign then mean something
        return f"{want}, got {_dtype_name(counts.dtype)}"
    if counts.shape != (vocab,):
        return f"{want}, got {list(counts.shape)}"
    if bool((counts < 0).any()):
        return f"{want}, got {int(counts.min())}"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dtypes(arch: str, w, b: Tensor, deep: Optional[tuple]) -> Optional[str]:
    """b a float dtype, every other weight b's."""
    if b.dtype not in FLOATS:
        return dtype_problem("b", b, FLOATS)
    others = [(f"w{k}", t) for k, t in enumerate(w)] if arch == "hydra" else [("w", w)]
    for name, t in others + list(zip(DEEP, deep or ())):
        if t.dtype != b.dtype:
            return f"{name} must be {_dtype_name(b.dtype)} (b's dtype), got {_dtype_name(t.dtype)}"
    return None


def _check_shapes(arch: str, w, b: Tensor) -> Optional[str]:
    if b.dim() != 2 or not 1 <= b.shape[0] <= MAX_HEADS:
        return f"b must be [K, H], K in [1, {MAX_HEADS}]; got {list(b.shape)}"
    k, hidden = b.shape
    if arch == "medusa":
        if w.shape != (k, hidden, hidden):
            return f"w must be [K, H, H] = {[k, hidden, hidden]}; got {list(w.shape)}"
        return None
    if len(w) != k:
        return f"{len(w)} weights w0.. for {k} heads"
    for i, t in enumerate(w):
        if t.shape != (hidden, hidden * (i + 2)):
            return (f"w{i} must be [H, H * {i + 2}] = {[hidden, hidden * (i + 2)]}; "
                    f"got {list(t.shape)}")
    return None


def _check_deep(deep: Optional[tuple], b: Tensor) -> Optional[str]:
    if deep is None:
        return None
    (k, hidden), (w, c) = b.shape, deep
    if w.dim() != 4 or not 1 <= w.shape[0] < MAX_BLOCKS or w.shape[1:] != (k, hidden, hidden):
        return (f"deep_w must be [B - 1, K, H, H] = [B - 1, {k}, {hidden}, {hidden}], "
                f"B in [2, {MAX_BLOCKS}]; got {list(w.shape)}")
    if c.shape != (w.shape[0], k, hidden):
        return f"deep_b must be [B - 1, K, H] = {[w.shape[0], k, hidden]}; got {list(c.shape)}"
    return None


def unfit(lm_head: Tensor, vocab: int, hidden: int, probe: list) -> Optional[str]:
    """What weights trained for an LM head of ``vocab`` x ``hidden`` tokens whose first
    weights were ``probe`` were trained for, where ``lm_head`` is another; else None."""
    v, h = lm_head.shape
    if (v, h) != (vocab, hidden):
        return f"a model with hidden size {hidden} and {vocab} tokens; this one has {h} and {v}"
    if not torch.allclose(lm_head[:PROBE[0], :PROBE[1]].float().cpu(), torch.tensor(probe),
                          rtol=0.02, atol=0.02):
        return "another model (its LM head's weights differ from this model's)"
    return None


def draft_vocab(counts: Tensor, n: int) -> Tensor:
    """The trimmed draft vocabulary of ``n`` tokens: the ids ``counts`` ``[V]`` ranks most
    produced, sorted. The one rule for every user of it (the heads' and the EAGLE draft's
    ``draft_vocab=n``, and a training run on that vocabulary alone), so all pick the same
    tokens from the same counts. Equal counts go to the lower id: real counts tie at every
    cut-off (SmolLM2's draft file: 61 tokens share the count at the 4096th place), and
    ``topk`` leaves the order of ties to its implementation, so a draft trained under one
    torch could be given other tokens under another."""
    if type(n) is not int or n < 1:
        raise ValueError(f"draft_vocab: n must be a positive int, got {n!r}")
    order = counts.to(torch.float64).sort(descending=True, stable=True).indices  # [V] ties: id order
    return order[:n].sort().values


def probe_of(lm_head: Tensor) -> list:
    return lm_head[:PROBE[0], :PROBE[1]].float().tolist()


def apply(h: Tensor, w: Tensor, b: Tensor, deep: Optional[tuple] = None) -> Tensor:
    """Every head's residual blocks on ``h`` ``[..., H]`` -> ``[..., K, H]`` (training's
    form of what the pass writes into the IR)."""
    a = torch.einsum("...h,koh->...ko", h, w) + b  # [..., K, H]
    return deepen(h[..., None, :] + torch.nn.functional.silu(a), deep)


def model_embedding(model) -> Tensor:
    """The token embedding ``[V, H]`` as the model's first layer reads it: the weight, times
    the model's embedding scale where it has one (Gemma's ``sqrt(hidden)``, in the weight's
    dtype as ``rw.embedding`` multiplies its rows), so a draft trains on what the graph
    feeds it."""
    emb = model.get_input_embeddings()
    weight = emb.weight.detach()
    scale = getattr(emb, "embed_scale", None)
    return weight if scale is None else weight * torch.as_tensor(scale).to(weight.dtype)


def apply_hydra(h: Tensor, e: Tensor, w: list, b: Tensor, deep: Optional[tuple] = None) -> Tensor:
    """Hydra's heads on ``h`` ``[..., H]`` and the path's embeddings ``e`` ``[..., K, H]``
    (``e_0`` the token at ``t + 1``) -> ``[..., K, H]``."""
    rows = []
    for k, wk in enumerate(w):
        x = torch.cat([h, e[..., :k + 1, :].flatten(-2)], -1)  # [..., H (k + 2)]
        rows.append(h + torch.nn.functional.silu(x @ wk.t() + b[k]))
    return deepen(torch.stack(rows, -2), deep)


def deepen(r: Tensor, deep: Optional[tuple]) -> Tensor:
    """The blocks after each head's first on ``r`` ``[..., K, H]``: ``r + SiLU(V r + c)``."""
    if deep is None:
        return r
    for v, c in zip(*deep):  # [K, H, H], [K, H]
        r = r + torch.nn.functional.silu(torch.einsum("...kh,koh->...ko", r, v) + c)
    return r


def is_matrix(v, rows: int, cols: int) -> bool:
    """``v`` is a ``rows`` x ``cols`` list of lists of finite numbers (a probe as JSON gives it)."""
    return (isinstance(v, list) and len(v) == rows and all(
        isinstance(r, list) and len(r) == cols and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in r)
        for r in v))


def _prob(p) -> bool:
    return isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p <= 1.0
