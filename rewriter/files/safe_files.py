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

For files named by a path (the training commands' outputs, caches and checkpoints):
``replace_path`` is ``replace_file`` in the path's directory, its errors naming the path;
``check_new_file`` refuses an output path before any work is done (``check_parent``: one
whose directory cannot be written in or made); ``new_dirs`` creates a
directory and removes it again if what runs inside fails before writing anything there.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional, Union

from rewriter.values import path_problem

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


# What a file is made of: its bytes, or a function that writes them to the open file (to
# stream gigabytes without a second copy in memory).
Data = Union[bytes, Callable[[BinaryIO], None]]


def create_file(name: str, data: Data, dir_fd: int, mode: int = 0o666) -> None:
    """Create ``name`` in ``dir_fd`` and write ``data`` (to disk: fsync). Raises
    ``FileExistsError`` when anything is at ``name``; a partly written file is removed."""
    fd = os.open(name, _CREATE, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(name, dir_fd)
        raise


def temp_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(4)}.tmp"


def replace_file(name: str, data: Data, dir_fd: int, mode: int = 0o666,
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


def replace_path(path: Union[str, os.PathLike], data: Data) -> None:
    """Put ``data`` at ``path`` atomically (``replace_file`` in its directory, which may be
    reached through links the user made; the file itself never is). An ``OSError`` names
    ``path``: a full disk is "PATH: No space left on device", and leaves the old file."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    try:
        fd = _open_folder(folder)
        try:
            replace_file(name, data, fd)
            fsync_dir(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno is None or e.filename is not None:  # our own message, or a path already
            raise
        raise type(e)(e.errno, e.strerror, path) from e


def remove_temp_files(folder: Union[str, os.PathLike]) -> None:
    """Delete the temporary files ``replace_file`` left in ``folder`` when a process was
    killed while writing (``TEMP_NAME``: a caller's own directory has no other such names)."""
    fd = _open_folder(folder)
    try:
        for name in os.listdir(fd):
            if TEMP_NAME.fullmatch(name) and entry_type(name, fd) == "file":
                _unlink_quietly(name, fd)
    finally:
        os.close(fd)


def _open_folder(folder) -> int:
    """A descriptor of directory ``folder`` (``""``: the current one), reached through any
    links in it: a directory the user named, not a name inside one."""
    return os.open(os.fspath(folder) or ".", os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)


def check_new_file(path, who: str, kind: str, ours: Callable[[Path], bool],
                   make_parents: bool = False) -> Path:
    """``path`` as a ``Path`` if a ``kind`` may be written there, else a ``ValueError``
    naming ``who`` (a parameter) and the problem, before any work is done: an empty
    name, a directory, a link, a special file (``/dev/null``: a rename would replace the
    device), a file ``ours`` does not recognise (it would be lost), a parent directory
    that is missing (unless ``make_parents``), a file, or closed to us."""
    if path_problem(path) is not None:
        raise ValueError(f"{who} must name a {kind}, got {path!r}")
    target = Path(path).absolute()
    try:
        found = entry_type(str(target))
    except OSError:  # a file in the path (ENOTDIR): the parent's check below names it
        found = None
    if found == "link":
        raise ValueError(f"{who} {path} is a symbolic link: name the {kind} itself")
    if found == "dir":
        where = "" if make_parents else " in an existing directory"
        raise ValueError(f"{who} {path} is a directory: it must name a {kind}{where}")
    if found == "other":
        raise ValueError(f"{who} {path} is not a regular file")
    if found == "file" and not ours(target):
        raise ValueError(f"{who} {path} exists and is not a {kind}: it would be overwritten "
                         f"(remove it or name another path)")
    check_parent(who, path, make_parents)
    return Path(path)


def check_parent(who: str, path: Union[str, os.PathLike], make_parents: bool = False) -> None:
    """A ``ValueError`` naming ``who`` and ``path`` unless something can be made at
    ``path``: its parent (with ``make_parents``, its nearest existing ancestor, below which
    the rest is made) is a directory we may write in."""
    parent = Path(path).absolute().parent
    while make_parents and not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        what = "a file, not a directory" if parent.exists() else "not an existing directory"
        raise ValueError(f"{who} {path}: {parent} is {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{who} {path}: cannot write in {parent} (permission denied)")


@contextlib.contextmanager
def new_dirs(path: Path) -> Iterator[Path]:
    """``path`` made a directory (with its missing parents) for the block; if the block
    raises, the directories this made are removed again when they are still empty."""
    made = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        made.append(p)
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        for p in made:  # the deepest first
            try:
                p.rmdir()
            except OSError:
                break  # something was written there (resumable progress): kept
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
