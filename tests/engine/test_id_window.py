"""No seq id comes back after a reopen (review finding, 2026-12-04): a boundary whose record
failed to journal (fail-stop) lost the ids its commands had handed out, and the reopened
store handed them out again — an engine that kept an id (a prefix index entry, a request
table) across the reopen then continued another request's KV with it. A reopen now starts
``ID_GAP`` ids past the journal's next one (``Recovered.next_id``), and the store keeps the
ids handed out since its last durable record within that window (engine/state.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ninfer_kv import KVStore
from ninfer_kv.cache import PrefixIndex
from ninfer_kv.engine import state as state_mod
from ninfer_kv.errors import IdsExhausted, StoreFailed, UnknownHandle
from ninfer_kv.journal.log import SyncPolicy
from ninfer_kv.replay import replay
from tests.engine.conftest import crash, small_config


def step(s: KVStore) -> None:
    with s.boundary():
        pass


def committed(s: KVStore, tokens: int) -> int:
    b = s.activate(tokens, 64)
    s.ensure_mapped(b, "main", tokens)
    step(s)
    s.commit(b, "main", tokens)
    return b


def test_an_id_a_failed_boundary_lost_names_nothing_after_the_reopen(tmp_path: Path) -> None:
    """The reviewer's case: a prefix is shared and indexed, the boundary that would journal it
    fails (disk full), the store is reopened; a new request gets a new id, and the index's
    stale entry is refused instead of continuing the new request's KV."""
    cfg = small_config(tmp_path, pages=16, context=512, allocate_planes=False,
                       host_bytes=1 << 20, persist_dir=str(tmp_path / "p"))
    s = KVStore.open(cfg)
    idx = PrefixIndex()
    x = committed(s, 128)
    step(s)
    shared = s.share_prefix(x, 128)
    idx.add(shared, [7] * 128)

    def disk_full(*_: object, **__: object) -> int:
        raise OSError(28, "No space left on device")
    s.journal.append = disk_full  # type: ignore[method-assign, union-attr]
    with pytest.raises(StoreFailed):
        step(s)
    s.close()
    s = KVStore.open(cfg)
    assert s.state.next_bundle >= shared + state_mod.ID_GAP
    y = committed(s, 128)
    assert y != shared and y > shared
    m = idx.lookup([7] * 128)
    assert m is not None and m.checkpoint == shared
    with pytest.raises(UnknownHandle):
        s.activate_from(m.checkpoint, m.tokens - 1, 128, 10)
    step(s)
    live = s.digest()
    s.close()
    assert replay(str(tmp_path / "journal")).digest == live  # Recovered.next_id replays


def test_ids_of_a_crash_before_the_boundary_do_not_come_back(tmp_path: Path) -> None:
    """``kill -9`` after an activation that no record holds: the reopened store's first id
    is past it by ``ID_GAP``, whichever it was."""
    s = KVStore.open(small_config(tmp_path, allocate_planes=False))
    committed(s, 64)
    step(s)
    lost = s.activate(10, 10)  # never journaled
    crash(s)
    s = KVStore.open(small_config(tmp_path, allocate_planes=False))
    assert lost not in s.state.bundles
    assert s.activate(10, 10) == lost + state_mod.ID_GAP
    s.close()


