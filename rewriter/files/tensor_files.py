"""The safetensors files the training commands keep (data caches, checkpoints, heads files):
written whole or not at all, and a torn one read as absent, with a warning.

``save`` writes the tensors into a new file under a random temporary name beside the
target (``safe_files.replace_path``: created exclusively, never through a link), syncs it
and renames it over the target: a kill or a full disk leaves the old file or the new one,
never half of one. ``load`` returns a file's tensors and metadata, or None when the file is
absent, not wanted, or unreadable: a file cut short by a kill while an older version wrote
it in place, or damaged since. The caller then makes it again, which a cache or a
checkpoint allows: deleting the work directory by hand is what that used to take.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable, Optional, Union

import safetensors.torch
from safetensors import SafetensorError, safe_open

from rewriter.files import safe_files


def save(path: Union[str, os.PathLike], tensors: dict, metadata: Optional[dict] = None) -> None:
    """Write ``tensors`` (by name; a GPU's are copied to the CPU) and ``metadata``
    (strings) to ``path`` in the safetensors format, atomically; an ``OSError`` names
    ``path``."""
    flat = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    # safetensors' own encoder: one copy of the data in memory, as save_file makes too
    data = safetensors.torch.save(flat, metadata=metadata)
    safe_files.replace_path(path, lambda f: f.write(data))


def load(path: Path, what: str,
         wanted: Callable[[dict], bool] = lambda meta: True) -> Optional[tuple[dict, dict]]:
    """``(tensors, metadata)`` of the file at ``path`` if its metadata are ``wanted``;
    None when there is no file or it is not wanted, and None with a warning naming the
    file as ``what`` when it cannot be read whole."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if not wanted(meta):
                return None
            return {name: f.get_tensor(name) for name in f.keys()}, meta
    except (SafetensorError, OSError) as e:  # a torn or foreign file
        discard(path, what, f"unreadable ({' '.join(str(e).split())})")
        return None


def discard(path: Path, what: str, why: str) -> None:
    """Warn that ``path`` (``what``) is not used, and why: it will be made again."""
    warnings.warn(f"{path}: {what} is {why}; making it again", RuntimeWarning, stacklevel=3)
