'''Ahead-of-time artifacts: a directory that loads without the model's Python code.

    DIR/artifact.json          the pointer, written last: {"format": "rewriter-artifact",
                               "format_version": 2, "version_dir": "v-<16 hex>",
                               "manifest_sha256": sha256 of that version's manifest.json}
    DIR/v-<16 hex>/
        manifest.json          versions, model config, passes, bytes and sha256 of each file
        ir.json                the IR as data (``rewriter.ir.serialize``) and the IR's info
        weights.safetensors    every weight once (tied weights are stored once and aliased)
        tokenizer.json         the tokenizer, when there is one
        tokenizer_config.json  beside it: the chat template and the special tokens' text
        kernels/*.py           generated Triton kernels (Triton backend), for reading and,
                               with ``load(..., trust_code=True)``, for running as stored

Guarantees of ``save(engine, DIR)``:

- It writes only inside DIR (creating DIR and missing parents), every file created
  exclusively (``O_EXCL | O_NOFOLLOW``, ``rewriter.files.safe_files``): no link is followed.
- It replaces only an artifact (recognised by the pointer's format marker and version,
  ``artifact_dir.is_artifact``), an empty directory, or the leftovers of interrupted
  saves. Anything else, a symlink at DIR or its pointer, a file in the path, a read-only
  directory: an ``ArtifactError`` naming the path, raised before anything is written.
- A new save goes into a new version directory; the pointer is replaced atomically (a
  rename) only when that is complete, and the old version is deleted after. Killed at
  any moment, DIR loads as the old artifact or the new one, never neither. A failure
  that raises before the rename removes what the save wrote; one that lands after it
  (an interrupt) keeps the new artifact. The next save deletes what a kill left.
- ``~`` in DIR is the user's home directory.
- Two saves to one DIR at once are serialised by a lock (``flock`` on DIR).

``read`` (under ``rewriter.load``) reads the pointer, checks the manifest against the
pointer's checksum (an edited manifest is reported as such), checks the manifest's fields,
then every file's size and sha256, before reading any of them, then that every floating
weight is finite (no NaN, no infinity; ``save`` refuses to write one). The manifest may list
only the format's files (those above; a kernel by a module name, ``kernels/<identifier>.py``).
Every failure is an ``ArtifactError`` naming the file and the reason. Format 1 (a flat
directory, written by rewriter before format 2) is recognised so that a save may replace
it, but not loaded: save it again.
'''
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from rewriter.files import safe_files
from rewriter.errors import ArtifactError
from rewriter.version import __version__
from rewriter.runtime.artifact_info import measured_on_ok
from rewriter.runtime.artifact_dir import (
    FORMAT, IR_FILE, KERNEL_NAME, KERNELS_DIR, MANIFEST, POINTER, TEXT_FILE, TOKENIZER_FILE,
    TOP_FILES, VERSION_DIR, WEIGHTS_FILE,
    Target, is_artifact)

FORMAT_VERSION = 2
__all__ = ["save", "read", "Stored", "read_manifest", "is_artifact", "FORMAT", "FORMAT_VERSION",
           "POINTER", "MANIFEST"]

# Test hook: ``save`` calls each function here with the name of every step it finishes, so
# that a test can kill the process (or raise) at each step in turn.
SAVE_STEP_HOOKS: list[Callable[[str], None]] = []


# ---------------------------------------------------------------------------- save

def save(engine, directory, progress: bool = False) -> Path:
    """Write ``engine`` as the artifact at ``directory`` (see the module docstring)."""
    final = Path(directory).expanduser()  # "~/models/x" is the user's, not ./~/models/x
    bar = _bar(progress, 3)
    try:
        files = _serialize(engine)  # everything in memory first: errors here change no file
        bar.update()
        target = _target(final)
        try:
            _step("locked")
            target.remove_leftovers()
            _step("removed leftovers")
            version = _write_version(target.fd, files)
        except BaseException as e:
            target.abandon()
            _reraise(e, final)
        bar.update()
        _finish(target, version, files[MANIFEST])
        bar.update()
    finally:
        bar.close()
    return final


