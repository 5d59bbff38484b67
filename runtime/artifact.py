"""Ahead-of-time artifacts: a directory that loads without the model's Python code.

    manifest.json        format version, versions, model config, passes, sha256 of each file
    ir.json              the IR as data (``rewriter.ir.serialize``) and the IR's info
    weights.safetensors  every weight once (tied weights are stored once and aliased)
    tokenizer.json       the tokenizer, when there is one
    kernels/*.py         generated Triton kernels (Triton backend), for reading and, with
                         ``load(..., trust_code=True)``, for running as stored

Saving writes a hidden sibling directory and renames it into place, so an interrupted
save leaves no directory that loads. Loading checks every file against the manifest
before reading it and raises ``ArtifactError`` naming the file and the reason. Format 1
stores no code; ``trust_code`` is accepted for the generated kernels later formats store.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from rewriter.errors import ArtifactError

FORMAT = "rewriter-artifact"
FORMAT_VERSION = 1
IR_FILE, WEIGHTS_FILE, TOKENIZER_FILE, MANIFEST, KERNELS_DIR = (
    "ir.json", "weights.safetensors", "tokenizer.json", "manifest.json", "kernels")


# ---------------------------------------------------------------------------- save

def save(engine, directory, progress: bool = False) -> Path:
    from rewriter.ir.serialize import graph_to_data
    final = Path(directory)
    if final.exists() and not (final / MANIFEST).exists() and any(final.iterdir()):
        raise ArtifactError(f"{final}: exists and is not an artifact; not overwriting it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.saving-", dir=final.parent))
    bar = _bar(progress, 4)
    try:
        stored, names = _unique_weights(engine.ir.weights())
        ir_data = {"graph": graph_to_data(engine.ir.gm), "weights": names,
                   "info": engine.ir.info}
        _write_json(tmp / IR_FILE, ir_data)
        bar.update()
        from safetensors.torch import save_file
        save_file(stored, str(tmp / WEIGHTS_FILE))
        bar.update()
        tokenizer = _tokenizer_json(engine.tokenizer)
        if tokenizer is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer)
        kernels = {n: src for n, src in engine.kernel_sources().items() if "/" not in n}
        if kernels:
            (tmp / KERNELS_DIR).mkdir()
            for name, source in kernels.items():
                (tmp / KERNELS_DIR / name).write_text(source)
        files = {p.relative_to(tmp).as_posix(): _file_entry(p)
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        bar.update()
        _write_json(tmp / MANIFEST, _manifest(engine, files, tokenizer is not None))
        _replace_dir(tmp, final)
        bar.update()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return final


def _manifest(engine, files: dict, has_tokenizer: bool) -> dict:
    import rewriter
    weights = [t for t in engine.ir.weights().values() if t.is_floating_point()]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"rewriter": rewriter.__version__, "torch": torch.__version__,
                     "triton": _version("triton"), "transformers": _version("transformers")},
        "model": {"family": engine.ir.info.get("family"), "config": engine.ir.info.get("config"),
                  "layers": len(engine.ir.layers), "parameters": engine.ir.num_params(),
                  "dtype": str(max(weights, key=torch.Tensor.numel).dtype).removeprefix("torch.")
                  if weights else None},
        "backend": engine.backend,
        "passes": engine.pass_specs,
        "tokenizer": TOKENIZER_FILE if has_tokenizer else None,
        "files": files,
    }


def _unique_weights(weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(stored name -> tensor, every weight name -> stored name).

    safetensors refuses tensors that share memory, and tied weights (an LM head that is
    the embedding) do: identical views are stored once; other overlapping views are copied.
    """
    stored, names, seen, storages = {}, {}, {}, set()
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if key in seen:
            names[name] = seen[key]
            continue
        storage = t.untyped_storage().data_ptr()
        t = t.detach()
        t = t.clone() if storage in storages else t.contiguous()
        storages.add(storage)
        stored[name], names[name], seen[key] = t, name, name
    return stored, names


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move ``tmp`` to ``final``; an old artifact there is moved aside, then deleted."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- load

