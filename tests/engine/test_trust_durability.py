"""Regression tests for the durability defects of the trust issue (#11, items 9-16): stale
snapshots, refused opens that touched files, the writer lock, fail-stop after failed I/O, sync
policy strings, compacted journals, use after close, file modes and symlinks."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import (
    ConfigError,
    JournalCorrupt,
    JournalError,
    KVStoreError,
    StoreClosed,
    StoreFailed,
    StoreLocked,
)
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import SEG_HEADER_SIZE, pack_snapshot, snapshot_name
from ninfer_kv.journal.log import Journal, JournalOptions, SyncPolicy
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step
from tests.engine.test_host_tier import host_store

ROOT = Path(__file__).resolve().parents[2]


def tree(d: Path) -> dict[str, str]:
    """Every file under ``d`` with the hash of its bytes (LOCK files aside)."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "LOCK"}


def segments(jdir: Path) -> list[Path]:
    return sorted(jdir.glob("seg-*.log"))


# --- 9. a snapshot is used only if the log still holds the record it names ----------------------
def test_stale_snapshot_is_never_reused_after_the_log_was_cut(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(100, 100)
    s.ensure_mapped(a, "main", 100)
    step(s)
    s.commit(a, "main", 100)
    s.snapshot()  # names the last record (its seq and CRC)
    s.close()
    jdir = tmp_path / "journal"
    empty = segments(jdir)[-1]  # the snapshot ended its segment; this one holds no record
    assert empty.stat().st_size == SEG_HEADER_SIZE
    empty.unlink()  # as if the crash came between the snapshot and the segment after it
    last = segments(jdir)[-1]
    os.truncate(last, last.stat().st_size - 3)  # the last record, fsynced before the
    # snapshot was written, is torn: damage, which the snapshot proves (review finding: it
    # was cut as a torn tail and the snapshot skipped as stale, losing acknowledged records)
    with pytest.raises(JournalCorrupt, match="proves records through"):
        KVStore.open(s.config)
    with pytest.raises(JournalCorrupt, match="proves records through"):
        JournalReader(str(jdir))
    # salvage keeps the valid prefix and sets the snapshot aside
    salvaged = Journal.open(str(jdir), CODEC, JournalOptions(salvage=True))
    salvaged.close()
    assert list(jdir.glob("snap-*.snap")) == [] and len(list(jdir.glob("*.stale"))) == 1
    s1 = KVStore.open(s.config)  # writes a different record under the same seq
    s1.close()
    s2 = KVStore.open(s.config)  # old code: took the stale snapshot here
    assert s2.recovery.snapshots_skipped == []
    s2.close()
    assert replay(str(jdir)).digest == s2.digest()


def test_a_snapshot_without_its_log_is_refused_not_replaced(tmp_path: Path) -> None:
    """Review finding: with every segment gone and a snapshot left, the store opened empty
    (a fresh log from record 1) and its next snapshot would overwrite the old one by name."""
    s = KVStore.open(small_config(tmp_path))
    s.finish(s.activate(100, 100), retain=True)
    step(s)
    s.snapshot()
    s.close()
    jdir = tmp_path / "journal"
    for seg in segments(jdir):
        seg.unlink()
    with pytest.raises(JournalCorrupt, match="the log's valid records end at 0"):
        KVStore.open(s.config)


def test_a_log_gone_whole_is_refused_when_the_arena_token_says_it_existed(tmp_path: Path
                                                                           ) -> None:
    """Review note: with every segment deleted and no snapshot, the store opened a fresh log
    and the acknowledged checkpoints were gone without a word, although the journal's ARENA
    token (written after segment 1 at the first open) proved a history. Refused now; removing
    the token is the deliberate way to start over."""
    cfg = small_config(tmp_path, host_bytes=1 << 20, persist_dir=str(tmp_path / "persist"))
    s = KVStore.open(cfg)
    ck = s.finish(s.activate(100, 100), retain=True)
    step(s)
    s.offload(ck)
    step(s)
    s.close()
    jdir = Path(s.config.journal_path)
    for seg in segments(jdir):
        seg.unlink()
    with pytest.raises(JournalCorrupt, match="holds no segment, but its ARENA token"):
        KVStore.open(cfg)
    (jdir / "ARENA").unlink()         # a new history, by the operator's choice
    (tmp_path / "persist" / "host_arena.bin.id").unlink()
    s = KVStore.open(cfg)
    assert s.checkpoints() == []
    s.close()


def test_foreign_snapshots_are_skipped_and_reported(tmp_path: Path) -> None:
    other = KVStore.open(small_config(tmp_path / "other"))
    other.activate(10, 10)
    foreign = Path(other.snapshot())
    other.close()
    s = KVStore.open(small_config(tmp_path))
    s.activate(10, 10)
    step(s)
    seq = s.state.seq
    crc = s.journal.last_crc
    s.close()
    jdir = tmp_path / "journal"
    (jdir / foreign.name).write_bytes(foreign.read_bytes())  # another journal's snapshot
    (jdir / snapshot_name(seq)).write_bytes(pack_snapshot(1, seq, crc, b"\x93not a state"))
    s2 = KVStore.open(s.config)  # old code: crashed decoding the foreign payload
    skipped = " | ".join(s2.recovery.snapshots_skipped)
    assert "payload refused (it does not decode" in skipped
    s2.close()
    assert replay(str(jdir)).digest == s2.digest()


# --- 10. a refused open touches no file -------------------------------------------------------------
def test_refused_open_leaves_every_file_as_it_was(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 300)
    s.offload(ck)
    step(s)
    s.close()
    before = tree(tmp_path)
    for bad in (dict(host_bytes=4 << 20), dict(host_bytes=0), dict(pages=96)):
        with pytest.raises(ConfigError):
            host_store(tmp_path, **bad)
        assert tree(tmp_path) == before, bad  # old code: arena truncated, segment created
    s2 = host_store(tmp_path)
    assert s2.recovery.kept == [ck]
    s2.close()


# --- 11. one writer per directory ---------------------------------------------------------------------
def test_a_store_dropped_without_close_can_be_reopened(tmp_path: Path) -> None:
    """Review finding: a store dropped without ``close()`` — an engine discarding a failed
    store to reopen it, as StoreFailed says to — kept its directory locked for the rest of
    the process (StoreLocked naming this pid). The lock goes with the collected store."""
    import gc

    s = host_store(tmp_path)
    ck = checkpoint_at(s, 100)
    s.offload(ck)
    step(s)
    s._fail("a failed fsync", OSError(errno.EIO, "EIO"))
    del s
    gc.collect()
    s2 = host_store(tmp_path)  # old code: StoreLocked
    assert s2.recovery.kept == [ck]
    s2.close()


def test_a_released_lock_never_closes_a_descriptor_twice(tmp_path: Path) -> None:
    """``release`` and the collection of a lock close its descriptor once between them: a
    second close could hit whatever file reused the number."""
    import gc

    from ninfer_kv.journal.lock import DirLock

    lk = DirLock(str(tmp_path))
    lk.release()
    fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT, 0o600)  # likely the same number
    del lk
    gc.collect()
    os.fstat(fd)  # still open
    os.close(fd)


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    checkpoint_at(s, 100)
    with pytest.raises(StoreLocked, match=f"pid {os.getpid()}"):
        host_store(tmp_path)
    code = ("import sys; from tests.engine.test_host_tier import host_store\n"
            "from ninfer_kv.errors import StoreLocked\n"
            "try:\n    host_store(__import__('pathlib').Path(sys.argv[1]))\n"
            "except StoreLocked as e:\n    print('LOCKED', e); sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 3 and f"pid {os.getpid()}" in r.stdout, r.stderr[-2000:]
    before = tree(tmp_path)
    assert replay(str(tmp_path / "persist" / "journal")).records > 0  # readers need no lock
    assert JournalReader(str(tmp_path / "persist" / "journal")).last_seq > 0
    assert tree(tmp_path) == before  # ... and write nothing
    s.close()
    host_store(tmp_path).close()  # the lock went with close()


# --- 12. fail-stop after a failed write, fsync or msync ------------------------------------------
def test_failed_msync_stops_the_store_and_nothing_is_acknowledged(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 300)
    s.offload(ck)

    def eio() -> None:
        raise OSError(errno.EIO, "Input/output error")

    s.arena.flush = eio  # type: ignore[method-assign]
    with pytest.raises(StoreFailed):
        step(s)
    assert s.failed and "Input/output error" in s.failed
    for call in (lambda: s.offload(ck), lambda: step(s), lambda: s.activate(10, 10),
                 lambda: s.release(ck), lambda: s.snapshot()):
        with pytest.raises(StoreFailed):  # old code: offload said "already offloaded"
            call()
    s.close()
    s2 = host_store(tmp_path)
    assert ck not in s2.recovery.kept  # it was never reported durable
    s2.check_invariants()
    s2.close()


def test_failed_journal_fsync_stops_the_store(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 300)
    s.offload(ck)
    monkeypatch.setattr(type(s.journal._file), "fsync",
                        lambda self: (_ for _ in ()).throw(OSError(errno.EIO, "EIO")))
    with pytest.raises(StoreFailed):
        step(s)
    monkeypatch.undo()
    with pytest.raises(StoreFailed):
        step(s)  # old code: the next (empty) boundary succeeded
    with pytest.raises(StoreFailed):
        s.offload(ck)
    s.close()


def test_an_event_that_does_not_apply_stops_the_store(tmp_path: Path) -> None:
    from ninfer_kv.journal import events as ev

    s = KVStore.open(small_config(tmp_path))
    with pytest.raises(StoreFailed):
        s._emit(ev.Release(12345, "main"))
    with pytest.raises(StoreFailed):
        s.activate(10, 10)
    s.close()
    KVStore.open(s.config).close()  # the journal never saw the bad event


# --- 13. the sync policy is parsed, never ignored ----------------------------------------------------
def test_sync_policy_strings(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, sync="commit"))
    assert s.config.sync is SyncPolicy.COMMIT
    checkpoint_at(s, 10)  # a retained finish changes what a reopen keeps
    assert s.journal.durable_seq == s.journal.last_seq  # fsynced at append
    s.close()
    with pytest.raises(ConfigError, match="sometimes"):
        small_config(tmp_path, sync="sometimes")


