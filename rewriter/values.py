"""Checks of plain values that the passes and the runtime both apply."""
from __future__ import annotations

import json
import numbers
import os

# How deep lists and objects may nest in the JSON this project reads from users and files
# (heads and draft metadata, gates files, checkpoint configs, pass spec values). Real ones
# nest 2 to 4 deep. Python's json recurses once a level, so without a bound a few kilobytes
# of brackets raise RecursionError; and the artifact format allows 32
# (``runtime/artifact_info.py``), so what passes here and is stored with an artifact loads.
MAX_JSON_DEPTH = 16

# The largest integer an op argument or a stored setting may be (a C int32: kernels index with it).
MAX_INT = 2**31 - 1


def context_length(config: dict) -> int:
    """Tokens one sequence may hold, from a model's ``config.json`` dict: Llama-style
    ``max_position_embeddings``, GPT-2's ``n_positions``, else 2048 (a value that is not a
    positive integer counts as absent: this is a bound others are checked against)."""
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if is_int(value) and value > 0:
            return int(value)
    return 2048


def within_context(who: str, context: int, **counts: int) -> None:
    """``ValueError`` unless the token counts ``counts`` add up to at most ``context``, the
    model's context length. They are what one layer keeps or reads a step (a ring's
    ``sinks + window``, a selection's ``top_k + recent``): the runtime sizes state by them,
    and no sequence the model was made for holds more tokens than its context."""
    total = sum(counts.values())
    if total > context:
        names = " + ".join(counts)
        shown = " + ".join(str(v) for v in counts.values())
        raise ValueError(f"{who}: {names} = {shown}{f' = {total}' if len(counts) > 1 else ''} "
                         f"exceeds the model's context length, {context} tokens; {names} "
                         f"must be at most {context}")


def is_int(value) -> bool:
    """An integer that is not a bool (numpy integers count; floats never do)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def depth(value, limit: int) -> int:
    """How deep lists and objects nest in ``value`` (a scalar: 0; ``[1]``: 1), counted up
    to just past ``limit`` (iterative: no RecursionError)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > limit:
            break
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        stack.extend((c, d + 1) for c in children)
    return deepest


def parse_json(text, max_depth: int = MAX_JSON_DEPTH):
    """The JSON value in ``text`` (str or UTF-8 bytes), nested at most ``max_depth`` deep;
    anything else is a ``ValueError`` whose message is the reason alone (the caller names
    the file), never a RecursionError."""
    deep = f"lists and objects nested more than {max_depth} deep"
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(deep) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of 5000 digits
        raise ValueError(str(e)[:200]) from None
    if depth(value, max_depth) > max_depth:
        raise ValueError(deep)
    return value


def utf8_text(name: str, text) -> str:
    """``text`` if it is a string that UTF-8 can encode, else a ``ValueError`` naming
    ``name``: a lone surrogate (what argv bytes that are not UTF-8 arrive as, or a
    ``"\\ud800"`` in Python) is no text a tokenizer takes."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid UTF-8 text (a lone surrogate at character "
                         f"{e.start})") from None
    return text


def check_flag(name: str, value) -> bool:
    """``value`` if it is True or False, else a ``ValueError`` naming ``name``: a string
    such as ``"no"`` would count as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r:.80}")
    return value


def path_argument(name: str, value) -> str | os.PathLike:
    """``value`` if it is a non-empty path (a ``str`` or an ``os.PathLike``), else a
    ``ValueError`` naming ``name`` (``Path(None)`` would raise a TypeError that names
    nothing, and ``""`` means the current directory)."""
    problem = path_problem(value)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return value


def path_problem(value) -> str | None:
    """Why ``value`` names no file or directory (the end of a sentence that starts with the
    parameter's name), or None: a path is a ``str``, or an ``os.PathLike`` of one (bytes,
    or an object, would reach ``Path()`` and its raw TypeError), and not blank."""
    try:
        text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    except TypeError:  # __fspath__ returned neither str nor bytes
        text = None
    if not isinstance(text, str):
        return f"must be a str or os.PathLike, got {type(value).__name__}"
    if not text.strip():
        return f"is empty ({text!r} would mean the current directory)"
    return None


def shown(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (then ``...``): a hostile file's value
    named in an error without flooding it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_prompts(owner: str, prompts) -> list[list[int]]:
    """``prompts`` as a list of token-id lists (at least 2 ids each); ``ValueError`` naming
    ``owner`` otherwise (text, a flat list, negative or non-integer ids)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts \
            or not all(isinstance(p, (list, tuple)) and len(p) >= 2
                       and all(type(t) is int and t >= 0 for t in p) for p in prompts):
        raise ValueError(f"{owner}: calibrate must be a list of token-id lists (at least 2 "
                         f"ids each)")
    return [list(p) for p in prompts]