@pytest.fixture
def small_gap(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(state_mod, "ID_GAP", 8)
    return 8


def test_a_record_is_made_durable_before_the_window_fills(tmp_path: Path,
                                                            small_gap: int) -> None:
    """``sync="commit"`` does not fsync a decode round's record, nor an admission's; once the
    ids handed out since the last durable record pass half the window, the record that holds
    them is fsynced, so a crash can lose at most the window's worth."""
    s = KVStore.open(small_config(tmp_path, concurrency=16, allocate_planes=False,
                                  sync=SyncPolicy.COMMIT))
    j = s.journal
    assert j is not None and j.durable_seq == j.last_seq
    start = s.state.next_bundle
    for k in range(1, 7):
        s.activate(10, 10)
        step(s)
        handed = s.state.next_bundle - start
        if handed <= small_gap // 2:
            assert j.durable_seq < j.last_seq, k  # admissions alone: not durable
        else:
            assert j.durable_seq == j.last_seq, k
            break
    else:
        raise AssertionError("no record was made durable")
    s.close()


def test_more_ids_in_one_step_than_the_window_are_refused_unchanged(tmp_path: Path,
                                                                     small_gap: int) -> None:
    s = KVStore.open(small_config(tmp_path, concurrency=16, allocate_planes=False))
    for _ in range(small_gap):
        s.activate(10, 10)
    before = (s.digest(), len(s._pending))
    with pytest.raises(IdsExhausted, match="run a boundary first"):
        s.activate(10, 10)
    assert (s.digest(), len(s._pending)) == before
    step(s)
    s.activate(10, 10)  # the boundary made them durable: the window is open again
    s.close()


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        c = f.read(1)
        f.seek(at)
        f.write(bytes([c[0] ^ 1]))


def _many(s: KVStore, n: int) -> list[int]:
    """``n`` admissions, finished, in boundaries of 5: all journaled."""
    out: list[int] = []
    while len(out) < n:
        batch = [s.activate(10, 10) for _ in range(5)]
        step(s)
        for b in batch:
            s.finish(b)
        step(s)
        out += batch
    return out


def first_record(tmp_path: Path, sync: SyncPolicy, more: int = 0
                 ) -> tuple[Any, list[int], int, int]:
    """(config, the ids handed out, the byte span of the first one's record in segment 1):
    a journal a test then damages inside that record; ``more`` ids follow in the same
    segment."""
    cfg = small_config(tmp_path, concurrency=16, allocate_planes=False, sync=sync)
    s = KVStore.open(cfg)
    assert s.journal is not None
    start = s.journal._file.tell()
    handed = [s.activate(10, 10)]
    step(s)
    end = s.journal._file.tell()
    handed += _many(s, more) if more else []
    s.close()
    return cfg, handed, start, end


@pytest.mark.parametrize("sync", [SyncPolicy.OFF, SyncPolicy.COMMIT])
def test_ids_in_records_a_recovery_cut_do_not_come_back(tmp_path: Path, small_gap: int,
                                                       sync: SyncPolicy) -> None:
    """Review finding: a cut can take any number of records — under ``sync="off"`` a flipped
    bit mid-log reads as a torn tail and the store cuts from there; under ``commit`` the open
    refuses and ``Journal.open(salvage=True)`` (the README's remedy) cuts. Their ids came
    back: the reopen skipped only ``ID_GAP``. It now skips as many more ids as bytes were cut
    (each id takes at least one), noted durably before the cut (``journal.recovery.CUT_NOTE``)
    and cleared once the reopen record holds it."""
    from ninfer_kv.engine.opening import CODEC
    from ninfer_kv.errors import JournalCorrupt
    from ninfer_kv.journal.ids import CUT_NOTE
    from ninfer_kv.journal.log import Journal, JournalOptions
    cfg, handed, start, end = first_record(tmp_path, sync, more=60)
    _flip(tmp_path / "journal" / "seg-00000001.log", (start + end) // 2)
    note = tmp_path / "journal" / CUT_NOTE
    if sync is SyncPolicy.COMMIT:
        with pytest.raises(JournalCorrupt):
            KVStore.open(cfg)
        Journal.open(str(tmp_path / "journal"), CODEC, JournalOptions(salvage=True)).close()
        assert note.exists()
    s = KVStore.open(cfg)
    assert s.recovery.cut_bytes > 0 and not note.exists()
    new = [s.activate(10, 10) for _ in range(3)]
    assert min(new) > max(handed)
    step(s)
    live = s.digest()
    s.close()
    assert replay(str(tmp_path / "journal")).digest == live
    s = KVStore.open(cfg)  # nothing cut this time: the gap alone
    assert s.recovery.cut_bytes == 0 and s.activate(10, 10) > max(new)
    s.close()


def test_a_cut_that_takes_reopen_records_still_skips_their_ids(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: a reopen record moves the next id on by ``ID_GAP`` in a few bytes, so
    counting bytes cut does not bound the ids of a cut that takes reopen records. The first
    id of the last reopen is kept outside the log (``journal.ids.NEXT_ID``), and the next
    reopen starts past it too (a gap of 4,096 here: larger than the bytes cut)."""
    from ninfer_kv.engine.opening import CODEC
    monkeypatch.setattr(state_mod, "ID_GAP", 4096)
    from ninfer_kv.journal.log import Journal, JournalOptions
    cfg, handed, start, end = first_record(tmp_path, SyncPolicy.OFF)
    for _ in range(3):  # three reopens, one id each
        s = KVStore.open(cfg)
        handed.append(s.activate(10, 10))
        step(s)
        s.close()
    _flip(tmp_path / "journal" / "seg-00000001.log", (start + end) // 2)
    Journal.open(str(tmp_path / "journal"), CODEC, JournalOptions(salvage=True)).close()
    s = KVStore.open(cfg)
    assert s.recovery.cut_bytes < 4096 and s.state.next_bundle > max(handed), handed
    s.close()


@pytest.mark.parametrize("text", [b"junk\n", b"-5\n", b"", b"12 \n junk"])
@pytest.mark.parametrize("name", ["CUT", "NEXT_ID"])
def test_a_damaged_id_file_refuses_the_open(tmp_path: Path, name: str, text: bytes) -> None:
    """Review finding: a ``CUT`` that was not a count was read as 2**31 (the journal's ids
    spent for good, the file removed) or, negative, as 0. Such a file now refuses the open,
    naming it, and stays for an operator to fix."""
    from ninfer_kv.errors import JournalCorrupt
    cfg = small_config(tmp_path, allocate_planes=False)
    KVStore.open(cfg).close()
    (tmp_path / "journal" / name).write_bytes(text)
    with pytest.raises(JournalCorrupt, match=name):
        KVStore.open(cfg)
    assert (tmp_path / "journal" / name).read_bytes() == text


def test_an_id_file_that_is_no_regular_file_is_a_journal_error(tmp_path: Path) -> None:
    """Review finding: a ``CUT`` that is a directory made the open raise a bare OSError."""
    from ninfer_kv.errors import JournalError
    cfg = small_config(tmp_path, allocate_planes=False)
    KVStore.open(cfg).close()
    (tmp_path / "journal" / "CUT").mkdir()
    with pytest.raises(JournalError, match="CUT"):
        KVStore.open(cfg)


def test_an_id_file_that_cannot_be_written_refuses_the_open(tmp_path: Path) -> None:
    """``NEXT_ID`` is written before the reopen record; when it cannot be (here its temp
    file's name is taken by a directory) the open is refused with a JournalError, not a bare
    OSError; once it can be, the store opens with the history it had."""
    from ninfer_kv.errors import JournalError
    cfg = small_config(tmp_path, allocate_planes=False)
    s = KVStore.open(cfg)
    a = s.activate(10, 10)
    step(s)
    s.finish(a, retain=True)
    s.close()
    (tmp_path / "journal" / "NEXT_ID.tmp").mkdir()
    with pytest.raises(JournalError, match="cannot write"):
        KVStore.open(cfg)
    (tmp_path / "journal" / "NEXT_ID.tmp").rmdir()
    s = KVStore.open(cfg)
    assert a in s.state.bundles and not s.state.bundles[a].active
    s.close()


def test_ids_of_compacted_segments_stay_below_a_salvaged_reopen(tmp_path: Path,
                                                                small_gap: int) -> None:
    """Review finding: after ``compact()`` the only segment left held no record; a damaged
    header then made the salvage cut it, and the store reopened unconfigured with the ids of
    the removed segments counted nowhere. A compaction now raises ``NEXT_ID`` to the next id
    before it removes segments."""
    import glob

    from ninfer_kv.engine.opening import CODEC
    from ninfer_kv.errors import JournalCorrupt
    from ninfer_kv.journal.log import Journal, JournalOptions
    cfg = small_config(tmp_path, concurrency=16, allocate_planes=False)
    s = KVStore.open(cfg)
    handed = _many(s, 200)  # more than the gap and the 40 bytes of header a salvage cuts
    s.snapshot()
    s.compact()
    s.close()
    seg = sorted(glob.glob(str(tmp_path / "journal" / "seg-*.log")))[0]
    _flip(Path(seg), 8)  # its header
    with pytest.raises(JournalCorrupt):
        KVStore.open(cfg)
    Journal.open(str(tmp_path / "journal"), CODEC, JournalOptions(salvage=True)).close()
    s = KVStore.open(cfg)
    assert s.state.next_bundle > max(handed)
    s.close()