def load(directory, trust_code: bool = False, backend: Optional[str] = None):
    """The ``Engine`` stored in ``directory``; every file is checked first. ``backend``
    overrides the one it was saved with (e.g. ``"torch"`` for a Triton artifact on a CPU)."""
    from rewriter.ir.core import IR
    from rewriter.ir.serialize import check_weight_path, graph_from_data
    from rewriter.ir.shapes import propagate_shapes
    from .engine import Engine
    d = Path(directory)
    manifest = _read_manifest(d)
    for name, entry in manifest["files"].items():
        _check_file(d, name, entry)
    for name in (IR_FILE, WEIGHTS_FILE):
        if name not in manifest["files"]:
            raise ArtifactError(f"{d / MANIFEST}: lists no {name}")
    ir_data = _read_json(d / IR_FILE)
    weights = _read_weights(d / WEIGHTS_FILE)
    try:
        for name in ir_data["weights"]:
            check_weight_path(name)
        by_name = {name: weights[stored] for name, stored in ir_data["weights"].items()}
        gm = graph_from_data(ir_data["graph"], by_name)
        ir = IR(gm, ir_data["info"])
        propagate_shapes(gm, ir.info["inputs"])
    except KeyError as e:
        raise ArtifactError(f"{d / IR_FILE}: missing entry {e}") from e
    except (ValueError, RuntimeError, TypeError) as e:
        raise ArtifactError(f"{d / IR_FILE}: {e}") from e
    tokenizer = None
    if manifest.get("tokenizer") is not None:
        if manifest["tokenizer"] != TOKENIZER_FILE or TOKENIZER_FILE not in manifest["files"]:
            raise ArtifactError(f"{d / MANIFEST}: tokenizer must be the listed {TOKENIZER_FILE}, "
                                f"got {manifest['tokenizer']!r}")
        tokenizer = _read_tokenizer(d / TOKENIZER_FILE)
    backend = backend or manifest.get("backend", "torch")
    stored_kernels = {n.split("/", 1)[1].removesuffix(".py"): (d / n).read_text()
                      for n in manifest["files"] if n.startswith(KERNELS_DIR + "/")}
    if backend == "triton":
        from .triton_backend import available
        reason = available(next(iter(weights.values())).device if weights else torch.device("cpu"))
        if reason is not None:
            raise ValueError(f"{d}: saved for {reason}; load(..., backend='torch') runs it anyway")
    elif backend != "torch":
        raise ArtifactError(f"{d / MANIFEST}: unknown backend {backend!r}")
    engine = Engine(ir, tokenizer, manifest.get("passes", []), backend)
    if trust_code:
        engine.trusted_kernels = stored_kernels
    return engine


def read_manifest(directory) -> dict:
    """The manifest of an artifact (checked for format, not for file contents)."""
    return _read_manifest(Path(directory))


def _read_manifest(d: Path) -> dict:
    if not d.is_dir():
        raise ArtifactError(f"{d}: no such artifact directory")
    path = d / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{path}: missing (not an artifact, or an interrupted save)")
    m = _read_json(path)
    if m.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a rewriter artifact manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {m.get('format_version')!r} is not "
                            f"supported (this rewriter reads version {FORMAT_VERSION})")
    if not isinstance(m.get("files"), dict):
        raise ArtifactError(f"{path}: has no file list")
    return m


def _check_file(d: Path, name: str, entry: dict) -> None:
    parts = name.split("/")
    plain = all(p and p not in (".", "..") and Path(p).name == p for p in parts)
    if not plain or name == MANIFEST or (len(parts) == 2 and parts[0] != KERNELS_DIR) or len(parts) > 2:
        raise ArtifactError(f"{d / MANIFEST}: bad file name {name!r}")
    path = d / name
    if not path.is_file():
        raise ArtifactError(f"{path}: missing")
    size = path.stat().st_size
    if size != entry.get("bytes"):
        raise ArtifactError(f"{path}: {size} bytes, the manifest says {entry.get('bytes')} "
                            f"(truncated or changed)")
    if _sha256(path) != entry.get("sha256"):
        raise ArtifactError(f"{path}: checksum mismatch (the file was changed or corrupted)")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object")
    return data


def _read_weights(path: Path) -> dict:
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ArtifactError(f"{path}: unreadable safetensors ({e})") from e


def _read_tokenizer(path: Path):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ArtifactError(f"{path}: unreadable tokenizer ({e})") from e


# ---------------------------------------------------------------------------- helpers

def _tokenizer_json(tokenizer) -> Optional[str]:
    """The ``tokenizers`` JSON of a ``tokenizers.Tokenizer`` or a fast HF tokenizer."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not hasattr(backend, "to_str"):
        raise ArtifactError(f"cannot store a tokenizer of type {type(tokenizer).__name__}; "
                            f"pass a tokenizers.Tokenizer or a fast Hugging Face tokenizer")
    return backend.to_str()


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, default=_json_default))


def _json_default(x):
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    raise TypeError(f"cannot store {type(x).__name__} {x!r} in JSON")


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _version(package: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _bar(enabled: bool, total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="save", unit="file", disable=not enabled, leave=False)
