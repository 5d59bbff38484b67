"""An artifact's files, read and checked one by one; every failure is an ``ArtifactError``
naming the file.

``check_file`` holds a listed file to the format's names, to a regular file (no link),
and to the manifest's size and sha256. The readers parse what passed: JSON objects, the
weights (refused when a floating weight holds NaN or an infinity, ``non_finite``), the
tokenizer and the chat template (``tokenizer_config.json``).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch

from rewriter.files import safe_files
from rewriter.errors import ArtifactError
from rewriter.runtime.artifact_dir import KERNEL_NAME, KERNELS_DIR, MANIFEST, TOP_FILES


def check_file(d: Path, name: str, entry: dict, hash: bool = True) -> None:
    """File ``name`` of version directory ``d`` is one of the format's, a regular file,
    of the size (and, with ``hash``, the sha256) its manifest ``entry`` records."""
    parts = name.split("/")
    top = len(parts) == 1 and name in TOP_FILES - {MANIFEST}
    kernel = len(parts) == 2 and parts[0] == KERNELS_DIR and KERNEL_NAME.fullmatch(parts[1])
    if not (top or kernel):  # only the format's files: no evil.sh, no kernels/x
        raise ArtifactError(f"{d / MANIFEST}: lists {name!r:.80}, which is not a file of the "
                            f"format ({', '.join(sorted(TOP_FILES - {MANIFEST}))}, "
                            f"{KERNELS_DIR}/<module>.py)")
    path = d / name
    if len(parts) == 2 and kind(d / parts[0]) not in (None, "dir"):
        raise ArtifactError(f"{d / parts[0]}: not a directory (a link or a file)")
    found = kind(path)
    if found is None:
        raise ArtifactError(f"{path}: missing")
    if found != "file":
        raise ArtifactError(f"{path}: is a {'symbolic link' if found == 'link' else found}, "
                            f"not a regular file")
    size = _stat(path).st_size
    if size != entry["bytes"]:
        raise ArtifactError(f"{path}: {size} bytes, the manifest says {entry['bytes']} "
                            f"(truncated or changed)")
    if hash and sha256_bytes(read_bytes(path)) != entry["sha256"]:
        raise ArtifactError(f"{path}: checksum mismatch (the file was changed or corrupted)")


def kind(path: Path) -> Optional[str]:
    """``safe_files.entry_type``, its failures (a permission) named as the file's."""
    try:
        return safe_files.entry_type(path)
    except OSError as e:
        raise ArtifactError(f"{path}: unreadable ({e.strerror or e})") from e


def _stat(path: Path) -> os.stat_result:
    try:
        return path.lstat()
    except OSError as e:
        raise ArtifactError(f"{path}: unreadable ({e.strerror or e})") from e


def read_bytes(path: Path) -> bytes:
    """A regular file's bytes (a symlink is refused); any failure names the file."""
    try:
        return safe_files.read_file(os.fspath(path))
    except OSError as e:
        raise ArtifactError(f"{path}: unreadable ({e.strerror or e})") from e


def read_text(path: Path) -> str:
    try:
        return read_bytes(path).decode()
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 text ({e})") from e


def parse_json(path: Path, data: bytes) -> dict:
    try:
        value = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, huge ints
        raise ArtifactError(f"{path}: unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(value, dict):
        raise ArtifactError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_json(path: Path) -> dict:
    return parse_json(path, read_bytes(path))


def read_weights(path: Path) -> dict:
    from safetensors.torch import load_file
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ArtifactError(f"{path}: unreadable safetensors ({e})") from e
    problem = non_finite(tensors)
    if problem:
        raise ArtifactError(f"{path}: {problem}")
    return tensors


def non_finite(tensors: dict[str, torch.Tensor]) -> Optional[str]:
    """What is wrong with the first floating tensor holding NaN or an infinity, or None.

    Such a weight loads and runs: a NaN int4 scale makes every logit NaN, and greedy
    decoding then emits token 0 forever. ``aminmax`` is one read of each tensor with
    nothing allocated (NaN propagates to both ends; an infinity is one of them): 20x
    faster than ``isfinite(t).all()`` on SmolLM2's embedding, 0.15 s for all its weights."""
    for name, t in tensors.items():
        if not t.is_floating_point() or not t.numel():
            continue
        x = t if t.dtype in _MINMAX_DTYPES else t.float()  # float8 has no aminmax kernel
        low, high = torch.aminmax(x)
        if not bool(torch.isfinite(low) & torch.isfinite(high)):
            bad = int((~torch.isfinite(x)).sum())  # on the failure path only: counted
            return (f"tensor {name!r} ({str(t.dtype).removeprefix('torch.')} {list(t.shape)}) "
                    f"holds {bad} NaN or infinite value{'s' if bad != 1 else ''}")
    return None


_MINMAX_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def read_tokenizer(path: Path):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ArtifactError(f"{path}: unreadable tokenizer ({e})") from e


def read_text_config(path: Path):
    """The chat template and special tokens (``runtime.chat.TextConfig``); the template is
    data: it is rendered in Jinja's sandbox, never run as Python."""
    from .chat import TextConfig
    try:
        return TextConfig.from_json(read_json(path), str(path))
    except ValueError as e:
        raise ArtifactError(str(e)) from e


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
