"""``rewriter train-eagle``'s data: the rows the model asks and answers itself (or a
cut-short run's, taken back from ``data``), the earlier runs' rows merged in, the hidden
states over all of them, and the split into a training set and held-out rows.

Rows are ``(tokens [N, L], start [N], kinds [N])``: right-padded rows, where each row's
answer begins, and ``eagle_data``'s kinds (held-out code, chat, code, earlier chat).
"""
from __future__ import annotations

import random

import torch

from rewriter.training import eagle_data
from rewriter.training.generation import continue_prompts, eos_ids, hidden_states, one_engine
from rewriter.training.heads_data import merge_parts, row_ends
from rewriter.training.prompts import make_prompts, self_asked

HELD_CODE = 48  # held-out code prompts (train-heads' default)
PROMPT_TOKENS = 64  # code prompts' length (train-heads' default)


def own_rows(model, tokenizer, s, phases, resumed) -> tuple:
    """``((tokens, start, kinds), questions asked)``: this run's rows, asked and answered
    within their deadlines, or the cut-short run's ``resumed`` rows (questions: None, not
    known)."""
    if resumed is not None:
        print(f"{len(resumed.tokens)} rows of this seed's cut-short run taken from {s.data}", flush=True)
        phases.done("rows")
        return (resumed.tokens, resumed.start, resumed.kind), None
    with one_engine(model):  # traced once, for the questions and the answers
        asked = self_asked(model, tokenizer, s.questions, s.seed, progress=False,
                           batch=s.question_batch, deadline=phases.at(s.ask), who="train_eagle")
        phases.done("ask")
        print(f"{len(asked)} questions asked", flush=True)
        held = make_prompts(tokenizer, "heldout", HELD_CODE, PROMPT_TOKENS, s.seed, chat=True)
        code = make_prompts(tokenizer, "train", s.code_prompts, PROMPT_TOKENS, s.seed, chat=True)
        # held-out first (answered unless the deadline passed before them), then chat and
        # code interleaved: a deadline keeps both kinds
        mixed = [("chat", p) for p in asked] + [("code", p) for p in code]
        random.Random(s.seed).shuffle(mixed)
        kinds = ["held"] * len(held) + [k for k, _ in mixed]
        tokens, start, _ = continue_prompts(model, tokenizer, held + [p for _, p in mixed],
                                            s.new_tokens, s.generate_batch, False, "train",
                                            deadline=phases.at(s.answer))
    phases.done("answer")
    if len(tokens):  # padded to the widest prompt of all: only the answered ones' width
        tokens = tokens[:, :int(start.max()) + s.new_tokens]
    kinds = torch.tensor([("held", "chat", "code").index(k) for k in kinds[:len(tokens)]],
                         dtype=torch.int64)
    return (tokens, start, kinds), len(asked)


def training_sets(model, tokenizer, s, rows: tuple, earlier: list) -> tuple:
    """``(train, {"chat", "code": held-out rows}, the training parts, what the data is)``:
    this run's ``rows`` with the ``earlier`` runs' (``eagle_data.merged``), their hidden
    states, the last ``s.chat_heldout`` chat rows and the held-out code prompts held out."""
    tokens, start, kinds = rows
    own = len(tokens)
    tokens, start, kinds, dropped = eagle_data.merged(tokens, start, kinds, s.chat_heldout, earlier)
    hidden, _ = hidden_states(model, tokens, False, "train", chunk=s.hidden_chunk)
    data = {"tokens": tokens, "start": start, "hidden": hidden}
    data["end"] = row_ends(data, s.new_tokens, eos_ids(model, tokenizer))
    part = lambda rows: {k: v[rows] for k, v in data.items()}  # noqa: E731
    of_kind = lambda kind: (kinds == kind).nonzero().flatten()  # noqa: E731
    chat, code, old_chat = of_kind(eagle_data.CHAT), of_kind(eagle_data.CODE), of_kind(eagle_data.EARLIER_CHAT)
    cut = len(chat) - s.chat_heldout
    parts = [part(chat[:cut])] + [part(r) for r in (code, old_chat) if len(r)]
    heldout = {"chat": part(chat[cut:]), "code": part(of_kind(eagle_data.HELD))}
    train = merge_parts(parts)
    described = {"chat_rows": cut, "code_rows": int((code < own).sum()),
                 "earlier_runs": [e.seed for e in earlier], "earlier_chat_rows": len(old_chat),
                 "earlier_code_rows": int((code >= own).sum()), "earlier_rows_dropped": dropped,
                 "heldout_chat_rows": s.chat_heldout,
                 "heldout_code_rows": len(heldout["code"]["tokens"]),
                 "generated_positions": int((train["end"] - train["start"]).sum())}
    return train, heldout, parts, described
