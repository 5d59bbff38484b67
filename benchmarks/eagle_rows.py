"""The rows an ``eagle_gpu.py`` run wrote, kept in a folder (``--data DIR``) so that later
runs train on them too: a CPU makes a GPU call's data in about an hour, so a draft grows
over several sessions, each adding new questions.

One file a run, ``DIR/rows-<seed>.safetensors`` (a run's questions follow from its seed):

- ``tokens`` ``[N, L]`` int64, right-padded; ``start`` ``[N]`` where each row's answer
  begins; ``kind`` ``[N]``: 0 a held-out code prompt, 1 a chat question, 2 a code prompt;
- metadata: ``seed``, ``new_tokens``, ``vocab``, ``chat_heldout``.

Nothing in a file is trusted: a file that does not parse, or whose tokens, starts or kinds
are out of range, stops the run with its name (no pickle: safetensors).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

NAME = re.compile(r"rows-(-?\d+)\.safetensors")


class RowsError(ValueError):
    pass


@dataclass
class Rows:
    tokens: torch.Tensor  # [N, L]
    start: torch.Tensor  # [N]
    kind: torch.Tensor  # [N]
    seed: int
    new_tokens: int
    chat_heldout: int


def path(folder: Path, seed: int) -> Path:
    return Path(folder) / f"rows-{seed}.safetensors"


def save(folder: Path, rows: Rows, vocab: int) -> Path:
    """Write ``rows`` (atomically: a run killed while writing leaves the old file)."""
    from safetensors.torch import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = path(folder, rows.seed)
    tmp = target.with_name(target.name + ".tmp")
    save_file({"tokens": rows.tokens.to(torch.int64).contiguous(),
               "start": rows.start.to(torch.int64).contiguous(),
               "kind": rows.kind.to(torch.int64).contiguous()}, str(tmp),
              metadata={"seed": str(rows.seed), "new_tokens": str(rows.new_tokens),
                        "vocab": str(vocab), "chat_heldout": str(rows.chat_heldout)})
    os.replace(tmp, target)
    return target


def load(file: Path, vocab: int) -> Rows:
    """One run's rows, checked against the model's vocabulary."""
    from safetensors import safe_open
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in ("tokens", "start", "kind")}
        seed, new_tokens, made_for, held = (int(meta[k]) for k in ("seed", "new_tokens", "vocab",
                                                                    "chat_heldout"))
    except Exception as e:  # a torn or foreign file
        raise RowsError(f"{file}: not a rows file of eagle_gpu.py ({type(e).__name__}: {e})") from None
    tokens, start, kind = t["tokens"], t["start"], t["kind"]
    match = NAME.fullmatch(Path(file).name)
    if match is None or int(match.group(1)) != seed:
        raise RowsError(f"{file}: its name does not carry its seed {seed}")
    if made_for != vocab:
        raise RowsError(f"{file}: made for a vocabulary of {made_for}, the model has {vocab}")
    if any(x.dtype != torch.int64 for x in (tokens, start, kind)) or tokens.dim() != 2 \
            or start.shape != (len(tokens),) or kind.shape != (len(tokens),):
        raise RowsError(f"{file}: tokens must be [N, L] and start, kind [N], all int64; got "
                        f"{tuple(tokens.shape)}, {tuple(start.shape)}, {tuple(kind.shape)}")
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise RowsError(f"{file}: token ids outside [0, {vocab})")
    if new_tokens < 1 or held < 0:
        raise RowsError(f"{file}: new_tokens {new_tokens} and chat_heldout {held} out of range")
    if len(start) and (int(start.min()) < 1 or int((start + new_tokens).max()) > tokens.shape[1]):
        raise RowsError(f"{file}: an answer's start leaves no prompt or no room for its "
                        f"{new_tokens} tokens in rows of {tokens.shape[1]}")
    if not bool(((kind >= 0) & (kind <= 2)).all()):
        raise RowsError(f"{file}: kinds must be 0 (held-out code), 1 (chat) or 2 (code)")
    return Rows(tokens, start, kind, seed, new_tokens, held)


def earlier(folder: Path, seed: int, vocab: int, new_tokens: int) -> list[Rows]:
    """Every other run's rows in ``folder`` (by seed), each answered with ``new_tokens``."""
    out = []
    for file in sorted(Path(folder).glob("rows-*.safetensors")):
        match = NAME.fullmatch(file.name)
        if match is None or int(match.group(1)) == seed:
            continue
        rows = load(file, vocab)
        if rows.new_tokens != new_tokens:
            raise RowsError(f"{file}: answers of {rows.new_tokens} tokens, this run's "
                            f"--new-tokens is {new_tokens}")
        out.append(rows)
    return out


def padded(tokens: list[torch.Tensor]) -> torch.Tensor:
    """Right-padded rows of several runs ``[sum N, max L]`` (padding: token 0, past each
    row's end, never read as text)."""
    width = max(t.shape[1] for t in tokens)
    out = torch.zeros(sum(len(t) for t in tokens), width, dtype=torch.int64)
    r = 0
    for t in tokens:
        out[r:r + len(t), :t.shape[1]] = t
        r += len(t)
    return out
