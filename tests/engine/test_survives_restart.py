"""``checkpoint_info(ck).survives_restart`` says only what the journal holds (README: "Nothing is
reported durable that was not made durable").

From an outside review (2026-12-03): the flag was computed from the in-memory state alone. A
failed write of the record publishing a checkpoint's host replicas left it True (and
``metrics().published`` counted the transfer) while the reopen dropped the checkpoint; a
retained Finish still pending in memory, which a kill -9 loses, was reported as surviving."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

from ninfer_kv.engine import info
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.errors import StoreFailed
from ninfer_kv.journal import events as ev
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step


class FailPublishWrite:
    """The journal's segment file, whose write of the host-publish record fails (ENOSPC)."""

    def __init__(self, f: Any) -> None:  # noqa: ANN401
        self.f = f

    def write(self, data: bytes) -> None:
        if b"hpub" in bytes(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.f.write(data)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self.f, name)


def cfg(d: Path) -> StoreConfig:
    return small_config(d, host_bytes=8 << 20, persist_dir=str(d / "p"), journal_dir=None,
                        sync="commit")


def test_a_failed_publish_is_not_reported_as_surviving_a_restart(tmp_path: Path) -> None:
    s = KVStore.open(cfg(tmp_path))
    ck = checkpoint_at(s, 200)
    published = s.metrics().published
    s.offload(ck)
    s.journal._file = FailPublishWrite(s.journal._file)  # type: ignore[union-attr]
    with pytest.raises(StoreFailed):
        with s.boundary():
            pass
    assert not s.checkpoint_info(ck).survives_restart  # old code: True
    assert s.metrics().published == published          # old code: counted
    s.close()
    s2 = KVStore.open(cfg(tmp_path))
    assert ck not in s2.recovery.kept  # what the flag must agree with
    s2.close()


class FailFsync(FailPublishWrite):
    """The journal's segment file, whose writes land but whose fsync fails (EIO)."""

    def write(self, data: bytes) -> None:
        self.f.write(data)

    def fsync(self) -> None:
        raise OSError(errno.EIO, "Input/output error")


def test_a_publish_whose_fsync_failed_is_not_reported_durable(tmp_path: Path) -> None:
    """sync=off: the record publishing the host replicas is written, then the boundary's
    durability point (one fsync) fails. The record may sit in the page cache, but nothing made
    it durable: the boundary's records count as unjournaled, not only its pending events."""
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20, persist_dir=str(tmp_path / "p"),
                                  journal_dir=None, sync="off"))
    ck = checkpoint_at(s, 200)
    published = s.metrics().published
    s.offload(ck)
    s.journal._file = FailFsync(s.journal._file)  # type: ignore[union-attr]
    with pytest.raises(StoreFailed, match="fsync"):
        with s.boundary():
            pass
    assert not s._pending  # the record was written: only the boundary's list knows it
    assert not s.checkpoint_info(ck).survives_restart
    assert s.metrics().published == published
    s.close()


def test_a_checkpoint_survives_only_once_its_records_are_journaled(tmp_path: Path) -> None:
    s = KVStore.open(cfg(tmp_path))
    ck = s.finish(s.activate(10, 10), retain=True)  # no pages: needs no host replica
    assert ck is not None
    assert not s.checkpoint_info(ck).survives_restart  # old code: True, with the Finish pending
    step(s)
    assert s.checkpoint_info(ck).survives_restart
    big = checkpoint_at(s, 200)
    s.offload(big)
    assert not s.checkpoint_info(big).survives_restart  # queued, not published
    step(s)
    assert s.checkpoint_info(big).survives_restart
    # what cannot make it survive does not hide that it does: a Fork from it pins its tail
    s.activate_from(big, 130, 200, 10)
    assert any(type(e) is ev.Pin for e in s._pending)
    assert s.checkpoint_info(big).survives_restart
    s.close()
    s2 = KVStore.open(cfg(tmp_path))
    assert {ck, big} <= set(s2.recovery.kept)
    s2.close()


def test_without_a_journal_nothing_survives_a_restart() -> None:
    s = KVStore.open(small_config(None, journal=False))
    ck = s.finish(s.activate(10, 10), retain=True)
    step(s)
    assert ck is not None and not s.checkpoint_info(ck).survives_restart  # old code: True
    s.close()


def test_every_event_type_is_classified() -> None:
    """``may_establish`` treats an unclassified type as one that may establish survival: a new
    event type must be placed (handled by field, or ``NEUTRAL``) for the flag to stay exact."""
    handled = {ev.HostPublish, ev.Recovered, *info._BY_DST, *info._BY_BUNDLE}
    types = {t for t in ev._Event.__subclasses__() if t.__module__ == ev.__name__}
    assert types == handled | info.NEUTRAL, types ^ (handled | info.NEUTRAL)
    assert not handled & info.NEUTRAL

    class Unclassified(ev._Event, tag="test-only"):
        bundle: int

    assert info.may_establish(Unclassified(99), 1, {})  # counted, whatever it names


def test_a_later_failure_does_not_unjournal_the_last_good_boundary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of 99ff519: the boundary's events were kept after it succeeded, so a snapshot's
    ENOSPC later counted them as unjournaled."""
    import ninfer_kv.journal.log as jlog

    s = KVStore.open(cfg(tmp_path))
    ck = checkpoint_at(s, 200)
    s.offload(ck)
    step(s)
    assert s.checkpoint_info(ck).survives_restart

    def enospc(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jlog, "replace_durably", enospc)
    with pytest.raises(StoreFailed, match="snapshot"):
        s.snapshot()
    monkeypatch.undo()
    assert s.checkpoint_info(ck).survives_restart
    s.close()
    assert s.checkpoint_info(ck).survives_restart  # a closed store had a journal too
    s2 = KVStore.open(cfg(tmp_path))
    assert ck in s2.recovery.kept
    s2.close()


def test_a_standby_that_could_not_journal_a_record_does_not_report_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review of 99ff519: the follower path applied the record, failed to journal it, and still
    reported the checkpoint it made as surviving; the promotion dropped it."""
    from ninfer_kv.dist import StreamBroken
    from ninfer_kv.dist import standby as sb
    from ninfer_kv.errors import JournalFailed
    from tests.dist.test_standby import pair

    store, leader, standby, _ = pair(tmp_path)
    ck = store.finish(store.activate(10, 1), retain=True)  # no pages: the journal alone
    assert ck is not None

    def full(store_: object, events: list[Any]) -> int:
        raise JournalFailed("write of record 2: [Errno 28] No space left on device")

    monkeypatch.setattr(sb, "persist", full)
    with pytest.raises(StreamBroken):
        with leader.boundary():
            pass
    monkeypatch.undo()
    assert standby.failed is not None
    assert not standby.store.checkpoint_info(ck).survives_restart
    promoted = standby.promote()
    assert ck not in promoted.recovery.kept
    promoted.close()
    store.close()
