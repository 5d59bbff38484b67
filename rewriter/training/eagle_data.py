"""The rows a ``rewriter train-eagle`` run wrote, kept in a folder (``--data DIR``) so that
later runs train on them too: a CPU makes a GPU call's data in under an hour, so a draft
grows over several runs, each adding new questions.

One file a run, ``DIR/rows-<seed>.safetensors`` (a run's questions follow from its seed,
its ``--question-batch`` and the machine that sampled them):

- ``tokens`` ``[N, L]`` int64, right-padded; ``start`` ``[N]`` where each row's answer
  begins; ``kind`` ``[N]``: 0 a held-out code prompt, 1 a chat question, 2 a code prompt
  (the last ``chat_heldout`` chat rows are the run's held-out ones);
- metadata: ``seed``, ``new_tokens``, ``chat_heldout``, and the model's ``vocab``, ``probe``
  (its LM head's corner, ``rewriter.drafts.heads.probe_of``) and ``dtype`` while it answered.

Nothing in a file is trusted: a file that does not parse, was made for another model, or
whose tokens, starts or kinds are out of range stops the run with its name (no pickle:
safetensors).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from rewriter.drafts import heads as heads_file
from rewriter.files import tensor_files

NAME = re.compile(r"rows-(0|-?[1-9]\d*)\.safetensors")  # the seed as str() writes it
HELD, CHAT, CODE, EARLIER_CHAT = 0, 1, 2, 3  # kinds; EARLIER_CHAT only after ``merged``


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


def save(folder: Path, rows: Rows, lm_head: torch.Tensor) -> Path:
    """Write ``rows`` made by the model of ``lm_head`` ``[V, H]`` (``tensor_files.save``:
    under a temporary name, then renamed: a run killed while writing leaves no torn file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = path(folder, rows.seed)
    tensor_files.save(target, {"tokens": rows.tokens.to(torch.int64), "start": rows.start.to(torch.int64),
                               "kind": rows.kind.to(torch.int64)},
                      {"seed": str(rows.seed), "new_tokens": str(rows.new_tokens),
                       "chat_heldout": str(rows.chat_heldout), "vocab": str(lm_head.shape[0]),
                       "probe": json.dumps(heads_file.probe_of(lm_head)), "dtype": str(lm_head.dtype)})
    return target


def load(file: Path, lm_head: torch.Tensor) -> Rows:
    """One run's rows, checked against the model of ``lm_head`` ``[V, H]``."""
    from safetensors import safe_open
    vocab = lm_head.shape[0]
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in ("tokens", "start", "kind")}
        seed, new_tokens, held, made_for = (int(meta[k]) for k in ("seed", "new_tokens",
                                                                    "chat_heldout", "vocab"))
        probe = json.loads(meta["probe"])
    except Exception as e:  # a torn or foreign file
        raise RowsError(f"{file}: not a rows file of train-eagle ({type(e).__name__}: {e})") from None
    match = NAME.fullmatch(Path(file).name)
    if match is None or match.group(1) != str(seed):
        raise RowsError(f"{file}: its name is not rows-{seed}.safetensors (its seed)")
    corner = heads_file.probe_of(lm_head)
    if not heads_file.is_matrix(probe, len(corner), len(corner[0])):
        raise RowsError(f"{file}: its model's probe is not a {len(corner)} x {len(corner[0])} "
                        f"matrix of finite numbers")
    why = heads_file.unfit(lm_head, made_for, lm_head.shape[1], probe) if made_for == vocab \
        else f"made for a vocabulary of {made_for}, the model has {vocab}"
    if why:
        raise RowsError(f"{file}: answered by another model: {why}")
    tokens, start, kind = t["tokens"], t["start"], t["kind"]
    if any(x.dtype != torch.int64 for x in (tokens, start, kind)) or tokens.dim() != 2 \
            or start.shape != (len(tokens),) or kind.shape != (len(tokens),):
        raise RowsError(f"{file}: tokens must be [N, L] and start, kind [N], all int64; got "
                        f"{tuple(tokens.shape)}, {tuple(start.shape)}, {tuple(kind.shape)}")
    width = tokens.shape[1]
    if not (1 <= new_tokens < width and 0 <= held <= len(tokens)):
        raise RowsError(f"{file}: new_tokens {new_tokens} or chat_heldout {held} out of range "
                        f"for {len(tokens)} rows of {width} tokens")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise RowsError(f"{file}: token ids outside [0, {vocab})")
    # in Python ints: a start near 2**63 would wrap in int64
    if len(start) and (int(start.min()) < 1 or int(start.max()) + new_tokens > width):
        raise RowsError(f"{file}: an answer's start leaves no prompt or no room for its "
                        f"{new_tokens} tokens in rows of {width}")
    if not bool(((kind >= HELD) & (kind <= CODE)).all()):
        raise RowsError(f"{file}: kinds must be 0 (held-out code), 1 (chat) or 2 (code)")
    return Rows(tokens, start, kind, seed, new_tokens, held)


def earlier(folder: Path, seed: int, lm_head: torch.Tensor, new_tokens: int) -> list[Rows]:
    """Every other run's rows in ``folder`` (by seed), each answered with ``new_tokens``."""
    out = []
    for file in sorted(Path(folder).glob("rows-*.safetensors")):
        if file.name == path(folder, seed).name:
            continue
        rows = load(file, lm_head)
        if rows.new_tokens != new_tokens:
            raise RowsError(f"{file}: answers of {rows.new_tokens} tokens, this run's "
                            f"--new-tokens is {new_tokens}")
        out.append(rows)
    return out


def merged(tokens: torch.Tensor, start: torch.Tensor, kinds: torch.Tensor, chat_heldout: int,
           earlier_runs: list[Rows]) -> tuple:
    """This run's rows with the earlier runs' that train: ``(tokens [N', L'], start [N'],
    kinds [N'], dropped)``. Earlier chat rows become ``EARLIER_CHAT`` (train only), earlier
    code rows ``CODE``; their held-out code prompts are left out, and so is every earlier
    row that asks one of this run's held-out chat questions again (the model's answer is
    the same row: ``dropped`` counts them)."""
    chat = (kinds == CHAT).nonzero().flatten()
    held = {tuple(tokens[r, :int(start[r])].tolist()) for r in chat[len(chat) - chat_heldout:]}
    parts, dropped = [(tokens, start, kinds)], 0
    for e in earlier_runs:
        keep = [r for r in range(len(e.tokens)) if e.kind[r] != HELD
                and tuple(e.tokens[r, :int(e.start[r])].tolist()) not in held]
        dropped += int((e.kind != HELD).sum()) - len(keep)
        keep = torch.tensor(keep, dtype=torch.int64)
        kind = e.kind[keep]
        parts.append((e.tokens[keep], e.start[keep], torch.where(kind == CHAT, EARLIER_CHAT, kind)))
    return (padded([t for t, _, _ in parts]), torch.cat([s for _, s, _ in parts]),
            torch.cat([k for _, _, k in parts]), dropped)


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
