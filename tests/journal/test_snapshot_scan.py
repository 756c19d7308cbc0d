"""Recovery starts at the newest snapshot's segment (docs/journal-format.md, "Recovery").

A snapshot ends its segment, so the next record opens a segment whose header names the
snapshot's record CRC; recovery reads segment headers only up to there and scans from it. If
that snapshot is not usable the whole log is read, as before.
"""

from __future__ import annotations

import os

import msgspec
import pytest

from ninfer_kv.errors import JournalCorrupt
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import (
    SEG_HEADER_SIZE,
    SegmentHeader,
    Snapshot,
    pack_snapshot,
    parse_snapshot,
    snapshot_name,
)
from ninfer_kv.journal.log import Journal, JournalOptions, SyncPolicy
from ninfer_kv.journal.recovery import scan
from ninfer_kv.journal.restore import snapshot_segment, usable_snapshots
from tests.journal.crashfs import CrashFS
from tests.journal.test_journal import Counter, D, _apply, _recover, batch, write_log


class CountingFS(CrashFS):
    """Counts whole-file reads per path (a header read passes a limit)."""

    def __init__(self) -> None:
        super().__init__()
        self.full_reads: dict[str, int] = {}

    def read(self, path: str, limit: int = -1) -> bytes:
        if limit < 0:
            self.full_reads[path] = self.full_reads.get(path, 0) + 1
        return super().read(path, limit)


def segs(fs: CrashFS) -> list[str]:
    return sorted(os.path.join(D, n) for n in fs.listdir(D) if n.startswith("seg-"))


def reference(n: int) -> Counter:
    ref = Counter()
    for s in range(1, n + 1):
        _apply(ref, s, memoryview(CODEC.encode(batch(s))))
    return ref


def log_with_snapshot(fs: CrashFS, before: int = 40, after: int = 40) -> Journal:
    j = write_log(fs, before, segment_bytes=1024)
    j.write_snapshot(msgspec.msgpack.encode(reference(before)))
    for s in range(before + 1, before + after + 1):
        j.append(batch(s))
    j.close()
    return j


def test_a_snapshot_ends_its_segment() -> None:
    fs = CrashFS()
    j = write_log(fs, 5)
    j.write_snapshot(msgspec.msgpack.encode(reference(5)))
    j.append(batch(6))
    j.close()
    hdr = SegmentHeader.parse(fs.read(segs(fs)[-1]))
    snap = parse_snapshot(fs.read(os.path.join(D, snapshot_name(5))))
    assert isinstance(hdr, SegmentHeader) and isinstance(snap, Snapshot)
    assert (hdr.first_seq, hdr.prev_crc) == (6, snap.last_crc)
    assert snapshot_segment(D, 1, fs) == hdr.segment_no == 2


def test_recovery_reads_only_the_segments_after_the_snapshot() -> None:
    fs = CountingFS()
    log_with_snapshot(fs)
    first = snapshot_segment(D, 1, fs)
    covered = [p for p in segs(fs) if int(p[-12:-4]) < first]
    assert len(covered) > 2 and len(segs(fs)) > len(covered) + 1
    fs.full_reads.clear()
    st, last = _recover(fs)
    assert last == 80 and st == reference(80)
    assert not any(fs.full_reads.get(p) for p in covered), fs.full_reads


def test_damage_in_a_covered_segment_is_compacted_not_read() -> None:
    fs = CrashFS()
    j = log_with_snapshot(fs)
    first = segs(fs)[0]
    fs.files[first].durable[SEG_HEADER_SIZE + 30] ^= 0xFF  # a record the snapshot covers
    st, last = _recover(fs)
    assert last == 80 and st == reference(80)
    j2 = Journal.open(D, CODEC, fs=fs)
    assert j2.compact() > 0 and first not in segs(fs)
    j2.close()
    del j


@pytest.mark.parametrize("which", [0, 1])
def test_a_damaged_header_in_a_covered_segment_is_not_read(which: int) -> None:
    """Review finding: the scan's start walked segment headers from the first and stopped at
    one that did not parse, so a damaged header the snapshot covers made recovery start at
    segment 1 and refuse the journal — and salvage then cut every record after it, the
    snapshot's and the acknowledged ones after it included. A covered header is not read."""
    fs = CrashFS()
    j = log_with_snapshot(fs)
    start = snapshot_segment(D, 1, fs)
    damaged = segs(fs)[which]
    assert start is not None and int(damaged[-12:-4]) < start
    fs.files[damaged].durable[5] ^= 0x01  # inside the header (its CRC no longer matches)
    assert snapshot_segment(D, 1, fs) == start
    st, last = _recover(fs)
    assert last == 80 and st == reference(80)
    j2 = Journal.open(D, CODEC, fs=fs, options=JournalOptions(salvage=True))
    assert j2.recovery.cuts == [] and j2.last_seq == 80
    assert j2.compact() > 0 and damaged not in segs(fs)
    j2.close()
    del j


