"""What ``rewriter train-eagle`` checks once the model is loaded, before any minute is
spent: the earlier runs' rows in ``data`` (``eagle_data``), the draft file ``init`` it
goes on from (it must fit the model and must not have been trained on this run's
questions), and a cut-short run's own rows and checkpoint. Every refusal is a
``ValueError`` naming the file and the fix.
"""
from __future__ import annotations

from pathlib import Path

import torch

from rewriter.drafts import eagle, eagle_file

from rewriter.training import eagle_data
from rewriter.training.eagle_layer import same_shape


def counts_of(own: torch.Tensor, init, resuming: bool) -> torch.Tensor:
    """The token counts the draft file keeps, from which ``train_vocab`` (and later the
    runtime's ``draft_vocab``) takes its tokens: this run's rows' ``own`` plus ``init``'s.
    A resumed run keeps its checkpoint's, which already count its rows: counted again, they
    would rank the tokens otherwise, and the run would go on training on another
    vocabulary than its checkpoint's."""
    if init is None or init.counts is None:
        return own
    return init.counts.clone() if resuming else own + init.counts


def enough_rows(kinds: torch.Tensor, s, fix: str) -> None:
    """More chat rows than ``s.chat_heldout`` and a held-out code prompt, or the run stops."""
    chat = int((kinds == eagle_data.CHAT).sum())
    if chat <= s.chat_heldout:
        raise ValueError(f"train_eagle: {chat} chat rows answered, --chat-heldout {s.chat_heldout}: {fix}")
    if not bool((kinds == eagle_data.HELD).any()):
        raise ValueError(f"train_eagle: no held-out code prompt was answered: {fix}")


def rows_of(s, lm_head: torch.Tensor) -> tuple:
    """``s.data``'s earlier runs' rows, and this seed's own where a run of it was cut short
    (None: none), all checked before any minute is spent."""
    if not s.data:
        return [], None
    if Path(s.data).exists() and not Path(s.data).is_dir():
        raise ValueError(f"train_eagle: --data {s.data}: exists and is not a folder")
    own = eagle_data.path(s.data, s.seed)
    if (own.exists() or own.is_symlink()) and not (own.is_file() and not own.is_symlink()):
        raise ValueError(f"train_eagle: --data: {own} is not a plain file")
    try:
        earlier = eagle_data.earlier(s.data, s.seed, lm_head, s.new_tokens)
        resumed = eagle_data.load(own, lm_head) if own.is_file() else None
    except eagle_data.RowsError as e:
        raise ValueError(f"train_eagle: --data: {e}") from None
    if resumed is not None:
        fix = f"remove {own} (this seed's rows) or give another --seed"
        if (resumed.new_tokens, resumed.chat_heldout) != (s.new_tokens, s.chat_heldout):
            raise ValueError(f"train_eagle: --data: this seed's rows were answered with --new-tokens "
                             f"{resumed.new_tokens} and hold out {resumed.chat_heldout} chat rows; "
                             f"this run has {s.new_tokens} and {s.chat_heldout}: {fix}")
        enough_rows(resumed.kind, s, fix)
    return earlier, resumed


def start_of(s, model, resuming: bool = False):
    """The draft file ``s.init`` names (None: none), checked against the model and the run
    before any minute is spent: its questions must be new ones, so neither its seed nor
    any seed of the files it went on from may be this run's (unless ``resuming``: the
    seed's own rows, kept in ``data``, are what it trained on)."""
    if s.init is None:
        return None
    try:
        init = eagle_file.load(s.init)
        init.fits(model.lm_head.weight.detach().cpu(), f"--init {s.init}")
    except eagle_file.DraftFileError as e:
        raise ValueError(f"train_eagle: {e}") from None
    mine = eagle.Shape.of(model.config)
    if not same_shape(init.shape, mine):
        raise ValueError(f"train_eagle: --init's layer {init.shape} is not this model's {mine}")
    if resuming:
        _own_checkpoint(s, init)
    if s.seed in _seeds_trained_on(init.trained, s.seed, resuming):
        raise ValueError(f"train_eagle: --init {s.init} was trained (or went on from a draft "
                         f"trained) with --seed {s.seed}: the same questions again; give another")
    return init


def _own_checkpoint(s, init) -> None:
    """A run that takes its seed's kept rows goes on from its own checkpoint, as it began."""
    if not isinstance(init.trained, dict) or init.trained.get("seed") != s.seed:
        raise ValueError(f"train_eagle: --init {s.init} was not made by a run of --seed {s.seed}: "
                         f"a run that takes this seed's kept rows goes on from its own checkpoint")
    if init.trained.get("train_vocab", 0) != getattr(s, "train_vocab", 0):
        raise ValueError(f"train_eagle: --init {s.init} trained with --train-vocab "
                         f"{init.trained.get('train_vocab', 0)}: a cut-short run goes on as it began")


def _seeds_trained_on(trained, seed: int, resuming: bool) -> list:
    """The seeds whose questions a draft (and every draft it went on from) trained on; a
    resumed run's own checkpoints (cut short more than once) are left out."""
    seeds, own = [], resuming
    while isinstance(trained, dict):  # each run records the file it went on from
        own = own and trained.get("seed") == seed
        if not own:
            seeds.append(trained.get("seed"))
        data = trained.get("data_seeds")  # the earlier runs' rows it trained on (data)
        seeds += data if isinstance(data, list) else []
        trained = trained.get("init")
    return seeds