def _target(final: Path) -> Target:
    try:
        return Target(final)
    except OSError as e:
        _reraise(e, final)


def _reraise(e: BaseException, final: Path):
    """``e`` again; an ``OSError`` (a permission refused midway) as an ``ArtifactError``."""
    if isinstance(e, OSError):
        raise ArtifactError(f"{final}: cannot save the artifact ({e})") from e
    raise e


def _serialize(engine) -> dict[str, bytes]:
    """File name (``kernels/x.py`` for a kernel) -> content; ``manifest.json`` last."""
    from safetensors.torch import save as safetensors_bytes
    from rewriter.ir.serialize import graph_to_data
    stored, names = _unique_weights(engine.ir.weights())
    ir_data = {"graph": graph_to_data(engine.ir.gm), "weights": names,
               "info": {**engine.ir.info, "passes": engine.pass_specs}}
    problem = non_finite(stored)  # load refuses it: an artifact that cannot load is not written
    if problem:
        raise ArtifactError(f"cannot save the model: its {problem}")
    files = {IR_FILE: _json_bytes(ir_data), WEIGHTS_FILE: safetensors_bytes(stored)}
    tokenizer = _tokenizer_json(engine.tokenizer)
    if tokenizer is not None:
        files[TOKENIZER_FILE] = tokenizer.encode()
        files[TEXT_FILE] = _json_bytes(engine.text.to_json())
    for name, source in sorted(engine.kernel_sources().items()):
        if "/" not in name:  # templates/ are the package's own modules, not generated code
            if not KERNEL_NAME.fullmatch(name):  # what load accepts: a module name
                raise ArtifactError(f"cannot store a kernel named {name!r}")
            files[f"{KERNELS_DIR}/{name}"] = source.encode()
    entries = {name: {"bytes": len(data), "sha256": _sha256_bytes(data)}
               for name, data in sorted(files.items())}
    files[MANIFEST] = _json_bytes(_manifest(engine, entries, tokenizer is not None))
    return files


def _write_version(dir_fd: int, files: dict[str, bytes]) -> str:
    """A new version directory in ``dir_fd`` holding ``files``; its name."""
    name = f"v-{secrets.token_hex(8)}"
    os.mkdir(name, dir_fd=dir_fd)
    try:
        _step("created the version directory")
        vfd = safe_files.open_dir(name, dir_fd)
        try:
            for rel, data in files.items():
                *subdirs, base = rel.split("/")
                fd = safe_files.make_dirs(subdirs, vfd)
                try:
                    safe_files.create_file(base, data, fd)
                finally:
                    os.close(fd)
                _step(f"wrote {rel}")
            safe_files.fsync_dir(vfd)
        finally:
            os.close(vfd)
    except BaseException:
        safe_files.remove_tree(name, dir_fd)
        raise
    return name


def _finish(target: Target, version: str, manifest: bytes) -> None:
    """Point DIR at ``version`` (the commit), then delete the old version."""
    pointer = {"format": FORMAT, "format_version": FORMAT_VERSION, "version_dir": version,
               "manifest_sha256": _sha256_bytes(manifest)}
    try:
        safe_files.replace_file(POINTER, _json_bytes(pointer), target.fd,
                                before_rename=lambda: _step("wrote the new pointer"))
    except BaseException as e:
        if target.points_to(version):  # raised after the rename, the commit: keep it
            target.close()  # the old version is a leftover now, for the next save
            _reraise(e, target.path)
        try:
            safe_files.remove_tree(version, target.fd)
        finally:
            target.abandon()
        _reraise(e, target.path)
    try:
        safe_files.fsync_dir(target.fd)
        _step("swapped the pointer")
        try:
            target.remove_old(keep=version)
        except OSError:
            pass  # the new artifact is in place; the next save deletes what is left
        _step("removed the old version")
    except BaseException as e:
        _reraise(e, target.path)
    finally:
        target.close()


def _step(name: str) -> None:
    for hook in SAVE_STEP_HOOKS:
        hook(name)