def test_a_damaged_header_after_the_snapshot_is_refused() -> None:
    fs = CrashFS()
    log_with_snapshot(fs)
    start = snapshot_segment(D, 1, fs)
    later = [p for p in segs(fs) if int(p[-12:-4]) > start]
    assert later
    fs.files[later[0]].durable[5] ^= 0x01
    with pytest.raises(JournalCorrupt, match="header"):
        _recover(fs)
    with pytest.raises(JournalCorrupt, match="header"):
        Journal.open(D, CODEC, fs=fs)


def test_an_unusable_newest_snapshot_falls_back_to_the_whole_log() -> None:
    fs = CountingFS()
    log_with_snapshot(fs)
    # a well-formed snapshot at seq 80 that names the wrong CRC: not on this log's chain
    path = os.path.join(D, snapshot_name(80))
    f = fs.create(path)
    f.write(pack_snapshot(1, 80, 0xDEADBEEF, msgspec.msgpack.encode(Counter(-1, -1))))
    f.close()
    fs.full_reads.clear()
    st, last = _recover(fs)  # the older snapshot at 40 is used, from the whole log
    assert last == 80 and st == reference(80)
    assert fs.full_reads.get(segs(fs)[0])
    fs.files[os.path.join(D, snapshot_name(40))].durable[-1] ^= 1  # now neither is usable
    st, last = _recover(fs)
    assert last == 80 and st == reference(80)
    assert fs.full_reads.get(segs(fs)[0]), "the fallback must read the whole log"


def test_damage_before_an_unusable_snapshot_is_still_refused() -> None:
    fs = CrashFS()
    log_with_snapshot(fs)
    fs.files[segs(fs)[0]].durable[SEG_HEADER_SIZE + 30] ^= 0xFF
    path = os.path.join(D, snapshot_name(40))  # well-formed, but off this log's chain
    f = fs.create(path)
    f.write(pack_snapshot(1, 40, 0xDEADBEEF, msgspec.msgpack.encode(reference(40))))
    f.close()
    with pytest.raises(JournalCorrupt, match="segment 1"):
        Journal.open(D, CODEC, fs=fs)
    with pytest.raises(JournalCorrupt, match="segment 1"):
        _recover(fs)


def test_a_snapshot_in_the_middle_of_a_segment_is_found_by_walking_it() -> None:
    fs = CrashFS()
    j = write_log(fs, 12)
    j.write_snapshot(msgspec.msgpack.encode(reference(12)))
    j.close()
    for p in segs(fs)[1:]:  # the crash came before the snapshot's segment was ended
        fs.remove(p)
    j = Journal.open(D, CODEC, fs=fs)
    for s in range(13, 16):
        j.append(batch(s))
    j.close()
    st, last = _recover(fs)
    assert last == 15 and st == reference(15)


def test_without_a_usable_snapshot_a_compacted_log_is_refused() -> None:
    fs = CrashFS()
    j = log_with_snapshot(fs)
    j2 = Journal.open(D, CODEC, fs=fs)
    assert j2.compact() > 0
    j2.close()
    del j
    for name in fs.listdir(D):
        if name.startswith("snap-"):
            fs.files[os.path.join(D, name)].durable[-1] ^= 1
    with pytest.raises(JournalCorrupt, match="compacted"):
        _recover(fs)


def test_a_snapshot_whose_payload_does_not_decode_falls_back_to_the_whole_log() -> None:
    fs = CountingFS()
    j = write_log(fs, 40, segment_bytes=1024)
    j.write_snapshot(b"not a Counter")  # on the chain, but the engine cannot load it
    for s in range(41, 46):
        j.append(batch(s))
    j.close()
    fs.full_reads.clear()
    st, last = _recover(fs)
    assert last == 45 and st == reference(45)
    assert fs.full_reads.get(segs(fs)[0])


def test_a_torn_tail_after_the_snapshot_is_cut_on_disk() -> None:
    fs = CrashFS()
    log_with_snapshot(fs)
    last = segs(fs)[-1]
    fs.files[last].durable = fs.files[last].durable[:-3]  # the last record is torn
    torn = len(fs.read(last))
    st, end = _recover(fs)
    assert end == 79 and st == reference(79)
    assert len(fs.read(last)) < torn, "recovery with repair=True must cut the torn bytes"


