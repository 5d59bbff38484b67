"""The directory side of an artifact: which directories are artifacts, how a save claims
one, and what it may delete there.

    DIR/artifact.json      the pointer, written last: format, version, version_dir,
                           manifest_sha256
    DIR/v-<16 hex>/        the files of one save (manifest.json, ir.json, ...)

A directory is an artifact when its pointer parses with the format marker and an integer
version (or, format 1, when a flat ``manifest.json`` carries the marker and version 1).
A save may write into a directory that does not exist, an empty one, an artifact, or one
that holds nothing but the leftovers of interrupted saves; it refuses anything else
before changing anything. Inside a claimed directory a save deletes only entries whose
names and shapes are those this module creates: version directories (the pointer's old
one included) holding only regular files of the format's names and a real ``kernels``
directory of regular ``*.py`` modules, the pointer's temporary files, and a format-1
artifact's listed files when they are regular files (kernels inside a real ``kernels``
directory, opened without following a link). A link is never followed, nor deleted.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import stat
from pathlib import Path
from typing import Optional

from rewriter.files import safe_files
from rewriter.errors import ArtifactError

FORMAT = "rewriter-artifact"
POINTER, MANIFEST = "artifact.json", "manifest.json"
IR_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TEXT_FILE, KERNELS_DIR = (
    "ir.json", "weights.safetensors", "tokenizer.json", "tokenizer_config.json", "kernels")
VERSION_DIR = re.compile(r"v-[0-9a-f]{16}")
FILE_NAMES = {MANIFEST, IR_FILE, WEIGHTS_FILE, TOKENIZER_FILE, TEXT_FILE, KERNELS_DIR}
TOP_FILES = FILE_NAMES - {KERNELS_DIR}  # the regular files at a version directory's top
KERNEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.py")  # a kernel: an importable module
# Hidden siblings the format-1 save left behind: tempfile.mkdtemp's 8 characters, or a pid.
_OLD_SIBLING = r"\.{name}\.(saving-[a-z0-9_]{{8}}|old-[0-9]+)"


def is_artifact(path) -> bool:
    """Whether ``path`` is a rewriter artifact directory, judged by content: a pointer with
    the format marker and an integer version, or a format-1 manifest. Never raises."""
    try:  # the path itself may be a link (``current -> artifacts/v3``); loading follows it
        fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    except (OSError, ValueError):
        return False
    try:
        return marker_version(POINTER, fd) is not None or marker_version(MANIFEST, fd) == 1
    finally:
        os.close(fd)


def marker_version(name: str, dir_fd: int) -> Optional[int]:
    """The ``format_version`` of JSON file ``name`` when it carries the format marker."""
    try:
        data = json.loads(safe_files.read_file(name, dir_fd))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    version = data.get("format_version")
    return version if type(version) is int else None


# ---------------------------------------------------------------------------- claiming

class Target:
    """An artifact directory opened for a save: created if missing, checked, locked.

    ``old`` is the version directory the current pointer names (``None`` without one).
    ``abandon()`` undoes what the save created when it fails before the pointer swap.
    """

    def __init__(self, path: Path):
        self.path = path
        self.created: list[Path] = []  # directories this save made, outermost first
        self.fd = _open_target(path, self.created)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)  # a second save waits: it would delete ours
            self.old = _claim(path, self.fd)
        except BaseException:
            self.abandon()
            raise

    def remove_leftovers(self) -> None:
        """Delete what interrupted saves left here (and the old layout's hidden siblings)."""
        for name in os.listdir(self.fd):
            if name != self.old and _is_our_version_dir(name, self.fd):
                safe_files.remove_tree(name, self.fd)
            elif _is_pointer_temp(name, self.fd):
                os.unlink(name, dir_fd=self.fd)
        _remove_old_siblings(self.path)

    def points_to(self, version: str) -> bool:
        """Whether the pointer names ``version`` (the rename that commits a save is done)."""
        return marker_version(POINTER, self.fd) is not None and _pointed_version(self.fd) == version

    def remove_old(self, keep: str) -> None:
        """After the pointer names ``keep``: delete the previous version and format-1 files."""
        if self.old is not None and self.old != keep and _is_our_version_dir(self.old, self.fd):
            safe_files.remove_tree(self.old, self.fd)
        _remove_format1(self.fd)

    def abandon(self) -> None:
        """Remove the directories this save created, if nothing else is in them."""
        os.close(self.fd)
        for d in reversed(self.created):
            try:
                d.rmdir()
            except OSError:
                break

    def close(self) -> None:
        os.close(self.fd)  # releases the lock


def _open_target(path: Path, created: list[Path]) -> int:
    """A descriptor of directory ``path``, created (with its parents) when missing; every
    reason not to save there is an ``ArtifactError`` raised before anything is written."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise ArtifactError(f"{path}: part of this path is a file, not a directory; "
                            f"cannot save an artifact there") from None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot save an artifact there ({e.strerror})") from e
    if st is None:
        _make_parents(path, created)
    elif stat.S_ISLNK(st.st_mode):
        raise ArtifactError(f"{path}: is a symbolic link; not saving through it "
                            f"(save to the directory it points to)")
    elif not stat.S_ISDIR(st.st_mode):
        raise ArtifactError(f"{path}: is a file, not a directory; not overwriting it")
    elif not os.access(path, os.W_OK | os.X_OK):
        raise ArtifactError(f"{path}: directory is not writable; cannot save an artifact there")
    try:
        return safe_files.open_dir(os.fspath(path))
    except OSError as e:
        raise ArtifactError(f"{path}: cannot open the directory ({e.strerror})") from e


def _make_parents(path: Path, created: list[Path]) -> None:
    """Create ``path`` and its missing parents, after checking the nearest existing one is
    a writable directory."""
    missing = [path]
    for parent in path.parents:
        try:
            st = os.stat(parent)
        except (FileNotFoundError, NotADirectoryError):
            missing.append(parent)
            continue
        except OSError as e:
            raise ArtifactError(f"{parent}: cannot save {path} under it ({e.strerror})") from e
        if not stat.S_ISDIR(st.st_mode):
            raise ArtifactError(f"{parent}: is a file, not a directory; cannot save {path} under it")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ArtifactError(f"{parent}: directory is not writable; cannot create {path}")
        break
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue  # made meanwhile by someone else: opened (and checked) like any other
        except OSError as e:
            raise ArtifactError(f"{d}: cannot create the directory ({e.strerror})") from e
        created.append(d)


def _claim(path: Path, fd: int) -> Optional[str]:
    """Check the locked directory may be saved into; the version directory it points to."""
    kind = safe_files.entry_type(POINTER, fd)
    if kind not in (None, "file"):
        what = {"link": "a symbolic link", "dir": "a directory"}.get(kind, "not a regular file")
        raise ArtifactError(f"{path / POINTER}: is {what}, not the artifact's pointer file; "
                            f"not saving here")
    names = os.listdir(fd)
    if marker_version(POINTER, fd) is not None:
        return _pointed_version(fd)
    if marker_version(MANIFEST, fd) == 1 or all(_is_leftover(n, fd) for n in names):
        return None
    raise ArtifactError(f"{path}: exists, is not empty and is not a rewriter artifact "
                        f"(no {POINTER} with the artifact format marker); not overwriting it")


def _pointed_version(fd: int) -> Optional[str]:
    try:
        name = json.loads(safe_files.read_file(POINTER, fd)).get("version_dir")
    except (OSError, ValueError, RecursionError):
        return None
    return name if isinstance(name, str) and VERSION_DIR.fullmatch(name) else None


def _is_leftover(name: str, fd: int) -> bool:
    return _is_our_version_dir(name, fd) or _is_pointer_temp(name, fd)


def _is_our_version_dir(name: str, fd: int) -> bool:
    """A real directory named ``v-<16 hex>`` holding only names a save writes there."""
    if not VERSION_DIR.fullmatch(name) or safe_files.entry_type(name, fd) != "dir":
        return False
    return _holds_only_artifact_files(name, fd)


def _holds_only_artifact_files(name: str, fd: int) -> bool:
    """Whether directory ``name`` holds only what a save writes into a version directory:
    regular files with the format's names (or their temporary names), and a real
    ``kernels`` directory of regular ``*.py`` modules. Names alone are not enough: a user's
    ``kernels/thesis.tex`` or ``ir.json/data`` must never be taken for a leftover."""
    return _holds_only(name, fd, _is_version_entry)


def _is_version_entry(name: str, fd: int) -> bool:
    if name == KERNELS_DIR:
        return (safe_files.entry_type(name, fd) == "dir"
                and _holds_only(name, fd, _is_kernel_entry))
    ours = name in TOP_FILES or _temp_of(name) in TOP_FILES
    return ours and safe_files.entry_type(name, fd) == "file"


def _is_kernel_entry(name: str, fd: int) -> bool:
    ours = KERNEL_NAME.fullmatch(name) or KERNEL_NAME.fullmatch(_temp_of(name) or "")
    return bool(ours) and safe_files.entry_type(name, fd) == "file"


def _holds_only(name: str, fd: int, is_ours) -> bool:
    """Whether every entry of directory ``name`` (a link is refused) passes ``is_ours``."""
    try:
        sub = safe_files.open_dir(name, fd)
    except OSError:
        return False
    try:
        return all(is_ours(n, sub) for n in os.listdir(sub))
    except OSError:
        return False
    finally:
        os.close(sub)


def _is_pointer_temp(name: str, fd: int) -> bool:
    return _temp_of(name) == POINTER and safe_files.entry_type(name, fd) == "file"


def _temp_of(name: str) -> Optional[str]:
    m = safe_files.TEMP_NAME.fullmatch(name)
    return m["name"] if m else None


def _remove_format1(fd: int) -> None:
    """Delete a format-1 artifact's files: those its manifest lists, then the manifest
    (last, so that an interrupted clean-up is finished by the next save). Only regular
    files are deleted, and kernels only inside a real ``kernels`` directory opened without
    following a link: a manifest listing ``kernels/id_rsa`` beside ``kernels -> ~/.ssh``
    must not reach ~/.ssh."""
    if marker_version(MANIFEST, fd) != 1:
        return
    try:
        files = json.loads(safe_files.read_file(MANIFEST, fd)).get("files")
    except (OSError, ValueError, RecursionError):
        return
    kernels = []
    for name in files if isinstance(files, dict) else ():
        parts = name.split("/") if isinstance(name, str) else []
        if len(parts) == 1 and parts[0] in TOP_FILES - {MANIFEST}:
            _unlink_file(parts[0], fd)
        elif len(parts) == 2 and parts[0] == KERNELS_DIR and KERNEL_NAME.fullmatch(parts[1]):
            kernels.append(parts[1])
    _remove_kernels(kernels, fd)
    _unlink_file(MANIFEST, fd)


def _remove_kernels(names: list[str], fd: int) -> None:
    try:
        kfd = safe_files.open_dir(KERNELS_DIR, fd)
    except OSError:
        return  # absent, a link (not followed) or a file: not ours
    try:
        for name in names:
            _unlink_file(name, kfd)
    finally:
        os.close(kfd)
    try:
        os.rmdir(KERNELS_DIR, dir_fd=fd)
    except OSError:
        pass  # holds something that is not ours


def _remove_old_siblings(path: Path) -> None:
    """The format-1 save's hidden ``.NAME.saving-*`` / ``.NAME.old-*`` directories beside
    ``path``, when they hold nothing but artifact files. Best effort."""
    pattern = re.compile(_OLD_SIBLING.format(name=re.escape(path.name)))
    try:
        pfd = safe_files.open_dir(os.fspath(path.parent))
    except OSError:
        return
    try:
        for name in os.listdir(pfd):
            if (pattern.fullmatch(name) and safe_files.entry_type(name, pfd) == "dir"
                    and _holds_only_artifact_files(name, pfd)):
                try:
                    safe_files.remove_tree(name, pfd)
                except OSError:
                    pass
    finally:
        os.close(pfd)


def _unlink_file(name: str, fd: int) -> None:
    """Delete ``name`` in ``fd`` if it is a regular file (a link or a directory is the
    user's, not a file a save wrote). ``name`` is one component: no link is followed."""
    try:
        if safe_files.entry_type(name, fd) == "file":
            os.unlink(name, dir_fd=fd)
    except OSError:
        pass  # gone already, or not ours to remove: left for the user
