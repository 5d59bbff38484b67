"""An artifact's manifest and pointer: the fields a save writes and the checks a read makes.

``manifest_of`` builds the manifest a save writes (versions, model, backend, passes,
timings' machine, tokenizer, every file's bytes and sha256). ``checked_manifest`` reads
the pointer (``DIR/artifact.json``), the manifest it names, the manifest's checksum
against the pointer's (an edited manifest is reported as such) and every field's type.
``listed_tokenizer`` holds the tokenizer field to the file list.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

import torch

from rewriter.errors import ArtifactError
from rewriter.ir.sharing import sources
from rewriter.version import __version__
from rewriter.runtime.artifact_dir import (
    FORMAT, MANIFEST, POINTER, TEXT_FILE, TOKENIZER_FILE, VERSION_DIR, is_artifact)
from rewriter.runtime.artifact_files import (
    check_file, kind, parse_json, read_bytes, read_tokenizer, sha256_bytes)
from rewriter.runtime.artifact_info import measured_on_ok
from rewriter.values import shown

FORMAT_VERSION = 2


def manifest_of(engine, files: dict, has_tokenizer: bool) -> dict:
    """The manifest of ``engine`` saved as ``files`` (name -> {bytes, sha256})."""
    weights = [t for t in engine.ir.weights().values() if t.is_floating_point()]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": {"rewriter": __version__, "torch": torch.__version__,
                     "triton": _version("triton"), "transformers": _version("transformers")},
        "model": {"family": engine.ir.info.get("family"), "config": engine.ir.info.get("config"),
                  "layers": len(engine.ir.layers), "parameters": engine.ir.num_params(),
                  "dtype": str(max(weights, key=torch.Tensor.numel).dtype).removeprefix("torch.")
                  if weights else None},
        "backend": engine.backend,
        "passes": engine.pass_specs,
        "measured_on": engine.ir.info.get("measured_on"),  # whose timings chose the decoding
        # which layer reads which layer's KV cache (ShareKV), for ``rewriter info``
        "kv_sharing": {str(r): o for r, o in sorted(sources(engine.ir.graph).items())},
        "tokenizer": TOKENIZER_FILE if has_tokenizer else None,
        "files": files,
    }


def _version(package: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def read_manifest(directory) -> dict:
    """The manifest of an artifact, checked against the pointer's checksum and for its
    fields; each listed file is checked to exist with its recorded size (not hashed)."""
    d, manifest = checked_manifest(Path(directory).expanduser())
    for name, entry in manifest["files"].items():
        check_file(d, name, entry, hash=False)
    return manifest


def checked_manifest(root: Path) -> tuple[Path, dict]:
    """(the version directory, its manifest), after checking the pointer, the manifest's
    checksum against the pointer, and the manifest's fields."""
    pointer = _read_pointer(root)
    d = root / pointer["version_dir"]
    if kind(d) != "dir":
        raise ArtifactError(f"{d}: missing or not a directory (named by {root / POINTER})")
    path = d / MANIFEST
    data = read_bytes(path)
    digest = sha256_bytes(data)
    if digest != pointer["manifest_sha256"]:
        raise ArtifactError(f"{path}: changed since it was saved (checksum {digest[:16]}…, "
                            f"{POINTER} recorded {pointer['manifest_sha256'][:16]}…)")
    manifest = parse_json(path, data)
    _check_format(path, manifest)
    _check_fields(path, manifest)
    return d, manifest


def _read_pointer(root: Path) -> dict:
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory")
    path = root / POINTER
    if kind(path) is None:
        if is_artifact(root):  # a format-1 one, then
            raise ArtifactError(f"{root}: an artifact of format 1 (an older rewriter); this "
                                f"rewriter reads format {FORMAT_VERSION}: save the model again "
                                f"(rewriter optimize --out {root})")
        raise ArtifactError(f"{path}: missing (not an artifact, or a save that never finished)")
    pointer = parse_json(path, read_bytes(path))
    _check_format(path, pointer)
    name, digest = pointer.get("version_dir"), pointer.get("manifest_sha256")
    if not isinstance(name, str) or not VERSION_DIR.fullmatch(name):
        raise ArtifactError(f"{path}: version_dir must be 'v-' and 16 hex digits, got {name!r:.80}")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ArtifactError(f"{path}: manifest_sha256 must be 64 hex digits, got {digest!r:.80}")
    return pointer