# --- 14. compacted journals and journals missing their first segment ---------------------------
def compacted(tmp_path: Path) -> tuple[KVStore, Path]:
    s = KVStore.open(small_config(tmp_path, segment_bytes=1024))
    for i in range(30):
        a = s.activate(64 + i, 10)
        s.ensure_mapped(a, "main", 64 + i)
        step(s)
        s.commit(a, "main", 64 + i)
        s.finish(a, retain=i % 3 == 0)
        step(s)
        if i in (10, 20):
            s.snapshot()
    assert s.compact() > 0
    jdir = tmp_path / "journal"
    assert not (jdir / "seg-00000001.log").exists()
    return s, jdir


def test_tools_read_a_compacted_journal(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from ninfer_kv.tools.cli import main

    s, jdir = compacted(tmp_path)
    s.close()
    assert replay(str(jdir), verify_every=1).digest == s.digest()  # old code: KeyError
    for argv in (["replay", str(jdir), "--json"], ["inspect", str(jdir), "--json"],
                 ["events", str(jdir), "--json"], ["dump", str(jdir)],
                 ["plot", str(jdir), "-o", str(tmp_path / "t.png")]):
        assert main(argv) == 0, argv
    KVStore.open(s.config).close()


def test_a_journal_without_its_first_segment_is_refused_typed(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, segment_bytes=1024))
    for _ in range(20):
        s.finish(s.activate(64, 10))
        step(s)
    s.close()
    jdir = tmp_path / "journal"
    segments(jdir)[0].unlink()
    with pytest.raises(JournalCorrupt, match="no usable snapshot"):
        replay(str(jdir))
    with pytest.raises(JournalCorrupt, match="no usable snapshot"):
        KVStore.open(s.config)


