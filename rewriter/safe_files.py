"""Writing files only where they are meant to go: inside one directory, never through a link.

Every function works relative to a directory file descriptor. A directory opened with
``open_dir`` stays the same directory however its path changes later, and names inside
it are resolved without following symbolic links:

- ``create_file`` makes a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``): if anything is
  already at that name, a planted symlink included, it fails instead of writing through it.
- ``replace_file`` writes a new file under a random temporary name and renames it onto
  the final name. A rename replaces a symlink at the final name instead of following it,
  and a reader sees the old content or the new, never half of it.
- ``read_file`` reads a regular file and refuses a symlink.
- ``open_dir`` / ``make_dirs`` open (and create) subdirectories, refusing symlinks.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from typing import Callable, Optional

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC

# The temporary names ``replace_file`` uses: ``.<name>.<8 hex>.tmp``.
TEMP_NAME = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{8}\.tmp")


def is_plain_name(name: str) -> bool:
    """A single path component that names an entry inside a directory (not ``..``)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def open_dir(name: str, dir_fd: Optional[int] = None) -> int:
    """A descriptor of directory ``name`` (inside ``dir_fd``, when given). A symlink or a
    non-directory at ``name`` raises ``OSError`` (ELOOP / ENOTDIR)."""
    return os.open(name, _OPEN_DIR, dir_fd=dir_fd)


def make_dirs(parts: list[str], dir_fd: int, mode: int = 0o777) -> int:
    """A descriptor of ``dir_fd/parts[0]/parts[1]/...``, creating what is missing; each
    part must be a plain name and an existing part must be a real directory."""
    fd = os.dup(dir_fd)
    for part in parts:
        if not is_plain_name(part):
            os.close(fd)
            raise ValueError(f"{part!r} is not a plain file name")
        try:
            try:
                os.mkdir(part, mode, dir_fd=fd)
            except FileExistsError:
                pass  # opened below, which refuses a symlink or a file
            sub = open_dir(part, fd)
        finally:
            os.close(fd)
        fd = sub
    return fd


def create_file(name: str, data: bytes, dir_fd: int, mode: int = 0o666) -> None:
    """Create ``name`` in ``dir_fd`` and write ``data`` (to disk: fsync). Raises
    ``FileExistsError`` when anything is at ``name``; a partly written file is removed."""
    fd = os.open(name, _CREATE, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(name, dir_fd)
        raise


def temp_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(4)}.tmp"


def replace_file(name: str, data: bytes, dir_fd: int, mode: int = 0o666,
                 before_rename: Optional[Callable[[], None]] = None) -> None:
    """Put ``data`` at ``name`` atomically: written to a new temporary file in the same
    directory, then renamed onto ``name`` (which replaces a symlink, never follows it).
    ``before_rename`` runs between the two (a test hook). Once renamed, ``name`` holds
    ``data`` even if this call then raises (a ``KeyboardInterrupt``): callers that must
    know whether the rename happened read ``name`` back."""
    tmp = temp_name(name)
    create_file(tmp, data, dir_fd, mode)
    try:
        if before_rename is not None:
            before_rename()
    except BaseException:
        _unlink_quietly(tmp, dir_fd)
        raise
    # The rename is the commit: nothing after it may undo it. An error from os.replace
    # means no rename; an interrupt landing after the rename (still inside this call)
    # finds no temporary file. A temporary file an interrupt leaves before the rename is
    # named like one (TEMP_NAME), for the caller's next clean-up.
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        _unlink_quietly(tmp, dir_fd)
        raise


def read_file(name: str, dir_fd: Optional[int] = None) -> bytes:
    """The bytes of regular file ``name``; a symlink raises ``OSError`` (ELOOP) and any
    other non-regular file ``IsADirectoryError`` / ``OSError``."""
    fd = os.open(name, _READ, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{name}: not a regular file")
        return f.read()


def entry_type(name: str, dir_fd: Optional[int] = None) -> Optional[str]:
    """``"dir"``, ``"file"``, ``"link"``, ``"other"`` for what is at ``name`` (not
    following a link), or ``None`` when nothing is."""
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "link"
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def remove_tree(name: str, dir_fd: int) -> None:
    """Delete directory ``name`` in ``dir_fd`` and everything in it, following no link
    (``shutil.rmtree`` with a ``dir_fd`` deletes links, never their targets)."""
    shutil.rmtree(name, dir_fd=dir_fd)


def fsync_dir(dir_fd: int) -> None:
    """Make the directory's entries (a rename) durable; some filesystems refuse, harmlessly."""
    try:
        os.fsync(dir_fd)
    except OSError:
        pass


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
