"""Scan a journal directory: accept the longest valid prefix, cut a torn tail, refuse
mid-log corruption. Rules: docs/journal-format.md. Recovering a state from it (the newest
usable snapshot, then the tail) is journal/restore.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog

from ninfer_kv.errors import JournalCorrupt, JournalError, SchemaVersionError
from ninfer_kv.journal.format import (
    FRAME_OVERHEAD,
    FRAME_SIZE,
    SEG_HEADER_SIZE,
    SEG_RE,
    SNAP_RE,
    Frame,
    SegmentHeader,
    parse_frame,
    parse_snapshot,
)
from ninfer_kv.journal.frames import FrameTable, scan_frames
from ninfer_kv.journal.fs import OS_FS, FileSystem, cannot_read

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Cut:
    segment: int
    offset: int
    bytes_cut: int
    reason: str

    def __str__(self) -> str:
        return f"segment {self.segment} @ {self.offset}: {self.bytes_cut} B ({self.reason})"


@dataclass(slots=True)
class SegmentScan:
    number: int
    path: str
    header: SegmentHeader
    frames: FrameTable
    data: bytes


@dataclass(slots=True)
class ScanResult:
    segments: list[SegmentScan] = field(default_factory=list)
    cuts: list[Cut] = field(default_factory=list)
    last_seq: int = 0
    last_crc: int = 0
    salvaged: bool = False
    repairs: list[tuple[str, str, int]] = field(default_factory=list)
    """What cutting the damage takes on disk: ("truncate", path, size) / ("remove", path, 0)
    / ("stale", path, 0): a salvaged snapshot past the cut, renamed ``<name>.stale``.
    ``scan(repair=False)`` only lists them; :func:`apply_repairs` carries them out."""

    def crc_of(self, seq: int) -> int | None:
        """The CRC of record ``seq`` in the valid log — or, for the record just before the
        first one kept (a compacted log), the first segment header's ``prev_crc``."""
        if self.segments and seq == self.first_seq - 1:
            return self.segments[0].header.prev_crc
        for seg in self.segments:
            if len(seg.frames) and seg.frames.first_seq() <= seq <= seg.frames.last_seq():
                return seg.frames[seq - seg.frames.first_seq()].crc
        return None

    def segment_of(self, seq: int) -> int:
        """The number of the segment holding accepted record ``seq``."""
        return next(s.number for s in self.segments
                    if len(s.frames) and s.frames.last_seq() >= seq)

    @property
    def records(self) -> int:
        return sum(len(s.frames) for s in self.segments)

    @property
    def first_seq(self) -> int:
        return self.segments[0].header.first_seq if self.segments else 1


def _numbered(directory: str, pattern: re.Pattern[str], fs: FileSystem) -> list[tuple[int, str]]:
    """(number, path) of the files whose name matches ``pattern``, in number order."""
    out = []
    try:
        names = fs.listdir(directory)
    except OSError as exc:
        raise JournalError(f"cannot list journal directory {directory}: {exc.strerror or exc}"
                           ) from None
    for name in names:
        m = pattern.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def list_segments(directory: str, fs: FileSystem = OS_FS) -> list[tuple[int, str]]:
    return _numbered(directory, SEG_RE, fs)


def _later_valid(buf: bytes, start: int, salt: int) -> Frame | None:
    """The first CRC-valid frame with this salt at any byte offset >= start."""
    salt_bytes = salt.to_bytes(4, "little")
    pos = start
    while True:
        i = buf.find(salt_bytes, pos + 16)  # the salt sits at frame offset 16
        if i < 0:
            return None
        cand = i - 16
        f = parse_frame(buf, cand)
        if isinstance(f, Frame) and f.salt == salt:
            return f
        pos = cand + 1


