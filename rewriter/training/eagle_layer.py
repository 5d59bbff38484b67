"""The EAGLE draft layer while it trains (``rewriter.drafts.eagle``'s maths) on the model's frozen
embeddings and LM head, over rows whose hidden states are cached (``draft_loop``).

At position ``i`` the layer reads ``fc([f_i; e(x_{i+1})])``: the model's feature there
(the LM head's input) beside the embedding of the next token, and attends over the same
inputs at earlier positions. Training follows EAGLE-3's "training-time test": the layer
is unrolled ``depth`` steps on its own features, and each step's cross-entropy (on the
model's own greedy tokens, weighted ``0.8 ** k`` as ``train_heads``) is trained on. Step
``s``'s query at position ``i`` (a chain started at ``t = i - s + 1``) sees step 1's keys
at positions ``<= t`` and step ``m``'s key at ``t + m - 1`` for ``m = 2 .. s``: the keys
a draft holds at inference.
"""
from __future__ import annotations

import math

import torch

from rewriter.drafts import eagle, eagle_file
from rewriter.drafts import heads as heads_file
from rewriter.training.draft_loop import top1, train_rows
from rewriter.training.heads_data import produced


def produced_counts(parts: list, vocab: int) -> torch.Tensor:
    """``[V]`` how often the model produced each token in the training data (the draft
    file's ``counts``: a trimmed draft vocabulary keeps the most frequent)."""
    return sum(produced(p, vocab) for p in parts)


class DraftLayer:
    """EAGLE's draft layer (``rewriter.drafts.eagle``) on the model's frozen embeddings and LM
    head: ``init`` ``"random"`` (``N(0, 0.02)``) or ``"last"`` (a copy of the model's last
    decoder layer, ``fc`` the identity on the feature)."""

    def __init__(self, model, init: str, depth: int, device="cpu"):
        c = model.config
        self.device = torch.device(device)
        self.lm = model.lm_head.weight.detach().to(self.device, torch.bfloat16)  # [V, H] frozen
        self.vocab = None  # all of it; trim(): the ids of a trimmed draft vocabulary
        self.embed = heads_file.model_embedding(model).to(self.device, torch.float32)  # [V, H]
        self.depth = depth
        self.shape = eagle.Shape.of(c)
        hidden = c.hidden_size
        last = dict(model.model.layers[-1].named_parameters())
        self.p = {}
        for name in eagle.LAYER:  # drawn from the global generator, in this order
            t = last[name].detach().float().cpu().clone()  # drawn by the CPU's generator
            if init == "random":
                t = torch.ones_like(t) if name.endswith("layernorm.weight") else torch.randn_like(t) * 0.02
            self.p[name] = t
        fc = torch.randn(hidden, 2 * hidden) * 0.02  # [H, 2H]
        if init == "last":  # the feature through, the embedding not: the model's last layer
            fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
        self.p["fc.weight"], self.p["fc.bias"] = fc, torch.zeros(hidden)
        self.p["norm.weight"] = model.model.norm.weight.detach().float().cpu().clone()
        # drawn on the CPU, then moved: the same start on every device
        self.p = {n: t.to(self.device).requires_grad_(True) for n, t in self.p.items()}

    def trim(self, ids: torch.Tensor) -> None:
        """Train and measure on the draft vocabulary ``ids`` alone (sorted token ids, as
        ``heads.draft_vocab`` gives them): the logits are the LM head's rows for
        them, ``[P, S, N]``, as ``EagleDraft(draft_vocab=N)`` drafts. A target outside
        them is no training target (the draft can never propose it) and always a miss in
        ``accuracy``, as it is in the runtime."""
        if self.vocab is not None:  # the LM head is trimmed already: its rows are not ids
            raise ValueError("DraftLayer.trim: the draft vocabulary is chosen once")
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or not len(ids) \
                or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= self.lm.shape[0]:
            raise ValueError("DraftLayer.trim: ids must be sorted distinct token ids of the model's vocabulary")
        ids = ids.to("cpu", torch.int64)
        self.lm = self.lm[ids.to(self.device)]  # [N, H]
        self.vocab = ids

    def targets(self, missing: int):
        """``y -> y'``: the model's tokens as indices into the draft vocabulary, a token
        outside it ``missing`` (None: the full vocabulary, nothing to map)."""
        if self.vocab is None:
            return None
        index = torch.full((int(self.vocab[-1]) + 1,), missing, dtype=torch.int64)
        index[self.vocab] = torch.arange(len(self.vocab))

        def remap(y: torch.Tensor) -> torch.Tensor:  # -100 (past a row's end) stays
            inside = (y >= 0) & (y < len(index))
            return torch.where(inside, index[y.clamp(0, len(index) - 1)], torch.where(y >= 0, missing, y))
        return remap

    def unroll(self, hidden: torch.Tensor, tokens: torch.Tensor) -> list:
        """``eagle.unroll`` over whole rows ``[B, L]``: the next token at the last position
        is padding, and no chain read there is trained on."""
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1).to(self.device)  # [B, L] x_{i+1}
        return eagle.unroll(self.p, self.shape, hidden.to(self.device, torch.float32),
                            self.embed[nxt], self.depth)

    def logits(self, data: dict, rows: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """``[P, S, V]`` every draft step's logits for chains started at ``pairs`` (row,
        position) of the sorted ``rows``."""
        outs = self.unroll(data["hidden"][rows], data["tokens"][rows])
        local = torch.searchsorted(rows, pairs[:, 0].contiguous()).to(self.device)
        at = pairs[:, 1].to(self.device)
        length = outs[0].shape[1]
        g = torch.stack([o[local, (at + s).clamp(max=length - 1)] for s, o in enumerate(outs)], 1)
        return g.to(torch.bfloat16) @ self.lm.t()  # [P, S, V]

    def train(self, data: dict, args, seconds: float | None = None, checkpoint=None) -> float:
        """``args.steps`` steps (``seconds``: or until they are spent); ``checkpoint(step)``
        every 100 steps."""
        opt = torch.optim.AdamW(list(self.p.values()), lr=args.lr, weight_decay=0.0)
        # EAGLE clips at 0.5 too (by value; here by norm)
        return train_rows(opt, data, args, self.logits, self.depth, warmup=50, clip=0.5,
                          every=100, device=self.device, seconds=seconds, checkpoint=checkpoint,
                          targets=self.targets(missing=-100))

    def accuracy(self, data: dict) -> list[float]:
        """Held-out top-1 of each draft step on ``data``'s generated positions."""
        def logits_of(rows, pairs):
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return self.logits(data, rows, pairs)
        return top1(data, self.depth, logits_of, rows=8, targets=self.targets(missing=-1))

    def start_from(self, init: eagle_file.Draft) -> None:
        """Start the layer from a draft file's (float32, on this layer's device)."""
        if not same_shape(init.shape, self.shape):
            raise ValueError(f"train_eagle: --init's layer {init.shape} is not this model's {self.shape}")
        self.p = {n: init.params[n].to(self.device, torch.float32).clone().requires_grad_(True)
                  for n in eagle_file.NAMES}


def same_shape(a: eagle.Shape, b: eagle.Shape) -> bool:
    """The same layer: sizes equal, RoPE's base and the norms' epsilon to float32's
    precision (a GGUF stores them rounded; a Hugging Face config does not)."""
    return (a.hidden, a.heads, a.kv_heads, a.intermediate) == (b.hidden, b.heads, b.kv_heads, b.intermediate) \
        and math.isclose(a.rope_theta, b.rope_theta, rel_tol=1e-6) and math.isclose(a.eps, b.eps, rel_tol=1e-6)
