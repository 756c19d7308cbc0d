"""Journal: framing, chain, rotation, sync policies, fault handling, snapshots."""

from __future__ import annotations

import io
import json
import os
import random

import msgspec
import pytest

from ninfer_kv.errors import JournalCorrupt, JournalError, JournalFailed, SchemaVersionError
from ninfer_kv.journal.events import CODEC, CommitFrontiers, EventCodec, Trim, pack, unpack
from ninfer_kv.journal.format import SEG_HEADER_SIZE, segment_name
from ninfer_kv.journal.log import Journal, JournalOptions, SyncPolicy
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.journal.recovery import scan
from ninfer_kv.journal.restore import recover_state
from tests.journal.crashfs import CrashFS

D = "/j"


def batch(seq: int, n: int = 3) -> list:
    return [CommitFrontiers("main", pack(range(n)), pack([seq] * n)), Trim(seq, "mtp", seq % 7)]


def write_log(fs: CrashFS, n: int, sync: SyncPolicy = SyncPolicy.COMMIT, **kw) -> Journal:
    j = Journal.open(D, CODEC, JournalOptions(sync=sync, **kw), fs=fs)
    for s in range(1, n + 1):
        assert j.append(batch(s)) == s
    return j


def payloads(fs: CrashFS) -> dict[int, list]:
    r = JournalReader(D, fs=fs)
    return dict(r.records())


def test_roundtrip_and_rotation() -> None:
    fs = CrashFS()
    j = write_log(fs, 200, segment_bytes=2048)
    j.close()
    assert len([n for n in fs.listdir(D) if n.startswith("seg-")]) > 3
    got = payloads(fs)
    assert sorted(got) == list(range(1, 201))
    assert all(got[s] == batch(s) for s in got)
    j2 = Journal.open(D, CODEC, fs=fs)  # reopen continues the chain in a fresh segment
    assert j2.last_seq == 200 and j2.append(batch(201)) == 201
    assert payloads(fs)[201] == batch(201)


def test_sync_policies_durable_seq() -> None:
    fs = CrashFS()
    j = write_log(fs, 5, SyncPolicy.OFF)
    assert j.durable_seq == 0
    assert j.sync() == 5 and j.durable_seq == 5
    t = [0.0]
    fs2 = CrashFS()
    j = Journal(D, CODEC, JournalOptions(sync=SyncPolicy.INTERVAL, interval_ms=10), fs2,
                scan(D, schema_major=1, fs=fs2) if fs2.listdir(D) else _empty_scan(fs2),
                clock=lambda: t[0])
    j.append(batch(1))
    assert j.durable_seq == 0  # within the interval: no fsync
    t[0] = 0.02
    j.append(batch(2))
    assert j.durable_seq == 2


def _empty_scan(fs: CrashFS):
    fs.makedirs(D)
    return scan(D, schema_major=1, fs=fs)


def test_fsync_error_is_fatal() -> None:
    fs = CrashFS()
    j = write_log(fs, 3)
    fs.fail_fsync_after = 0
    with pytest.raises(JournalFailed, match="EIO"):
        j.append(batch(4))
    fs.fail_fsync_after = None
    with pytest.raises(JournalFailed, match="failed earlier"):
        j.append(batch(5))
    with pytest.raises(JournalFailed):
        j.sync()


class _Counted:
    """A CrashFS file whose close is counted (and can fail, as close(2) can with EIO)."""

    def __init__(self, fs: OpenFilesFS, f: object) -> None:
        self.fs, self.f = fs, f
        fs.open_files += 1

    def __getattr__(self, name: str) -> object:
        return getattr(self.f, name)

    def close(self) -> None:
        self.fs.open_files -= 1  # the descriptor is gone even when close reports an error
        if self.fs.fail_close:
            raise OSError(5, "injected EIO on close")