def _manifest(engine, files: dict, has_tokenizer: bool) -> dict:
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


# ---------------------------------------------------------------------------- load

@dataclass
class Stored:
    """What an artifact holds, checked: what ``runtime.engine.load`` builds an Engine from."""
    directory: Path  # the version directory
    ir: object  # rewriter.ir.core.IR
    tokenizer: object
    passes: list
    backend: str
    text: object  # runtime.chat.TextConfig or None
    kernels: dict  # stored kernel sources: run only when the loader trusts them


def read(directory, backend: Optional[str] = None) -> Stored:
    """The checked contents of the artifact in ``directory``; every file is checked first.
    ``backend`` overrides the one it was saved with (e.g. ``"torch"`` for a Triton artifact
    on a CPU)."""
    from .artifact_ir import Paths, ir_from_data
    d, manifest = _checked_manifest(Path(directory).expanduser())  # d: the version directory
    for name, entry in manifest["files"].items():
        _check_file(d, name, entry)
    for name in (IR_FILE, WEIGHTS_FILE):
        if name not in manifest["files"]:
            raise ArtifactError(f"{d / MANIFEST}: lists no {name}")
    ir_data = _read_json(d / IR_FILE)
    weights = _read_weights(d / WEIGHTS_FILE)
    ir = ir_from_data(ir_data, weights, manifest, Paths(d / IR_FILE, d / MANIFEST, d / WEIGHTS_FILE))
    tokenizer = _listed_tokenizer(d, manifest)
    text = _read_text_config(d / TEXT_FILE) if TEXT_FILE in manifest["files"] else None
    backend = backend or manifest["backend"]
    stored_kernels = {n.split("/", 1)[1].removesuffix(".py"): _read_text(d / n)
                      for n in manifest["files"] if n.startswith(KERNELS_DIR + "/")}
    if backend == "triton":
        from .triton_backend import available
        reason = available(next(iter(weights.values())).device if weights else torch.device("cpu"))
        if reason is not None:
            raise ArtifactError(f"{d}: saved for {reason}; load(..., backend='torch') runs it anyway")
    elif backend != "torch":
        raise ArtifactError(f"{d / MANIFEST}: unknown backend {backend!r}")
    return Stored(d, ir, tokenizer, manifest["passes"], backend, text, stored_kernels)


def _listed_tokenizer(d: Path, manifest: dict):
    """The tokenizer, or None; the manifest's ``tokenizer`` field and its file list agree.
    An artifact saved without one loads, and its messages say so where text is needed."""
    named, files, where = manifest["tokenizer"], manifest["files"], d / MANIFEST
    if named not in (None, TOKENIZER_FILE):
        raise ArtifactError(f"{where}: tokenizer must be the listed {TOKENIZER_FILE} or null, "
                            f"got {_short(named)}")
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
    return _read_tokenizer(d / TOKENIZER_FILE) if listed else None


def read_manifest(directory) -> dict:
    """The manifest of an artifact, checked against the pointer's checksum and for its
    fields; each listed file is checked to exist with its recorded size (not hashed)."""
    d, manifest = _checked_manifest(Path(directory).expanduser())
    for name, entry in manifest["files"].items():
        _check_file(d, name, entry, hash=False)
    return manifest


def _checked_manifest(root: Path) -> tuple[Path, dict]:
    """(the version directory, its manifest), after checking the pointer, the manifest's
    checksum against the pointer, and the manifest's fields."""
    pointer = _read_pointer(root)
    d = root / pointer["version_dir"]
    if _kind(d) != "dir":
        raise ArtifactError(f"{d}: missing or not a directory (named by {root / POINTER})")
    path = d / MANIFEST
    data = _read_bytes(path)
    digest = _sha256_bytes(data)
    if digest != pointer["manifest_sha256"]:
        raise ArtifactError(f"{path}: changed since it was saved (checksum {digest[:16]}…, "
                            f"{POINTER} recorded {pointer['manifest_sha256'][:16]}…)")
    manifest = _parse_json(path, data)
    _check_format(path, manifest)
    _check_fields(path, manifest)
    return d, manifest