def _check_format(path: Path, data: dict) -> None:
    if data.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a rewriter artifact (format is {data.get('format')!r:.80}, "
                            f"not {FORMAT!r})")
    version = data.get("format_version")
    if version != FORMAT_VERSION or type(version) is not int:
        raise ArtifactError(f"{path}: format version {version!r:.40} is not supported "
                            f"(this rewriter reads version {FORMAT_VERSION})")


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _is_int(x) -> bool:
    """A count or size: a non-negative int that fits 64 bits (``rewriter info`` divides
    it; 10**400 overflowed a float there)."""
    return type(x) is int and 0 <= x < 2 ** 63


def _is_opt_str(x) -> bool:
    return x is None or isinstance(x, str)


def _is_model(m) -> bool:
    return (isinstance(m, dict) and _is_opt_str(m.get("family")) and _is_int(m.get("layers"))
            and _is_int(m.get("parameters")) and _is_opt_str(m.get("dtype"))
            and isinstance(m.get("config"), (dict, type(None))))


def _is_file_entry(e) -> bool:
    return (isinstance(e, dict) and _is_int(e.get("bytes")) and isinstance(e.get("sha256"), str)
            and _SHA256.fullmatch(e["sha256"]) is not None)


# field -> (check, what it must be): the manifest is checksummed, but a resealed or
# hand-made one must still fail here, by name, rather than deep inside load or `info`.
_FIELDS = {
    "created": (lambda v: isinstance(v, str), "a string"),
    "versions": (lambda v: isinstance(v, dict) and all(map(_is_opt_str, v.values())),
                 "an object of version strings"),
    "model": (_is_model, "an object with family, config, layers, parameters and dtype"),
    "backend": (lambda v: isinstance(v, str), "a string"),
    "passes": (lambda v: isinstance(v, list) and all(
        isinstance(p, dict) and isinstance(p.get("name"), str) and isinstance(p.get("params"), dict)
        for p in v), "a list of {name, params} objects"),
    "tokenizer": (_is_opt_str, "null or a file name"),
    "files": (lambda v: isinstance(v, dict) and all(map(_is_file_entry, v.values())),
              "an object of {bytes, sha256} entries"),
}


def _check_fields(path: Path, m: dict) -> None:
    for key, (ok, what) in _FIELDS.items():
        if key not in m:
            raise ArtifactError(f"{path}: has no {key!r}")
        if not ok(m[key]):
            raise ArtifactError(f"{path}: {key!r} must be {what}, got {shown(m[key])}")
    # optional: artifacts saved before it was recorded have none
    if m.get("measured_on") is not None and not measured_on_ok(m["measured_on"]):
        raise ArtifactError(f"{path}: 'measured_on' must be null or an object {{backend, device, "
                            f"machine, passes}} of strings, got {shown(m['measured_on'])}")
    if m.get("kv_sharing") is not None and not _is_sharing(m["kv_sharing"]):
        raise ArtifactError(f"{path}: 'kv_sharing' must be null or an object {{reader layer: "
                            f"owner layer}}, got {shown(m['kv_sharing'])}")


def _is_sharing(x) -> bool:
    """``{"reader": owner}``: a layer id as a string of digits, the owner's as an integer."""
    return isinstance(x, dict) and all(
        isinstance(r, str) and re.fullmatch("[0-9]{1,18}", r) is not None and _is_int(o) for r, o in x.items())


def listed_tokenizer(d: Path, manifest: dict):
    """The tokenizer, or None; the manifest's ``tokenizer`` field and its file list agree.
    An artifact saved without one loads, and its messages say so where text is needed."""
    named, files, where = manifest["tokenizer"], manifest["files"], d / MANIFEST
    if named not in (None, TOKENIZER_FILE):
        raise ArtifactError(f"{where}: tokenizer must be the listed {TOKENIZER_FILE} or null, "
                            f"got {shown(named)}")
    listed = TOKENIZER_FILE in files
    lacking = "the artifact has no tokenizer (save the model again with its tokenizer)"
    if named and not listed:
        raise ArtifactError(f"{where}: names {TOKENIZER_FILE} as the tokenizer, but its file "
                            f"list has no {TOKENIZER_FILE}: {lacking}")
    if TEXT_FILE in files and not listed:
        raise ArtifactError(f"{where}: lists {TEXT_FILE} but not {TOKENIZER_FILE}: {lacking}")
    if listed and not named:
        raise ArtifactError(f"{where}: lists {TOKENIZER_FILE} but its tokenizer field is null "
                            f"(the manifest was edited)")
    return read_tokenizer(d / TOKENIZER_FILE) if listed else None


