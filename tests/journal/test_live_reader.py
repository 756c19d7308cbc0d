"""The tools read a journal a live store is writing: a reader takes no lock, so the store may
append, snapshot, prune old snapshots and compact between any two of the reader's file
operations. Whatever it does, a reader sees one consistent moment of the journal
(``journal.reader.capture``): a healthy live journal is never reported damaged.

Each test runs the writer at one chosen point inside the reader's reads (``RacingFS``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import JournalError
from ninfer_kv.journal.fs import OsFS
from ninfer_kv.journal.reader import CAPTURE_ATTEMPTS, JournalReader
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config


class RacingFS(OsFS):
    """Runs ``hook`` once, just before the ``nth`` call of ``op`` ("listdir" or "read") whose
    path's name starts with ``prefix``: the live writer acting inside the reader's reads."""

    def __init__(self, op: str, nth: int, hook: Callable[[], None], prefix: str = "") -> None:
        self.op, self.nth, self.hook, self.prefix = op, nth, hook, prefix
        self.calls = 0

    def _maybe(self, op: str, path: str) -> None:
        if op != self.op or not os.path.basename(path).startswith(self.prefix):
            return
        self.calls += 1
        if self.calls == self.nth:
            self.hook()

    def listdir(self, directory: str) -> list[str]:
        self._maybe("listdir", directory)
        return super().listdir(directory)

    def read(self, path: str, limit: int = -1) -> bytes:
        self._maybe("read", path)
        return super().read(path, limit)


class Live:
    """A store writing its journal, and the digest it had at each record it wrote."""

    def __init__(self, tmp: Path) -> None:
        self.store = KVStore.open(small_config(tmp))
        self.dir = str(tmp / "journal")
        self.digests: dict[int, str] = {}

    def work(self, n: int = 2) -> None:
        s = self.store
        for _ in range(n):
            s.finish(s.activate(64, 10))
            with s.boundary():
                pass
            self.digests[s.journal.last_seq] = s.digest()

    def snapshot(self) -> None:
        self.store.snapshot()
        self.work()

    def check(self, reader: JournalReader) -> None:
        """The reader shows a state the store really had, at the reader's last record."""
        assert reader.last_seq in self.digests
        assert replay(reader).digest == self.digests[reader.last_seq]


@pytest.fixture
def live(tmp_path: Path) -> Live:
    lv = Live(tmp_path)
    lv.work()
    lv.snapshot()
    lv.snapshot()
    lv.store.compact()
    yield lv
    lv.store.close()


def test_segment_compacted_between_listing_and_read(live: Live) -> None:
    """The writer compacts away a segment the reader has listed but not yet read."""
    first = sorted(n for n in os.listdir(live.dir) if n.startswith("seg-"))[0]

    def writer() -> None:
        live.snapshot()
        live.snapshot()
        live.store.compact()
        assert first not in os.listdir(live.dir)

    fs = RacingFS("read", 1, writer, prefix="seg-")
    live.check(JournalReader(live.dir, fs=fs))
    assert fs.calls > 1


def test_snapshots_pruned_after_the_reader_opened(live: Live) -> None:
    """Replay starts from a snapshot the writer pruned after the reader read the log: the
    reader's own copy of it is used, not the directory's."""
    reader = JournalReader(live.dir)
    live.work()  # so no new snapshot lies at the reader's last record
    live.snapshot()
    live.snapshot()
    live.store.compact()
    live.check(reader)


def test_compacted_past_every_snapshot_read(live: Live) -> None:
    """Between listing the snapshots and listing the segments, the writer snapshots twice
    (pruning both snapshots the reader listed) and compacts past them: the segments then
    start after every snapshot the reader holds, so it must read again."""
    def writer() -> None:
        live.work()
        live.snapshot()
        live.snapshot()
        live.store.compact()

    fs = RacingFS("listdir", 2, writer)  # 1: the snapshots, 2: the segments
    live.check(JournalReader(live.dir, fs=fs))