class OpenFilesFS(CrashFS):
    def __init__(self) -> None:
        super().__init__()
        self.open_files = 0
        self.fail_close = False

    def create(self, path: str) -> _Counted:  # type: ignore[override]
        return _Counted(self, super().create(path))

    def open_append(self, path: str) -> _Counted:  # type: ignore[override]
        return _Counted(self, super().open_append(path))


@pytest.mark.parametrize("failing", ["snapshot", "rotation", "open"])
def test_a_failed_write_closes_its_descriptor(failing: str) -> None:
    """Review finding: a failed fsync of a snapshot's or a new segment's temp file, or of
    the last segment when a journal opens, left its descriptor open (one leaked per
    fail-stop and reopen)."""
    fs = OpenFilesFS()
    j = write_log(fs, 3)
    if failing == "open":
        j.close()
        fs.fail_fsync_after = 0
        with pytest.raises(Exception, match="EIO"):
            Journal.open(D, CODEC, JournalOptions(), fs=fs)
        assert fs.open_files == 0
        return
    fs.fail_fsync_after = 0  # the log is synced already: the temp file's fsync fails
    with pytest.raises(JournalFailed, match="EIO"):
        if failing == "snapshot":
            j.write_snapshot(b"state")
        else:
            j._end_segment()
    fs.fail_fsync_after = None
    j.close()
    assert fs.open_files == 0


def test_a_failed_close_fails_the_journal_and_forgets_the_descriptor() -> None:
    """Review finding: when close(2) failed (the kernel frees the descriptor anyway) the
    journal kept it and was not failed, so the next append wrote its frame into whatever
    file reused the number and was acknowledged."""
    fs = OpenFilesFS()
    j = write_log(fs, 2)
    fs.fail_close = True
    with pytest.raises(JournalFailed, match="EIO on close"):
        j.close()
    fs.fail_close = False
    with pytest.raises((JournalFailed, JournalError)):
        j.append(batch(3))
    assert fs.open_files == 0


def test_newer_schema_major_refused() -> None:
    fs = CrashFS()
    codec = EventCodec()
    codec.schema = (2, 0)  # type: ignore[misc]
    j = Journal.open(D, codec, fs=fs)
    j.append(batch(1))
    with pytest.raises(SchemaVersionError, match="2.0.*major 1"):
        JournalReader(D, fs=fs)


def _last_records(fs: CrashFS, k: int) -> tuple[str, list[int]]:
    """Path of the newest segment holding records, and the start offsets of its last k."""
    res = scan(D, schema_major=1, fs=fs, repair=False)
    seg = [s for s in res.segments if s.frames][-1]
    return seg.path, [f.offset for f in seg.frames[-k:]]


def test_truncate_every_offset_of_last_three_records() -> None:
    fs = CrashFS()
    write_log(fs, 12).close()
    path, offs = _last_records(fs, 3)
    full = fs.read(path)
    for cut in range(offs[0], len(full)):
        img = _clone(fs)
        img.files[path].durable = bytearray(full[:cut])
        r = scan(D, schema_major=1, fs=img)
        expect = 9 + sum(1 for o in offs[1:] if o <= cut)
        assert r.last_seq == expect, cut
        assert len(img.read(path)) == (offs[expect - 9] if expect < 12 else len(full))
        assert payloads(img) == {s: batch(s) for s in range(1, expect + 1)}