# --- 15. a closed store refuses every command; it still reads its final state ---------------------
# What a closed store still answers: its final in-memory state, read only (no I/O, no device
# memory) -- every query, the checkpoint queries included. Everything else -- every command,
# the boundary, the views into device memory -- refuses with StoreClosed. A new public method
# must be listed.
ANSWERS_WHEN_CLOSED = {"active", "checkpoints", "digest", "occupancy", "space", "handles", "page",
                       "check_invariants", "violations", "metrics", "entitlement_pages",
                       "checkpoint_info", "sole_device_pages", "reclaimable",
                       "unit_complete", "close", "closed", "failed", "pools", "open"}


def test_calls_after_close_raise_store_closed(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = s.activate(64, 10)
    ck = checkpoint_at(s, 64)
    s.close()
    s.close()  # idempotent
    refused = {
        "activate": (10, 10), "activate_from": (ck, 10, 10, 10), "batch_view": ("main", 0),
        "boundary": (), "close_boundary": (), "commit": (a, "main", 1),
        "commit_many": ("main", [a], [1]), "compact": (), "drop_device": (ck,),
        "drop_host": (ck,), "ensure_mapped": (a, "main", 64),
        "ensure_mapped_many": ("main", [a], [64]), "finish": (a,), "fork_live": (a, 10),
        "grow": (), "layer_view": (a, "main", 0), "offload": (ck,),
        "release": (ck,), "release_tail": (ck, 0), "set_metadata": (ck, None),
        "set_provisional": (a, "main", 1), "set_provisional_many": ("main", [a], [1]),
        "share_prefix": (a,), "snapshot": (),
        "table_rows": ("main", [a]), "trim": (a, "main"), "truncate": (a, "main", 0),
        "truncate_many": ("main", [a], [0])}
    public = {n for n in dir(KVStore) if not n.startswith("_")}
    assert public == set(refused) | ANSWERS_WHEN_CLOSED, \
        sorted(public ^ (set(refused) | ANSWERS_WHEN_CLOSED))
    for name, args in refused.items():
        said = {"boundary": "close_boundary", "commit_many": "commit", "layer_view": "batch_view",
                "ensure_mapped_many": "ensure_mapped", "truncate_many": "truncate",
                "set_provisional_many": "set_provisional"}.get(name, name)  # one check, two doors
        with pytest.raises(StoreClosed, match=f"^{said} refused: the store is closed"):
            result = getattr(s, name)(*args)
            if name == "boundary":  # a context manager: refused when entered
                result.__enter__()
    assert s.digest() and s.checkpoints() == [ck]  # the final state still reads
    info = s.checkpoint_info(ck)  # so do the checkpoint queries (arrays in memory)
    assert info.survives_restart is False and s.sole_device_pages(ck) == 1
    assert s.reclaimable([ck]) == {ck: 1}


# --- 16. file modes, symlinks, temp files ---------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_created_files_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        s = host_store(tmp_path)
        ck = checkpoint_at(s, 100)
        s.offload(ck)
        step(s)
        s.snapshot()
        s.close()
    finally:
        os.umask(old)
    persist = tmp_path / "persist"
    files = [p for p in persist.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"host_arena.bin", "LOCK", "seg-00000001.log"}
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for d in (persist, persist / "journal"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_symlinked_files_are_never_opened(tmp_path: Path) -> None:
    s = host_store(tmp_path)
    s.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    arena = tmp_path / "persist" / "host_arena.bin"
    arena.unlink()
    arena.symlink_to(victim)
    with pytest.raises(ConfigError, match="not a regular file"):
        host_store(tmp_path)
    arena.unlink()
    seg = segments(tmp_path / "persist" / "journal")[0]
    seg.rename(tmp_path / "moved.log")
    seg.symlink_to(tmp_path / "moved.log")
    with pytest.raises(JournalError, match="symlink"):
        host_store(tmp_path)
    assert victim.read_bytes() == b"precious"


def test_open_removes_only_its_own_temp_files(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    s.close()
    jdir = tmp_path / "journal"
    (jdir / "notes.tmp").write_text("the user's")
    (jdir / "seg-00000009.log.tmp").write_bytes(b"half a segment")
    (jdir / f"{snapshot_name(3)}.tmp").write_bytes(b"half a snapshot")
    KVStore.open(s.config).close()
    assert (jdir / "notes.tmp").read_text() == "the user's"
    assert not (jdir / "seg-00000009.log.tmp").exists()
    assert not (jdir / f"{snapshot_name(3)}.tmp").exists()


def test_a_file_where_a_directory_belongs_is_a_typed_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    for kw in (dict(journal_dir=str(f)), dict(persist_dir=str(f), host_bytes=1 << 20),
               dict(journal_dir=str(f / "sub"))):
        with pytest.raises(KVStoreError, match=str(f)):
            KVStore.open(small_config(None, **kw))


def test_a_crash_between_the_copy_record_and_its_unpin_releases_the_pins(tmp_path: Path) -> None:
    from tests.engine.conftest import crash

    s = host_store(tmp_path)
    ck = checkpoint_at(s, 100)
    s.offload(ck)
    step(s)
    s.drop_device(ck)
    step(s)
    s.offload(keep := checkpoint_at(s, 70))
    step(s)
    s.activate_from(ck, 100, 100, 10)  # Pin + DeviceRestore + CopyTail queued
    dev_only = checkpoint_at(s, 90)     # never offloaded: released by the restart
    s.activate_from(dev_only, 90, 90, 10)  # its COW source tail is pinned
    s._append_pending()                 # the record is written; the copies never run
    assert s.state.copy_pins
    crash(s)
    s2 = host_store(tmp_path)
    assert not s2.state.copy_pins
    assert all(pg.pins == 0 for p in s2.state.pools.values() for pg in p.pages if pg)
    assert set(s2.recovery.kept) == {ck, keep} and dev_only in s2.recovery.dropped
    s2.check_invariants()
    assert s2.drop_host(keep) == 0 and s2.drop_device(ck) == 0  # nothing left pinned
    s2.close()
