"""One writer per directory: an exclusive ``flock`` on ``<dir>/LOCK`` for the writer's lifetime
(a store's, from ``KVStore.open`` to ``close``; a bare ``Journal.open``'s, to its ``close``).

The lock file holds the holder's pid (for the error message only; the kernel lock is what
excludes). ``flock`` locks belong to the open file description, so the lock ends when the
holder unlocks and closes it or dies — no stale lock survives a ``kill -9`` — or when the lock object is
collected (a store dropped without ``close()``, say after it failed, can be reopened in the
same process). A forked child would share
the description (and keep the lock after the parent closed): children close their inherited
lock descriptors at fork, and a store refuses to be used from a process other than the one
that opened it. Read-only tools (replay, inspect, dump, events) never take it and never
write.
"""

from __future__ import annotations

import errno
import fcntl
import os
import weakref

from ninfer_kv.errors import StoreLocked
from ninfer_kv.journal.fs import secure_makedirs

LOCK_NAME = "LOCK"


class Process:
    """This process's pid, renewed in a child by ``os.register_at_fork``: a store compares it
    with its opener's at every command (``os.getpid()`` is a system call, ~1 µs here, and a
    decode round runs three commands). A child forked by C code that bypasses
    ``PyOS_AfterFork`` keeps the parent's pid here; ``KVStore.close`` asks the kernel."""

    pid = os.getpid()

    @classmethod
    def forked(cls) -> None:
        cls.pid = os.getpid()


os.register_at_fork(after_in_child=Process.forked)


class DirLock:
    __slots__ = ("path", "_fd", "_closer", "__weakref__")

    def __init__(self, directory: str) -> None:
        secure_makedirs(directory)
        self.path = os.path.join(directory, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise StoreLocked(f"{directory} is locked by another store (pid {holder}); one "
                              "writer per directory — close that store first") from None
        try:  # the pid for the message above; a failure here must not keep the lock
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            _unlock_and_close(fd, os.getpid())
            raise
        self._fd: int | None = fd
        # runs once: release, or collection
        self._closer = weakref.finalize(self, _unlock_and_close, fd, os.getpid())
        _LIVE.add(self)

    def release(self) -> None:
        """Unlock and close (idempotent). The finalizer runs first and ``_fd`` goes after:
        a release interrupted before it is done by the next call."""
        self._closer()  # runs once (or did, at collection): closing drops the flock
        self._fd = None


def _unlock_and_close(fd: int, owner: int) -> None:
    """Unlock, then close: closing alone leaves the lock held while a child forked a moment
    ago still shares the description (its at-fork hook has not closed its copy yet), and the
    next open is refused. Only the owner unlocks: the lock is the description's, so a child
    that unlocked would free the parent's lock."""
    try:
        if os.getpid() == owner:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


_LIVE: weakref.WeakSet[DirLock] = weakref.WeakSet()


def _drop_inherited_locks() -> None:
    """In a forked child: close the inherited lock descriptors, so that the parent's close
    (or death) releases its lock whatever the child does."""
    for lk in list(_LIVE):
        # the finalizer's own descriptor, not ``_fd``: a release interrupted after its
        # finalizer ran leaves ``_fd`` naming a number the parent may have reused since
        held = lk._closer.detach()  # the child closes its copy now, never again at collection
        if held is not None:
            try:
                os.close(held[2][0])
            except OSError:
                pass
        lk._fd = None


os.register_at_fork(after_in_child=_drop_inherited_locks)


def lock_dirs(directories: list[str]) -> list[DirLock]:
    """Lock each distinct directory (sorted, so two stores never wait on each other), named
    by ``realpath``: one directory under two spellings is one lock, and ``link/..`` is the
    directory the kernel resolves, not the one ``abspath`` reads."""
    held: list[DirLock] = []
    try:
        for d in sorted({os.path.realpath(x) for x in directories}):
            held.append(DirLock(d))
    except BaseException:
        for lk in held:
            lk.release()
        raise
    return held