def _later_durable_seq(buf: bytes, start: int, salt: int) -> int:
    """The largest durable_seq stamped on a CRC-valid frame with this salt after ``start``
    (-1: none). Every later frame counts, not only the first: under ``sync=commit`` the
    records right after a damaged one may be non-durable ones with an older stamp, and the
    acknowledged record that proves the damaged one durable comes further on."""
    best = -1
    f = _later_valid(buf, start, salt)
    while f is not None:
        best = max(best, f.durable_seq)
        f = _later_valid(buf, f.end, salt)
    return best


def read_file(fs: FileSystem, path: str, limit: int = -1) -> bytes:
    try:
        return fs.read(path, limit)
    except OSError as exc:
        raise JournalError(cannot_read(path, exc)) from None


def apply_repairs(res: ScanResult, fs: FileSystem = OS_FS) -> None:
    """Carry out the cuts a scan decided (truncate the damaged segment, remove later ones)."""
    for what, path, size in res.repairs:
        if what == "truncate":
            fs.truncate(path, size)
        elif what == "stale":
            fs.rename(path, path + ".stale")
        else:
            fs.remove(path)
    res.repairs = []


def scan(directory: str, *, schema_major: int, fs: FileSystem = OS_FS, repair: bool = True,
         salvage: bool = False, first_segment: int = 0) -> ScanResult:
    """Validate every segment in order. With ``repair`` the torn tail is cut on disk; without
    it nothing is written and ``res.repairs`` says what a repair would do. ``first_segment``:
    start at that segment, as if the ones before it had been compacted away (recovery from a
    snapshot that covers them, :func:`snapshot_segment`)."""
    res = ScanResult()
    # listed first: the log held every record of these snapshots before they were written,
    # so a writer appending while we read cannot make one look past the log's end
    snaps = list_snapshots(directory, fs)
    segs = [(n, p) for n, p in list_segments(directory, fs) if n >= first_segment]
    expect_seq, chain = 1, 0
    for idx, (num, path) in enumerate(segs):
        data = read_file(fs, path)
        hdr = SegmentHeader.parse(data)
        if isinstance(hdr, str):
            # never a torn creation, even when it is the last segment and shorter than a
            # header: a segment gets its final name only after its header was fsynced
            # (docs/journal-format.md), so a bad header under that name is damage
            if salvage:
                _salvage_from(res, segs[idx:], hdr, fs)
                break
            raise JournalCorrupt(num, 0, hdr)
        if hdr.schema_major > schema_major:
            raise SchemaVersionError(f"segment {num} was written with event schema "
                                     f"{hdr.schema_major}.{hdr.schema_minor}; this reader "
                                     f"understands major {schema_major} only")
        if not res.segments and hdr.first_seq != 1:  # compacted: the chain starts here
            expect_seq, chain = hdr.first_seq, hdr.prev_crc
        if hdr.first_seq != expect_seq or hdr.prev_crc != chain:
            why = (f"segment starts at seq {hdr.first_seq} (chain {hdr.prev_crc:#x}); expected "
                   f"seq {expect_seq} (chain {chain:#x})")
            if salvage:
                _salvage_from(res, segs[idx:], why, fs)
                break
            raise JournalCorrupt(num, 0, why)
        frames, off, bad = scan_frames(data, SEG_HEADER_SIZE, hdr.salt, expect_seq, chain)
        if len(frames):
            last = frames.rows[-1].tolist()
            expect_seq, chain = last[2] + 1, last[6]
        res.segments.append(SegmentScan(num, path, hdr, frames, data))
        if bad is None:
            continue
        _judge_damage(res, segs[idx:], data, off, hdr, expect_seq, bad, fs, salvage)
        res.repairs.append(("truncate", path, off))
        res.repairs.extend(("remove", later, 0) for _, later in segs[idx + 1:])
        res.segments[-1].data = data[:off]
        break
    res.last_seq, res.last_crc = expect_seq - 1, chain
    _snapshots_past_the_end(snaps, res, fs, salvage)
    if repair:
        apply_repairs(res, fs)
    for c in res.cuts:
        log.warning("journal.cut", segment=c.segment, offset=c.offset, bytes=c.bytes_cut,
                    reason=c.reason)
    return res


