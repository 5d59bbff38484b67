"""The prompts the heads' data continues: held-in standard-library code chunks and chat
questions made from the code's own docstrings (``make_prompts``); chat questions the model
asks itself (``self_asked``, Magpie: it is given the chat template's text up to a user
message and writes the message, sampled), chat text in the model's own distribution where
the corpus's questions are all about its code; and rows of consecutive source-file tokens
(``corpus_rows``: ``data="corpus"``, no generation).
"""
from __future__ import annotations

import random
import time
from typing import Optional

from rewriter.models.corpus import load_corpus
from rewriter.training.generation import engine_of, eos_ids, progress_bar


def make_prompts(tokenizer, split: str, n: int, length: int, seed: int, chat: bool) -> list[list[int]]:
    """``n`` prompts from the corpus split: code chunks of ``length`` tokens and (when the
    tokenizer has a chat template and ``chat``) as many chat questions about the code."""
    from rewriter.runtime.chat import chat_prompt, split_tokenizer
    tok, text = split_tokenizer(tokenizer)
    rng = random.Random(f"{seed}-{split}")
    docs = load_corpus(split)
    rng.shuffle(docs)
    code, questions = [], []
    for rel, source in docs:
        ids = tok.encode(source).ids
        for i in range(0, max(0, len(ids) - length), length * 8):
            code.append(ids[i:i + length])
        questions += _questions(rel, source)
        if len(code) >= n and len(questions) >= n:
            break
    rng.shuffle(code)
    rng.shuffle(questions)
    use_chat = chat and text is not None and text.chat_template is not None
    n_chat = n // 2 if use_chat else 0
    if len(code) < n - n_chat or len(questions) < n_chat:  # never fewer prompts than asked
        raise ValueError(f"train_heads: the {split} corpus gives {len(code)} code chunks of "
                         f"{length} tokens and {len(questions)} chat questions; {n} prompts "
                         f"need {n - n_chat} and {n_chat}: ask for fewer prompts")
    out = code[:n - n_chat] + [chat_prompt(tok, text, q) for q in questions[:n_chat]]
    rng.shuffle(out)
    return out


QUESTION_TOKENS = 64  # a self-asked question longer than this is dropped
QUESTION_BATCH = 32  # questions sampled at once: fixed, so the questions depend on the seed only


def question_prefix(model, tokenizer, who: str = "train_heads") -> list[int]:
    """The chat template's tokens before a user message (what the model continues with a
    question of its own); ``ValueError`` naming the command ``who`` when there is no way to ask."""
    from rewriter.runtime.chat import render, split_tokenizer
    tok, text = split_tokenizer(tokenizer)
    if text.chat_template is None:
        raise ValueError(f"{who}: self-asked questions need a chat template; this "
                         "tokenizer has none")
    mark = "\u2063QUESTION\u2063"  # where the user's message goes
    rendered = render(text, [{"role": "user", "content": mark}], add_generation_prompt=False)
    if rendered.count(mark) != 1:
        raise ValueError(f"{who}: the chat template does not show the user's message "
                         "once: cannot ask the model for one")
    prefix = tok.encode(rendered[:rendered.index(mark)], add_special_tokens=False).ids
    if not prefix:
        raise ValueError(f"{who}: the chat template has no text before the user's "
                         "message: nothing to ask the model with")
    if not eos_ids(model, tokenizer):
        raise ValueError(f"{who}: self-asked questions need an end-of-sequence token "
                         "(where a question ends); the model's config names none")
    return prefix


def self_asked(model, tokenizer, n: int, seed: int, progress: bool = False,
               batch: int = QUESTION_BATCH, deadline: Optional[float] = None,
               who: str = "train_heads") -> list[list[int]]:
    """``n`` chat prompts whose user message the model wrote itself (Magpie): sampled
    (temperature 1, top-k 50, top-p 0.95, seeded, ``batch`` at a time) after the chat
    template's text up to a user message (``question_prefix``), kept when it ends its turn
    within ``QUESTION_TOKENS`` tokens and is new. The questions depend on the seed and
    ``batch`` (a GPU samples more at once). ``deadline`` (``time.perf_counter()``): stop
    after the batch that passes it, with fewer than ``n``."""
    if type(batch) is not int or batch < 1:
        raise ValueError(f"{who}: the question batch must be an int >= 1, got {batch!r}")
    from rewriter.runtime.chat import chat_prompt, split_tokenizer
    tok, text = split_tokenizer(tokenizer)
    prefix = question_prefix(model, tokenizer, who)
    eos = eos_ids(model, tokenizer)
    engine = engine_of(model)
    seen, out, tries = set(), [], 0
    bar = progress_bar(progress, n, "self-asked questions", "question")
    while len(out) < n and (deadline is None or time.perf_counter() < deadline):
        if tries >= 4 * n:  # a model that never ends its turn, or repeats itself
            raise ValueError(f"train_heads: the model asked {len(out)} distinct questions of "
                             f"at most {QUESTION_TOKENS} tokens in {tries} tries; {n} asked")
        made = engine.generate([prefix] * batch, max_new_tokens=QUESTION_TOKENS,
                               do_sample=True, temperature=1.0, top_k=50, top_p=0.95,
                               seed=seed * 1_000_003 + tries, eos_token_id=sorted(eos))
        tries += batch
        for row in made[:, len(prefix):].tolist():
            ends = [i for i, t in enumerate(row) if t in eos]
            q = tok.decode(row[:ends[0]], skip_special_tokens=True).strip() if ends else ""
            if q and q not in seen and len(out) < n:
                seen.add(q)
                out.append(chat_prompt(tok, text, q))
                bar.update(1)
    bar.close()
    return out


def corpus_rows(tokenizer, split: str, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` chunks of ``length`` consecutive tokens of the corpus split's source files (the
    ``data="corpus"`` rows: teacher-forced, no generation)."""
    from rewriter.runtime.chat import split_tokenizer
    tok, _ = split_tokenizer(tokenizer)
    rng = random.Random(f"{seed}-{split}-rows")
    docs = load_corpus(split)
    rng.shuffle(docs)
    chunks: dict[int, list] = {}  # a file's rows, tokenized once
    cap = -(-n // 64)  # rows per file: at least 64 files, while the corpus has them
    while True:
        rows = []
        for i, (_, source) in enumerate(docs):
            if i not in chunks:
                ids = tok.encode(source).ids
                chunks[i] = [ids[j:j + length] for j in range(0, len(ids) - length + 1, length)]
            every = chunks[i]
            step = max(1, len(every) // cap)
            rows += every[::step][:cap]  # spread over the file
            if len(rows) >= n:
                break
        every_row = len(chunks) == len(docs) and all(len(c) <= cap for c in chunks.values())
        if len(rows) >= n or every_row:  # enough, or the whole corpus is in
            break
        cap *= 2
    if len(rows) < n:  # never fewer rows than asked
        raise ValueError(f"train_heads: the {split} corpus gives {len(rows)} rows of {length} "
                         f"tokens; {n} asked: ask for fewer prompts or shorter rows")
    rng.shuffle(rows)
    return rows[:n]


def _questions(rel: str, source: str) -> list[str]:
    """Chat questions from the functions a file defines with a docstring."""
    import ast
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    module = rel.removesuffix(".py").replace("/", ".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
            if 10 < len(doc) < 160:
                out.append(f"Write a Python function `{node.name}`: {doc}" if len(out) % 2 else
                           f"What does `{module}.{node.name}` do? Its docstring says: {doc}")
    return out