def test_compaction_keeps_what_the_older_snapshot_needs() -> None:
    """Review finding: compaction read the log from the newest snapshot only and removed the
    segments the older one needs; a damaged newest snapshot then left nothing to recover."""
    fs = CrashFS()
    j = write_log(fs, 40, segment_bytes=1024)
    j.write_snapshot(msgspec.msgpack.encode(reference(40)))
    for s in range(41, 81):
        j.append(batch(s))
    j.write_snapshot(msgspec.msgpack.encode(reference(80)))
    for s in range(81, 91):
        j.append(batch(s))
    assert j.compact() > 0
    j.close()
    fs.files[os.path.join(D, snapshot_name(80))].durable[50] ^= 1  # the newest is damaged
    st, last = _recover(fs)
    assert last == 90 and st == reference(90)


@pytest.mark.parametrize("non_durable", [1, 4])
def test_a_durable_record_proves_the_non_durable_ones_before_it(non_durable: int) -> None:
    """Review findings: under sync=commit a durable record written after non-durable ones
    carried a stale durable_seq, so damage in those let recovery cut the acknowledged durable
    record as a torn tail (one non-durable record). And damage was judged by the first valid
    record after it only: with several non-durable records (decode rounds, stamped with an
    older durable_seq) between the damage and the acknowledged record, recovery cut it and
    everything after (four). Both are mid-log corruption."""
    fs = CrashFS()
    j = Journal.open(D, CODEC, JournalOptions(sync=SyncPolicy.COMMIT), fs=fs)
    j.append(batch(1))
    for s in range(2, 2 + non_durable):
        j.append(batch(s), durable=False)  # stamped durable_seq 1
    j.append(batch(2 + non_durable))  # acknowledged durable: fsyncs the ones before it first
    assert j.durable_seq == 2 + non_durable
    j.close()
    seg = segs(fs)[-1]
    data = fs.read(seg)
    second = data.index(CODEC.encode(batch(2)))  # inside record 2's payload
    fs.files[seg].durable[second + 3] ^= 0xFF
    with pytest.raises(JournalCorrupt, match="proves seq 2"):
        scan(D, schema_major=1, fs=fs)


def test_a_record_no_reader_would_accept_is_never_written(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    from ninfer_kv.errors import JournalError
    from ninfer_kv.journal import log

    monkeypatch.setattr(log, "MAX_PAYLOAD", 64)
    fs = CrashFS()
    j = write_log(fs, 2)
    before = fs.read(segs(fs)[-1])
    with pytest.raises(JournalError, match="MAX_PAYLOAD=64; nothing was written"):
        j.append_payload(b"y" * 65)
    assert fs.read(segs(fs)[-1]) == before and j.last_seq == 2
    assert j.append(batch(3)) == 3  # the journal is still usable


def test_a_failed_close_when_a_segment_ends_stops_the_journal() -> None:
    from ninfer_kv.errors import JournalFailed

    fs = CrashFS()
    j = write_log(fs, 3)

    def broken_close() -> None:
        raise OSError(5, "EIO")

    j._file.close = broken_close  # type: ignore[union-attr,method-assign]
    with pytest.raises(JournalFailed, match="closing segment"):
        j.write_snapshot(msgspec.msgpack.encode(reference(3)))
    with pytest.raises(JournalFailed):
        j.append(batch(4))


def test_each_skipped_snapshot_says_which_rule_it_broke() -> None:
    """Newest first: a snapshot past the log's last record, and a file whose header names
    another seq than its name (a copy of the snapshot at 40) — each skipped with its own
    reason, not a later rule's; the snapshot at 40 is the one used. (The snapshot past the
    end proves records were lost: only a salvaging scan goes on to list the snapshots.)"""
    fs = CrashFS()
    log_with_snapshot(fs)  # snapshot at 40, records to 80
    snap40 = fs.read(os.path.join(D, snapshot_name(40)))
    for seq, body in ((120, pack_snapshot(1, 120, 0, msgspec.msgpack.encode(reference(40)))),
                      (90, snap40)):
        f = fs.create(os.path.join(D, snapshot_name(seq)))
        f.write(body)
        f.close()
    with pytest.raises(JournalCorrupt, match="snapshot 120 proves records through 120"):
        scan(D, schema_major=1, fs=fs, repair=False)
    got = list(usable_snapshots(D, scan(D, schema_major=1, fs=fs, repair=False, salvage=True),
                                1, fs))
    assert got[:2] == [f"{snapshot_name(120)}: seq 120 beyond the log's last valid record 80",
                       f"{snapshot_name(90)}: header says seq 40"]
    assert isinstance(got[2], Snapshot) and got[2].seq == 40 and len(got) == 3