def test_first_snapshots_and_compaction_while_listing(tmp_path: Path) -> None:
    """The reader finds no snapshot, then the writer takes its first two and compacts before
    the segments are listed: the log read starts past record 1 with no snapshot read."""
    live = Live(tmp_path)
    live.work()

    def writer() -> None:
        live.snapshot()
        live.snapshot()
        assert live.store.compact()

    try:
        live.check(JournalReader(live.dir, fs=RacingFS("listdir", 2, writer)))
    finally:
        live.store.close()


def test_gives_up_on_a_directory_that_never_holds_still(live: Live) -> None:
    class Vanishing(OsFS):
        reads = 0

        def read(self, path: str, limit: int = -1) -> bytes:
            if os.path.basename(path).startswith("seg-"):
                Vanishing.reads += 1
                raise FileNotFoundError(2, "No such file or directory", path)
            return super().read(path, limit)

    with pytest.raises(JournalError, match=f"changed under each of {CAPTURE_ATTEMPTS} reads"):
        JournalReader(live.dir, fs=Vanishing())
    assert Vanishing.reads == CAPTURE_ATTEMPTS


def test_reader_view_is_read_only(live: Live) -> None:
    reader = JournalReader(live.dir)
    seg = os.path.join(live.dir, sorted(reader.fs.listdir(live.dir))[-1])
    for call in (lambda fs: fs.remove(seg), lambda fs: fs.create(seg + ".x"),
                 lambda fs: fs.truncate(seg, 0), lambda fs: fs.rename(seg, seg + ".x"),
                 lambda fs: fs.open_append(seg), lambda fs: fs.fsync_dir(live.dir),
                 lambda fs: fs.makedirs(live.dir)):
        with pytest.raises(JournalError, match="read-only"):
            call(reader.fs)


def test_a_symlinked_segment_is_refused_not_retried(live: Live, tmp_path: Path) -> None:
    """Journal files are never opened through a symlink (O_NOFOLLOW): that is damage to
    report at once, not a writer's change to read again."""
    seg = os.path.join(live.dir, sorted(n for n in os.listdir(live.dir)
                                        if n.startswith("seg-"))[-1])
    os.rename(seg, tmp_path / "elsewhere.log")
    os.symlink(tmp_path / "elsewhere.log", seg)
    with pytest.raises(JournalError, match="never opened through a symlink"):
        JournalReader(live.dir)


@pytest.mark.parametrize("name", ["seg-00000001.log", "snap-00000009.snap"])
def test_a_directory_under_a_journal_files_name_is_named(tmp_path: Path, name: str) -> None:
    """Review finding: a directory under a segment's or snapshot's name was reported as
    "cannot read 3: Is a directory (journal files are never opened through a symlink)" —
    the descriptor, not the path, and a symlink that is not there. The error names the
    file and the OS's reason only (and closes the descriptor it opened, which leaked); the
    CLI prints it on one line, exit status 2."""
    d = tmp_path / "journal"
    d.mkdir()
    if name.startswith("snap"):
        os.mkdir(d / "seg-00000001.log")  # a segment is needed for a journal at all
    os.mkdir(d / name)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(JournalError) as got:
        JournalReader(str(d))
    assert len(os.listdir("/proc/self/fd")) == fds  # the directory's descriptor was closed
    msg = str(got.value)
    assert "Is a directory" in msg and str(d) in msg and "symlink" not in msg, msg
    run = subprocess.run([sys.executable, "-m", "ninfer_kv.tools.cli", "replay", str(d)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "Is a directory" in run.stderr and "symlink" not in run.stderr, run.stderr



def test_a_kept_unusable_snapshot_does_not_anchor_the_view(live: Live,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: the view was accepted while any snapshot read was still listed — but
    pruning keeps a snapshot recovery would skip, and compaction ignores it. With a good
    snapshot and a bad one read, the writer snapshotted (pruning the good one) and compacted
    past both: the view held no snapshot replay could start from."""
    import ninfer_kv.engine.core as core

    live.work()
    with monkeypatch.context() as m:
        m.setattr(core, "encode_state", lambda st: b"\xc1 an engine bug")
        live.snapshot()                       # kept: a good one is older

    def writer() -> None:
        live.work()
        live.snapshot()                       # good: prunes the oldest good one
        assert live.store.compact()

    live.check(JournalReader(live.dir, fs=RacingFS("listdir", 2, writer)))
