"""The file layer under the journal, small enough to fake.

Tests swap ``OsFS`` for a crash-simulating layer (like SQLite's crash-test VFS or RocksDB's
FaultInjectionTestFS) that keeps, drops or garbles every write not yet fsynced.
"""

from __future__ import annotations

import os
from typing import Protocol


class WritableFile(Protocol):
    def write(self, data: bytes) -> None: ...
    def fsync(self) -> None: ...
    def tell(self) -> int: ...
    def close(self) -> None: ...


class FileSystem(Protocol):
    def listdir(self, directory: str) -> list[str]: ...
    def read(self, path: str) -> bytes: ...
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


class OsFS:
    """The real thing: plain POSIX calls, one ``write`` per record."""

    def listdir(self, directory: str) -> list[str]:
        return os.listdir(directory)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def create(self, path: str) -> WritableFile:
        return _OsFile(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 0)

    def open_append(self, path: str) -> WritableFile:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        return _OsFile(fd, os.fstat(fd).st_size)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        os.remove(path)

    def truncate(self, path: str, size: int) -> None:
        os.truncate(path, size)

    def fsync_dir(self, directory: str) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def makedirs(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)


OS_FS = OsFS()