def test_flip_every_bit_of_last_record() -> None:
    fs = CrashFS()
    write_log(fs, 6).close()
    path, (off,) = _last_records(fs, 1)
    full = fs.read(path)
    for bit in range((len(full) - off) * 8):
        img = _clone(fs)
        b = bytearray(full)
        b[off + bit // 8] ^= 1 << (bit % 8)
        img.files[path].durable = b
        r = scan(D, schema_major=1, fs=img)
        assert r.last_seq == 5 and r.cuts and r.cuts[0].offset == off
        assert payloads(img) == {s: batch(s) for s in range(1, 6)}


@pytest.mark.parametrize("victim", [1, 4, 8])
def test_mid_log_damage_raises(victim: int) -> None:
    fs = CrashFS()
    write_log(fs, 10).close()
    res = scan(D, schema_major=1, fs=fs, repair=False)
    seg = [s for s in res.segments if s.frames][0]
    frame = seg.frames[victim - 1]
    for pos in (frame.offset + 2, frame.offset + 30, frame.end - 1):
        img = _clone(fs)
        img.files[seg.path].durable[pos] ^= 0x40
        with pytest.raises(JournalCorrupt) as ei:
            scan(D, schema_major=1, fs=img)
        assert ei.value.offset == frame.offset and ei.value.segment == seg.header.segment_no
        salv = scan(D, schema_major=1, fs=img, salvage=True)
        assert salv.last_seq == victim - 1 and salv.salvaged
        assert payloads(img) == {s: batch(s) for s in range(1, victim)}


def test_mid_log_damage_in_earlier_segment_raises() -> None:
    fs = CrashFS()
    write_log(fs, 60, SyncPolicy.OFF, segment_bytes=1024).close()
    first = os.path.join(D, segment_name(1))
    fs.files[first].durable[SEG_HEADER_SIZE + 5] ^= 1
    with pytest.raises(JournalCorrupt):
        scan(D, schema_major=1, fs=fs)


def _clone(fs: CrashFS) -> CrashFS:
    return fs.crash(random.Random(0), modes=("keep",))


def test_crash_keeps_everything_synced_and_nothing_garbled() -> None:
    rng = random.Random(1234)
    for trial in range(300):
        fs = CrashFS()
        policy = rng.choice(list(SyncPolicy))
        j = Journal.open(D, CODEC, JournalOptions(sync=policy, interval_ms=0.0 if rng.random() < .5
                                                  else 1e9, segment_bytes=rng.choice([512, 4096])),
                         fs=fs)
        n = rng.randint(0, 40)
        written_batches = {}
        for s in range(1, n + 1):
            written_batches[s] = batch(s, rng.randint(0, 9))
            j.append(written_batches[s], durable=rng.random() < 0.6)  # commit: marked only
            if rng.random() < 0.1:
                j.sync()
        durable, written = j.durable_seq, j.last_seq
        img = fs.crash(rng)
        j2 = Journal.open(D, CODEC, fs=img)
        assert durable <= j2.last_seq <= written, (trial, policy)
        got = dict(JournalReader(D, fs=img).records())
        # exactly the written records 1..last: nothing garbled, nothing after a damaged byte
        assert got == {s: written_batches[s] for s in range(1, j2.last_seq + 1)}
        # and the recovered log accepts appends that survive the next crash
        j2.append(batch(j2.last_seq + 1))
        j2.sync()
        assert JournalReader(D, fs=img.crash(rng)).last_seq == j2.last_seq


def test_ndjson_export() -> None:
    fs = CrashFS()
    write_log(fs, 3).close()
    out = io.BytesIO()
    assert JournalReader(D, fs=fs).export_ndjson(out) == 6
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines[0] == {"seq": 1, "i": 0, "type": "commit", "pool": "main",
                        "bundles": [0, 1, 2], "frontiers": [1, 1, 1]}
    assert lines[5]["type"] == "trim" and lines[5]["seq"] == 3


# --- snapshots ----------------------------------------------------------------------------------
class Counter(msgspec.Struct):
    total: int = 0
    records: int = 0


def _apply(state: Counter, seq: int, payload: memoryview) -> None:
    for ev in CODEC.decode(payload):
        if isinstance(ev, CommitFrontiers):
            state.total += int(unpack(ev.frontiers).sum())
    state.records += 1


def _recover(fs: CrashFS) -> tuple[Counter, int]:
    st, last, _ = recover_state(D, schema_major=1, initial=Counter,
                                load_snapshot=lambda b: msgspec.msgpack.decode(b, type=Counter),
                                apply_record=_apply, fs=fs)
    return st, last


def test_snapshot_then_tail_and_corrupt_snapshot_fallback() -> None:
    fs = CrashFS()
    j = write_log(fs, 10)
    ref = Counter()
    for s in range(1, 11):
        _apply(ref, s, memoryview(CODEC.encode(batch(s))))
    j.write_snapshot(msgspec.msgpack.encode(ref))
    j.write_snapshot(msgspec.msgpack.encode(ref))  # same seq twice is fine
    for s in range(11, 16):
        j.append(batch(s))
        _apply(ref, s, memoryview(CODEC.encode(batch(s))))
    j.write_snapshot(msgspec.msgpack.encode(Counter(-1, -1)))  # a snapshot recovery must NOT use
    snaps = sorted(n for n in fs.listdir(D) if n.startswith("snap-"))
    newest = os.path.join(D, snaps[-1])
    fs.files[newest].durable[-1] ^= 0xFF  # payload CRC now fails -> fall back to seq 10 + tail
    st, last = _recover(fs)
    assert last == 15 and st == ref
    for name in snaps:
        fs.files[os.path.join(D, name)].durable[3] ^= 1  # every snapshot bad -> full log
    st, _ = _recover(fs)
    assert st == ref


def test_compact_then_recover_from_snapshot_and_tail() -> None:
    fs = CrashFS()
    j = write_log(fs, 40, segment_bytes=1024)
    ref = Counter()
    for s in range(1, 41):
        _apply(ref, s, memoryview(CODEC.encode(batch(s))))
    j.write_snapshot(msgspec.msgpack.encode(ref))
    for s in range(41, 61):
        j.append(batch(s))
        _apply(ref, s, memoryview(CODEC.encode(batch(s))))
    segs_before = [n for n in fs.listdir(D) if n.startswith("seg-")]
    assert j.compact() > 0
    segs_after = [n for n in fs.listdir(D) if n.startswith("seg-")]
    assert len(segs_after) < len(segs_before)
    j.close()
    st, last = _recover(fs)  # the chain restarts at the first kept segment
    assert last == 60 and st == ref
    assert JournalReader(D, fs=fs).scan.first_seq > 1
    for name in fs.listdir(D):  # without the snapshot the compacted log cannot be replayed
        if name.startswith("snap-"):
            fs.remove(f"{D}/{name}")
    with pytest.raises(JournalCorrupt, match="compacted"):
        _recover(fs)


class _RacingFS(CrashFS):
    """Runs ``hook`` once, right after a segment's bytes were read: a writer appending while a
    read-only tool scans."""

    def __init__(self) -> None:
        super().__init__()
        self.hook = None

    def read(self, path: str, limit: int = -1) -> bytes:
        data = super().read(path, limit)
        if self.hook is not None and path.endswith(".log") and limit < 0:
            hook, self.hook = self.hook, None
            hook()
        return data


def test_a_snapshot_written_while_a_reader_scans_is_no_proof_of_loss() -> None:
    """A snapshot past the log's end proves records were lost — unless it was written after
    the reader read the log (a live store's directory): the scan lists snapshots first."""
    fs = _RacingFS()
    j = write_log(fs, 5)

    def writer() -> None:
        j.append(batch(6))
        j.write_snapshot(b"state")

    fs.hook = writer
    res = scan(D, schema_major=1, fs=fs, repair=False)
    assert res.last_seq == 5 and res.cuts == []
    assert scan(D, schema_major=1, fs=fs, repair=False).last_seq == 6


@pytest.mark.parametrize("damage", ["header", "lost segment"])
def test_salvage_cuts_at_a_damaged_segment_header_or_a_gap(damage: str) -> None:
    """Review finding: salvage refused (JournalCorrupt) a log whose damage hit the header of a
    segment that is not the last, or a log missing a middle segment. It keeps the segments
    before the damage, cuts the rest and reports it; without salvage it is still refused."""
    fs = CrashFS()
    j = write_log(fs, 40, segment_bytes=1024)
    j.close()
    segs = sorted(p for p in fs.files if p.endswith(".log"))
    assert len(segs) >= 4
    if damage == "header":
        fs.files[segs[2]].durable[20] ^= 1
    else:
        del fs.files[segs[2]]
    with pytest.raises(JournalCorrupt):
        JournalReader(D, fs=fs)
    kept = JournalReader(D, fs=fs, salvage=True)
    last = kept.last_seq
    assert 0 < last < 40 and list(dict(kept.records())) == list(range(1, last + 1))
    assert len(kept.scan.cuts) == 1 and kept.scan.cuts[0].reason.startswith("salvage")
    j = Journal.open(D, CODEC, JournalOptions(salvage=True), fs=fs)
    assert j.last_seq == last and j.append(batch(last + 1)) == last + 1
    j.close()
    assert JournalReader(D, fs=fs).last_seq == last + 1  # a sound log again, no salvage


@pytest.mark.parametrize("size", [0, 20, SEG_HEADER_SIZE - 1, SEG_HEADER_SIZE])
def test_a_last_segment_cut_into_its_header_is_damage_not_a_torn_creation(size: int) -> None:
    """Review finding: the last segment cut to at most a header's length was dropped as a
    "torn segment creation", with every acknowledged record in it — but a segment gets its
    final name only after its header was fsynced (docs/journal-format.md), so no crash leaves
    that. It is refused like any damaged header; salvage cuts it and keeps the segments
    before it."""
    fs = CrashFS()
    j = write_log(fs, 40, segment_bytes=1024)
    j.close()
    segs = sorted(p for p in fs.files if p.endswith(".log"))
    first_of_last = JournalReader(D, fs=fs).scan.segments[-1].header.first_seq
    node = fs.files[segs[-1]]
    node.durable = node.durable[:size]
    if size == SEG_HEADER_SIZE:
        node.durable[36] ^= 1  # a whole header, its CRC broken
    with pytest.raises(JournalCorrupt, match=f"segment {len(segs)}"):
        JournalReader(D, fs=fs)
    with pytest.raises(JournalCorrupt):
        Journal.open(D, CODEC, JournalOptions(), fs=fs)
    kept = JournalReader(D, fs=fs, salvage=True)
    assert kept.last_seq == first_of_last - 1 and kept.scan.salvaged


@pytest.mark.parametrize("later", ["short", "bad crc", "empty"])
def test_damage_before_a_later_segment_with_a_bad_header_is_corruption(later: str) -> None:
    """Review finding: a damaged record in segment N was judged a torn tail (cut, with every
    acknowledged record after it) when segment N+1's header did not parse, since only a later
    segment with a sound header counted as proof. Any later segment proves N was fsynced:
    rotation syncs first, and a segment gets its final name only with a durable header."""
    fs = CrashFS()
    j = write_log(fs, 40, segment_bytes=1024)
    j.close()
    segs = sorted(p for p in fs.files if p.endswith(".log"))
    assert len(segs) >= 3
    fs.files[segs[-2]].durable[-1] ^= 1           # the last record of the segment before
    node = fs.files[segs[-1]]
    node.durable = {"short": node.durable[:20], "empty": bytearray(),
                    "bad crc": node.durable[:36] + bytes(4) + node.durable[40:]}[later]
    with pytest.raises(JournalCorrupt, match=f"segment {len(segs) - 1}"):
        JournalReader(D, fs=fs)
    with pytest.raises(JournalCorrupt):
        Journal.open(D, CODEC, JournalOptions(), fs=fs)
    kept = JournalReader(D, fs=fs, salvage=True)
    assert kept.scan.salvaged and kept.last_seq < 40