def _salvage_from(res: ScanResult, rest: list[tuple[int, str]], why: str,
                  fs: FileSystem) -> None:
    """Salvage at a damaged segment header, or a segment off the chain: the valid prefix is
    the segments before it; it and every later one are cut (removed by a repair)."""
    res.salvaged = True
    res.cuts.append(Cut(rest[0][0], 0, sum(len(read_file(fs, p)) for _, p in rest),
                        f"salvage: {why}"))
    res.repairs.extend(("remove", p, 0) for _, p in rest)


def _snapshots_past_the_end(snaps: list[tuple[int, str]], res: ScanResult, fs: FileSystem,
                            salvage: bool) -> None:
    """A well-formed snapshot at seq N proves records 1..N were durable: ``write_snapshot``
    fsyncs the log first, so no crash leaves the log shorter than a snapshot. One past the
    log's valid end is therefore damage or loss (a torn synced record, a lost segment):
    ``JournalCorrupt``, unless salvage, which keeps the valid prefix and sets the snapshot
    aside (``<name>.stale``: never loaded, counted or overwritten by the new history)."""
    for seq, path in snaps:
        if seq <= res.last_seq:
            continue
        try:
            data = read_file(fs, path)
        except JournalError:  # removed since it was listed (a writer keeps a few): no proof
            continue
        snap = parse_snapshot(data)
        if isinstance(snap, str) or snap.seq != seq:  # damaged: proves nothing (skipped and
            continue                                  # reported by usable_snapshots)
        num = res.segments[-1].number if res.segments else 0
        off = len(res.segments[-1].data) if res.segments else 0
        why = (f"snapshot {seq} proves records through {seq} were made durable; the log's "
               f"valid records end at {res.last_seq}")
        if not salvage:
            raise JournalCorrupt(num, off, why)
        res.salvaged = True
        res.cuts.append(Cut(num, off, 0, f"salvage: {why}; the snapshot is set aside"))
        res.repairs.append(("stale", path, 0))


def _judge_damage(res: ScanResult, rest: list[tuple[int, str]], data: bytes, off: int,
                  hdr: SegmentHeader, expect_seq: int, reason: str, fs: FileSystem,
                  salvage: bool) -> None:
    """Torn tail (cut) or mid-log corruption (raise), by the durable_seq of later records."""
    num = rest[0][0]
    durable_later = _later_durable_seq(data, off + 1, hdr.salt) >= expect_seq
    # A later segment is created only after this one was fsynced (rotation and reopen both
    # sync first), and gets its final name only with a durable header: any later segment,
    # its header sound or not (that is damage too, never a torn creation), proves the
    # damaged bytes were durable.
    if rest[1:]:
        durable_later = True
    if durable_later and not salvage:
        raise JournalCorrupt(num, off, f"{reason}; a later record or segment proves seq "
                             f"{expect_seq} had been made durable")
    res.salvaged = durable_later
    cut = len(data) - off + sum(len(read_file(fs, p)) for _, p in rest[1:])
    res.cuts.append(Cut(num, off, cut, ("salvage: " if durable_later else "torn tail: ") + reason))


def iter_frames(result: ScanResult, from_seq: int = 0) -> Iterator[tuple[int, int, memoryview]]:
    """(seq, frame offset, payload view) for every accepted record with seq >= from_seq."""
    for seg in result.segments:
        if not len(seg.frames) or seg.frames.last_seq() < from_seq:
            continue
        view = memoryview(seg.data)
        for seq, off, lo, hi in seg.frames.payloads(from_seq):
            yield seq, off, view[lo:hi]


# --- snapshots ----------------------------------------------------------------------------------
def list_snapshots(directory: str, fs: FileSystem = OS_FS) -> list[tuple[int, str]]:
    return _numbered(directory, SNAP_RE, fs)


__all__ = ["FRAME_OVERHEAD", "FRAME_SIZE", "Cut", "ScanResult", "apply_repairs", "iter_frames",
           "list_segments", "list_snapshots", "read_file", "scan"]
