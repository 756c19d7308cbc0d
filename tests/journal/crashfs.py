"""A crash-simulating file layer, after SQLite's crash-test VFS and RocksDB's
FaultInjectionTestFS.

Every ``write`` is held as *pending* until the file is fsynced. ``crash(rng)`` returns the
durable image a power loss could leave: each pending write is independently kept, dropped,
torn (a prefix kept) or garbled (some bytes changed). Metadata operations (create, rename,
remove, truncate, fsync_dir) are durable at once: the journal fsyncs the file and directory
around each of them anyway. ``fail_fsync_after`` makes the n-th later fsync raise ``OSError``.
"""

from __future__ import annotations

import posixpath
import random
from dataclasses import dataclass, field


@dataclass
class _Node:
    durable: bytearray = field(default_factory=bytearray)
    pending: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def size(self) -> int:
        end = len(self.durable)
        for off, data in self.pending:
            end = max(end, off + len(data))
        return end

    def view(self) -> bytes:
        buf = bytearray(self.durable)
        for off, data in self.pending:
            _put(buf, off, data)
        return bytes(buf)


def _put(buf: bytearray, off: int, data: bytes) -> None:
    if len(buf) < off:
        buf.extend(b"\0" * (off - len(buf)))
    buf[off:off + len(data)] = data


class _File:
    def __init__(self, fs: CrashFS, path: str) -> None:
        self.fs, self.path = fs, path

    def write(self, data: bytes) -> None:
        node = self.fs.files[self.path]
        node.pending.append((node.size, bytes(data)))
        self.fs.writes += 1

    def fsync(self) -> None:
        self.fs._maybe_fail()
        node = self.fs.files[self.path]
        node.durable = bytearray(node.view())
        node.pending.clear()

    def tell(self) -> int:
        return self.fs.files[self.path].size

    def close(self) -> None:
        pass


class CrashFS:
    def __init__(self) -> None:
        self.files: dict[str, _Node] = {}
        self.dirs: set[str] = set()
        self.writes = 0
        self.fail_fsync_after: int | None = None

    def _maybe_fail(self) -> None:
        if self.fail_fsync_after is not None:
            if self.fail_fsync_after == 0:
                raise OSError(5, "injected EIO on fsync")
            self.fail_fsync_after -= 1

    # FileSystem protocol
    def makedirs(self, directory: str) -> None:
        self.dirs.add(directory)

    def listdir(self, directory: str) -> list[str]:
        return [posixpath.basename(p) for p in self.files if posixpath.dirname(p) == directory]

    def read(self, path: str, limit: int = -1) -> bytes:
        data = self.files[path].view()
        return data if limit < 0 else data[:limit]

    def create(self, path: str) -> _File:
        self.files[path] = _Node()
        return _File(self, path)

    def open_append(self, path: str) -> _File:
        return _File(self, path)

    def rename(self, src: str, dst: str) -> None:
        self.files[dst] = self.files.pop(src)

    def remove(self, path: str) -> None:
        del self.files[path]

    def truncate(self, path: str, size: int) -> None:
        node = self.files[path]
        node.durable = bytearray(node.view()[:size])
        node.pending.clear()

    def fsync_dir(self, directory: str) -> None:
        self._maybe_fail()

    # crash
    def crash(self, rng: random.Random, modes: tuple[str, ...] = ("keep", "drop", "tear",
                                                                   "garble")) -> CrashFS:
        """The durable image after a power loss; this object is left untouched."""
        out = CrashFS()
        out.dirs = set(self.dirs)
        for path, node in self.files.items():
            buf = bytearray(node.durable)
            for off, data in node.pending:
                mode = rng.choice(modes)
                if mode == "keep":
                    _put(buf, off, data)
                elif mode == "tear" and data:
                    _put(buf, off, data[:rng.randrange(len(data))])
                elif mode == "garble" and data:
                    g = bytearray(data)
                    for _ in range(rng.randint(1, 4)):
                        g[rng.randrange(len(g))] ^= rng.randint(1, 255)
                    _put(buf, off, bytes(g))
            out.files[path] = _Node(durable=buf)
        return out
