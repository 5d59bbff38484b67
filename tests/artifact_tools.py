"""Helpers for tests that craft artifacts: find a saved artifact's files, and make its
checksums true again after a test edited them, so that ``rewriter.load`` gets past the
integrity checks and reaches the check the test is about.

Works on both layouts: format 2 (``DIR/artifact.json`` naming ``DIR/v-<hex>/``, whose
``manifest.json`` it checksums) and format 1 (``DIR/manifest.json`` at the top).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

POINTER, MANIFEST = "artifact.json", "manifest.json"


def version_dir(directory) -> Path:
    """The directory that holds the manifest and the files it lists."""
    d = Path(directory)
    pointer = _load(d / POINTER)
    if isinstance(pointer, dict) and isinstance(pointer.get("version_dir"), str):
        return d / pointer["version_dir"]
    versions = sorted(d.glob("v-*"))  # a pointer a test has broken: the one version there
    return versions[0] if len(versions) == 1 else d


def artifact_files(directory) -> dict[str, Path]:
    """Paths of the files a test may edit, by name: ``manifest.json``, ``ir.json``,
    ``weights.safetensors``, ``tokenizer.json`` (and ``artifact.json`` in format 2)."""
    d = Path(directory)
    v = version_dir(d)
    files = {name: v / name for name in (MANIFEST, "ir.json", "weights.safetensors",
                                           "tokenizer.json")}
    if (d / POINTER).exists():
        files[POINTER] = d / POINTER
    return files


def reseal(directory, entries: bool = True) -> None:
    """Recompute every file entry (bytes, sha256) of the manifest from the files on disk,
    then the manifest's checksum in the pointer. Entries whose file is gone are dropped.
    A manifest or pointer that is not JSON (a test may write garbage) is left as it is.
    ``entries=False`` keeps the manifest as it is (a test's edit of the file entries) and
    only makes the pointer's checksum of it true."""
    d = Path(directory)
    v = version_dir(d)
    manifest_path = v / MANIFEST
    manifest = _load(manifest_path)
    if entries and isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
        manifest["files"] = {name: _entry(v / name) for name in manifest["files"]
                             if isinstance(name, str) and (v / name).is_file()}
        manifest_path.write_text(json.dumps(manifest, indent=1))
    pointer_path = d / POINTER
    pointer = _load(pointer_path)
    if isinstance(pointer, dict) and manifest_path.is_file():
        pointer["manifest_sha256"] = _sha256(manifest_path.read_bytes())
        pointer_path.write_text(json.dumps(pointer, indent=1))


def _load(path: Path):
    """The JSON in ``path``, or None when there is none (missing, broken by a test)."""
    try:
        return json.loads(path.read_bytes())
    except (ValueError, OSError, RecursionError):
        return None


def _entry(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": _sha256(data)}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def saved_and_loaded(opt, path, ids, new: int = 8):
    """``opt`` saved at ``path`` and loaded back: the copy gives the same greedy tokens on
    ``ids`` and holds the same KV bytes per token. Returns the copy."""
    import torch
    import rewriter
    opt.save(path)
    back = rewriter.load(path)
    assert torch.equal(back.generate(ids, max_new_tokens=new), opt.generate(ids, max_new_tokens=new))
    assert back.kv_bytes_per_token() == opt.kv_bytes_per_token()
    return back
