"""The file layer under the journal, small enough to fake.

Tests swap ``OsFS`` for a crash-simulating layer (like SQLite's crash-test VFS or RocksDB's
FaultInjectionTestFS) that keeps, drops or garbles every write not yet fsynced.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Protocol


class WritableFile(Protocol):
    def write(self, data: bytes) -> None: ...
    def fsync(self) -> None: ...
    def tell(self) -> int: ...
    def close(self) -> None: ...


class FileSystem(Protocol):
    def listdir(self, directory: str) -> list[str]: ...
    def read(self, path: str, limit: int = -1) -> bytes: ...
    def create(self, path: str) -> WritableFile: ...
    def open_append(self, path: str) -> WritableFile: ...
    def rename(self, src: str, dst: str) -> None: ...
    def remove(self, path: str) -> None: ...
    def truncate(self, path: str, size: int) -> None: ...
    def fsync_dir(self, directory: str) -> None: ...
    def makedirs(self, directory: str) -> None: ...


class _OsFile:
    __slots__ = ("_fd", "_pos")

    def __init__(self, fd: int, pos: int) -> None:
        self._fd = fd
        self._pos = pos

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
            self._pos += n

    def fsync(self) -> None:
        os.fsync(self._fd)

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        os.close(self._fd)


FILE_MODE = 0o600
DIR_MODE = 0o700
"""Journal segments, snapshots and the host arena are user data: owner-only, whatever the
umask, and never opened through a symlink (``O_NOFOLLOW``)."""


def open_private(path: str, flags: int) -> int:
    """``os.open`` that refuses a symlink and anything but a regular file, and leaves a
    created file 0600 regardless of umask. The open itself does not block (``O_NONBLOCK``,
    cleared once the file is known to be regular): a FIFO under a segment's name would
    otherwise hang every reader in ``open(2)`` until some writer appeared (an outside
    review's repro); it is refused like a directory, as an ``OSError`` naming the path. A
    regular file under a kernel lease answers a non-blocking open with EWOULDBLOCK: it is
    opened again, blocking, as before."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, FILE_MODE)
    except BlockingIOError:  # a regular file under a kernel lease (F_SETLEASE, an SMB oplock)
        if not stat.S_ISREG(os.lstat(path).st_mode):  # answers EWOULDBLOCK without O_NONBLOCK
            raise                                    # it waits for the holder, as it always did
        fd = os.open(path, flags, FILE_MODE)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise OSError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket)", path)
        os.set_blocking(fd, True)
        if flags & os.O_CREAT:
            os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def cannot_read(path: str, exc: OSError) -> str:
    """One line for a journal file that could not be read: the path, the OS's reason, and
    for a symlink (``O_NOFOLLOW``'s ``ELOOP``) that journal files are never opened through
    one."""
    why = f"cannot read {exc.filename or path}: {exc.strerror or exc}"
    if exc.errno == errno.ELOOP:
        why += " (journal files are never opened through a symlink)"
    return why


def secure_makedirs(directory: str) -> None:
    """Create ``directory`` (and missing parents) 0700 regardless of umask; an existing
    directory keeps its mode (it is the caller's)."""
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(os.path.abspath(directory))
    if parent != directory:
        secure_makedirs(parent)
    try:
        os.mkdir(directory, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise
        return
    os.chmod(directory, DIR_MODE)
    fsync_dir(parent)  # the new entry survives a power loss before anything relies on it


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(fs: FileSystem, path: str, data: bytes) -> None:
    """Make ``path`` hold ``data`` atomically and durably: written to ``<path>.tmp``, fsynced
    (its descriptor closed on every path), renamed over ``path``, the directory fsynced."""
    tmp = path + ".tmp"
    f = fs.create(tmp)
    try:
        f.write(data)
        f.fsync()
    finally:
        f.close()
    fs.rename(tmp, path)
    fs.fsync_dir(os.path.dirname(path))


class OsFS:
    """The real thing: plain POSIX calls, one ``write`` per record."""

    def listdir(self, directory: str) -> list[str]:
        return os.listdir(directory)

    def read(self, path: str, limit: int = -1) -> bytes:
        """The file's bytes; with ``limit`` >= 0 at most that many from its start."""
        fd = open_private(path, os.O_RDONLY)
        try:  # fdopen refuses a directory without closing the descriptor: closed here
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read(limit)
        except OSError as exc:  # its error names the descriptor: say which file
            raise OSError(exc.errno, exc.strerror, path) from None
        finally:
            os.close(fd)

    def create(self, path: str) -> WritableFile:
        return _OsFile(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 0)

    def open_append(self, path: str) -> WritableFile:
        fd = open_private(path, os.O_WRONLY | os.O_APPEND)
        return _OsFile(fd, os.fstat(fd).st_size)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        os.remove(path)

    def truncate(self, path: str, size: int) -> None:
        os.truncate(path, size)

    def fsync_dir(self, directory: str) -> None:
        fsync_dir(directory)

    def makedirs(self, directory: str) -> None:
        secure_makedirs(directory)


OS_FS = OsFS()
