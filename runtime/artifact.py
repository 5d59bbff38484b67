'''Ahead-of-time artifacts: a directory that loads without the model's Python code.

    DIR/artifact.json          the pointer, written last: {"format": "rewriter-artifact",
                               "format_version": 2, "version_dir": "v-<16 hex>",
                               "manifest_sha256": sha256 of that version's manifest.json}
    DIR/v-<16 hex>/
        manifest.json          versions, model config, passes, where their timings were
                               taken (measured_on), bytes and sha256 of each file
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

Where each part lives: the directory side (which directories are artifacts, what a save
may delete) in ``artifact_dir``; the files a save writes, made in memory, in
``artifact_serialize``; the pointer's and the manifest's fields and their checks in
``artifact_manifest``; each file's checks and readers in ``artifact_files``; the IR's
checks in ``artifact_ir``, ``artifact_info`` and ``artifact_agreement``.
'''
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from rewriter.files import safe_files
from rewriter.errors import ArtifactError
from rewriter.runtime.artifact_dir import (
    FORMAT, IR_FILE, KERNELS_DIR, MANIFEST, POINTER, TEXT_FILE, WEIGHTS_FILE, Target)
from rewriter.runtime.artifact_files import (
    check_file, read_json, read_text, read_text_config, read_weights, sha256_bytes)
from rewriter.runtime.artifact_manifest import FORMAT_VERSION, checked_manifest, listed_tokenizer
from rewriter.runtime.artifact_serialize import json_bytes, serialize

__all__ = ["save", "read", "Stored"]

# Test hook: ``save`` calls each function here with the name of every step it finishes, so
# that a test can kill the process (or raise) at each step in turn.
SAVE_STEP_HOOKS: list[Callable[[str], None]] = []


# ---------------------------------------------------------------------------- save

def save(engine, directory, progress: bool = False) -> Path:
    """Write ``engine`` as the artifact at ``directory`` (see the module docstring)."""
    final = Path(directory).expanduser()  # "~/models/x" is the user's, not ./~/models/x
    bar = _bar(progress, 3)
    try:
        files = serialize(engine)  # everything in memory first: errors here change no file
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
               "manifest_sha256": sha256_bytes(manifest)}
    try:
        safe_files.replace_file(POINTER, json_bytes(pointer), target.fd,
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


# ---------------------------------------------------------------------------- load

@dataclass
class Stored:
    """What an artifact holds, checked: what ``runtime.engine_load.load`` builds an Engine from."""
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
    d, manifest = checked_manifest(Path(directory).expanduser())  # d: the version directory
    for name, entry in manifest["files"].items():
        check_file(d, name, entry)
    for name in (IR_FILE, WEIGHTS_FILE):
        if name not in manifest["files"]:
            raise ArtifactError(f"{d / MANIFEST}: lists no {name}")
    ir_data = read_json(d / IR_FILE)
    weights = read_weights(d / WEIGHTS_FILE)
    ir = ir_from_data(ir_data, weights, manifest, Paths(d / IR_FILE, d / MANIFEST, d / WEIGHTS_FILE))
    tokenizer = listed_tokenizer(d, manifest)
    text = read_text_config(d / TEXT_FILE) if TEXT_FILE in manifest["files"] else None
    backend = backend or manifest["backend"]
    stored_kernels = {n.split("/", 1)[1].removesuffix(".py"): read_text(d / n)
                      for n in manifest["files"] if n.startswith(KERNELS_DIR + "/")}
    if backend == "triton":
        from .triton_backend import available
        reason = available(next(iter(weights.values())).device if weights else torch.device("cpu"))
        if reason is not None:
            raise ArtifactError(f"{d}: saved for {reason}; load(..., backend='torch') runs it anyway")
    elif backend != "torch":
        raise ArtifactError(f"{d / MANIFEST}: unknown backend {backend!r}")
    return Stored(d, ir, tokenizer, manifest["passes"], backend, text, stored_kernels)


def _bar(enabled: bool, total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="save", unit="step", disable=not enabled, leave=False)
