"""``Journal.open`` — the salvage tool the README documents — takes the directory's writer
lock. Review finding (high): it took none, so run beside a live store it started a segment
in that store's directory, and the store's later acknowledged records made the journal
refuse to reopen."""

from __future__ import annotations

from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import ConfigError, JournalCorrupt, StoreLocked
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.log import Journal, JournalOptions
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at


def test_journal_open_beside_a_live_store_is_refused(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=80, sync="commit"))
    jdir = s.config.journal_dir
    with pytest.raises(StoreLocked):
        Journal.open(jdir, CODEC, JournalOptions(salvage=True))
    checkpoint_at(s, 100)
    last = s.state.seq
    s.close()
    j = Journal.open(jdir, CODEC, JournalOptions(salvage=True))  # the store is gone: allowed
    with pytest.raises(StoreLocked):                              # and it excludes a store
        KVStore.open(small_config(tmp_path, pages=80))
    j.close()
    r = KVStore.open(small_config(tmp_path, pages=80))
    assert r.recovery.records == last and r.recovery.cuts == []
    r.close()


def test_a_refused_open_releases_the_lock(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, segment_bytes=1024))
    for _ in range(30):
        s.finish(s.activate(64, 10))
        with s.boundary():
            pass
    s.close()
    jdir = Path(s.config.journal_dir)
    seg = sorted(jdir.glob("seg-*.log"))[0]
    b = bytearray(seg.read_bytes())
    b[len(b) // 2] ^= 0xFF                     # mid-log damage: open refuses it
    seg.write_bytes(b)
    with pytest.raises(JournalCorrupt):
        Journal.open(str(jdir), CODEC)
    Journal.open(str(jdir), CODEC, JournalOptions(salvage=True)).close()  # not locked out


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_snapshots_is_at_least_one(keep: object) -> None:
    """Review finding (low): 0 kept every snapshot, -1 removed the one just written."""
    with pytest.raises(ConfigError, match="keep_snapshots"):
        JournalOptions(keep_snapshots=keep)  # type: ignore[arg-type]


def test_a_lock_that_cannot_be_taken_refuses_the_open(tmp_path: Path) -> None:
    """The directory is there, its LOCK is not a file: no lock, no writing."""
    from ninfer_kv.errors import JournalError

    (tmp_path / "LOCK").mkdir()
    with pytest.raises(JournalError, match="or its lock"):
        Journal.open(str(tmp_path), CODEC)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK"]  # nothing written


def test_a_failed_rotation_still_releases_the_lock(tmp_path: Path) -> None:
    """Review finding: close() returned early when a failed segment rotation had left no
    segment open, so the lock stayed held and a reopen in this process was StoreLocked."""
    from ninfer_kv.errors import JournalFailed
    from ninfer_kv.journal.fs import OsFS

    class NoNewSegment(OsFS):
        full = False

        def create(self, path: str):  # noqa: ANN201
            if self.full and Path(path).name.startswith("seg-"):
                raise OSError(28, "No space left on device")
            return super().create(path)

    fs = NoNewSegment()
    j = Journal.open(str(tmp_path), CODEC, fs=fs, lock=True)
    j.append([])
    fs.full = True
    with pytest.raises(JournalFailed, match="segment"):
        j.write_snapshot(b"state")  # the snapshot ends the segment; the next is not created
    j.close()
    Journal.open(str(tmp_path), CODEC).close()


def test_a_fork_after_an_interrupted_release_closes_no_other_file(tmp_path: Path) -> None:
    """``DirLock.release`` interrupted after its finalizer closed the lock and before it
    cleared ``_fd``, then a fork: the child's at-fork hook closed whatever file the parent
    had opened under that number since (review finding). It now closes only a descriptor
    whose finalizer has not run."""
    import os

    from ninfer_kv.journal.lock import DirLock

    lk = DirLock(str(tmp_path))
    lk._closer()  # what release() had done when the interrupt came
    other = os.open(tmp_path / "other", os.O_CREAT | os.O_RDWR)  # may reuse the number
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: is the parent's other file still open here?
        try:
            os.fstat(other)
            os.write(w, b"open")
        except OSError:
            os.write(w, b"closed")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 16) == b"open"
    for fd in (r, w, other):
        os.close(fd)
    lk.release()


def test_a_failed_pid_write_releases_the_lock(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: writing the holder's pid into LOCK after the flock succeeded
    (ENOSPC, EDQUOT, a file-size limit) leaked the descriptor with the lock held: the same
    process could never open the journal again (StoreLocked naming no pid)."""
    import errno
    import os

    from ninfer_kv.journal import lock

    def no_space(fd: int, data: bytes, off: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    fds = len(os.listdir("/proc/self/fd"))
    with monkeypatch.context() as m:
        m.setattr(lock.os, "pwrite", no_space)
        with pytest.raises(OSError, match="No space"):
            lock.DirLock(str(tmp_path / "j"))
    assert len(os.listdir("/proc/self/fd")) == fds
    lock.DirLock(str(tmp_path / "j")).release()  # the lock was given back