def _read_pointer(root: Path) -> dict:
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such artifact directory")
    path = root / POINTER
    if _kind(path) is None:
        if is_artifact(root):  # a format-1 one, then
            raise ArtifactError(f"{root}: an artifact of format 1 (an older rewriter); this "
                                f"rewriter reads format {FORMAT_VERSION}: save the model again "
                                f"(rewriter optimize --out {root})")
        raise ArtifactError(f"{path}: missing (not an artifact, or a save that never finished)")
    pointer = _parse_json(path, _read_bytes(path))
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
            raise ArtifactError(f"{path}: {key!r} must be {what}, got {_short(m[key])}")
    # optional: artifacts saved before it was recorded have none
    if m.get("measured_on") is not None and not measured_on_ok(m["measured_on"]):
        raise ArtifactError(f"{path}: 'measured_on' must be null or an object {{backend, device, "
                            f"machine, passes}} of strings, got {_short(m['measured_on'])}")


def _check_file(d: Path, name: str, entry: dict, hash: bool = True) -> None:
    parts = name.split("/")
    top = len(parts) == 1 and name in TOP_FILES - {MANIFEST}
    kernel = len(parts) == 2 and parts[0] == KERNELS_DIR and KERNEL_NAME.fullmatch(parts[1])
    if not (top or kernel):  # only the format's files: no evil.sh, no kernels/x
        raise ArtifactError(f"{d / MANIFEST}: lists {name!r:.80}, which is not a file of the "
                            f"format ({', '.join(sorted(TOP_FILES - {MANIFEST}))}, "
                            f"{KERNELS_DIR}/<module>.py)")
    path = d / name
    if len(parts) == 2 and _kind(d / parts[0]) not in (None, "dir"):
        raise ArtifactError(f"{d / parts[0]}: not a directory (a link or a file)")
    kind = _kind(path)
    if kind is None:
        raise ArtifactError(f"{path}: missing")
    if kind != "file":
        raise ArtifactError(f"{path}: is a {'symbolic link' if kind == 'link' else kind}, "
                            f"not a regular file")
    size = _stat(path).st_size
    if size != entry["bytes"]:
        raise ArtifactError(f"{path}: {size} bytes, the manifest says {entry['bytes']} "
                            f"(truncated or changed)")
    if hash and _sha256_bytes(_read_bytes(path)) != entry["sha256"]:
        raise ArtifactError(f"{path}: checksum mismatch (the file was changed or corrupted)")


def _kind(path: Path) -> Optional[str]:
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


def _read_bytes(path: Path) -> bytes:
    """A regular file's bytes (a symlink is refused); any failure names the file."""
    try:
        return safe_files.read_file(os.fspath(path))
    except OSError as e:
        raise ArtifactError(f"{path}: unreadable ({e.strerror or e})") from e


def _read_text(path: Path) -> str:
    try:
        return _read_bytes(path).decode()
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 text ({e})") from e


def _parse_json(path: Path, data: bytes) -> dict:
    try:
        value = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON, huge ints
        raise ArtifactError(f"{path}: unreadable JSON ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(value, dict):
        raise ArtifactError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_json(path: Path) -> dict:
    return _parse_json(path, _read_bytes(path))


def _read_weights(path: Path) -> dict:
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


def _read_tokenizer(path: Path):
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:
        raise ArtifactError(f"{path}: unreadable tokenizer ({e})") from e


def _read_text_config(path: Path):
    """The chat template and special tokens (``runtime.chat.TextConfig``); the template is
    data: it is rendered in Jinja's sandbox, never run as Python."""
    from .chat import TextConfig
    try:
        return TextConfig.from_json(_read_json(path), str(path))
    except ValueError as e:
        raise ArtifactError(str(e)) from e


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


def _json_bytes(data) -> bytes:
    return json.dumps(data, indent=1, default=_json_default).encode()


def _json_default(x):
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    raise TypeError(f"cannot store {type(x).__name__} {x!r} in JSON")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version(package: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _bar(enabled: bool, total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="save", unit="step", disable=not enabled, leave=False)
