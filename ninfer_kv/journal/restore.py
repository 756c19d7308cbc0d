"""Recover a state from a journal directory: the newest usable snapshot (on the log's CRC
chain, its payload accepted by the engine), then the records after it. The scan itself —
which records are valid, what is cut — is journal/recovery.py; the rules are
docs/journal-format.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import structlog

from ninfer_kv.errors import APPLY_ERRORS, JournalCorrupt
from ninfer_kv.journal.format import SEG_HEADER_SIZE, SegmentHeader, Snapshot, parse_snapshot
from ninfer_kv.journal.fs import OS_FS, FileSystem
from ninfer_kv.journal.recovery import (
    ScanResult,
    apply_repairs,
    iter_frames,
    list_segments,
    list_snapshots,
    read_file,
    scan,
)

log = structlog.get_logger(__name__)


def usable_snapshots(directory: str, res: ScanResult, schema_major: int,
                     fs: FileSystem = OS_FS) -> Iterator[Snapshot | str]:
    """Snapshots newest first: a ``Snapshot`` that may be used, or a string saying why one
    may not. A snapshot is used only when the record it names is in the valid log with the
    CRC the snapshot recorded (so a snapshot of a state the log was later cut below, or of
    another journal, is never reused)."""
    for seq, path in reversed(list_snapshots(directory, fs)):
        name = os.path.basename(path)
        snap = parse_snapshot(read_file(fs, path))
        if isinstance(snap, str):
            yield f"{name}: {snap}"
        elif snap.seq != seq:
            yield f"{name}: header says seq {snap.seq}"
        elif snap.schema_major > schema_major:
            yield f"{name}: schema major {snap.schema_major} > {schema_major}"
        elif snap.seq > res.last_seq:
            yield f"{name}: seq {snap.seq} beyond the log's last valid record {res.last_seq}"
        elif (crc := res.crc_of(snap.seq)) != snap.last_crc:
            where = ("not in the log (compacted past it)" if crc is None
                     else f"has CRC {crc:#010x} in the log")
            yield (f"{name}: names record {snap.seq} with CRC {snap.last_crc:#010x}, which "
                   f"{where}: not on this log's chain")
        else:
            yield snap


def snapshot_segment(directory: str, schema_major: int, fs: FileSystem = OS_FS) -> int | None:
    """The segment a recovery from the newest well-formed snapshot starts its scan at: the
    last one whose first record is at most one past the snapshot's (a snapshot ends its
    segment, so usually the segment right after it). None without such a snapshot. Reads
    segment headers only; a header that does not parse is stepped over, so damage in a
    segment the snapshot covers, header included, is never read (a review found the scan
    starting at the log's first segment instead, refusing the journal, and salvage then
    cutting every acknowledged record after it). Whether the snapshot is on the log's CRC
    chain is decided by the scan (:func:`usable_snapshots`)."""
    snap = None
    for seq, path in reversed(list_snapshots(directory, fs)):
        cand = parse_snapshot(read_file(fs, path))
        if (not isinstance(cand, str) and cand.seq == seq
                and cand.schema_major <= schema_major):
            snap = cand
            break
    if snap is None:
        return None
    return first_needed_segment(directory, snap.seq, fs)


def first_needed_segment(directory: str, seq: int, fs: FileSystem = OS_FS) -> int | None:
    """The last segment whose first record is at most ``seq + 1``: the segments before it
    hold only records up to ``seq`` (a snapshot at ``seq`` covers them). A header that does
    not parse is stepped over: when a later segment still starts at or before ``seq + 1``,
    the damaged one is covered; else a scan from the segment returned meets it and refuses.
    None when no header parses or the first segment starts past ``seq + 1``."""
    start = None
    for num, path in list_segments(directory, fs):
        hdr = SegmentHeader.parse(read_file(fs, path, SEG_HEADER_SIZE))
        if isinstance(hdr, str):
            continue
        if hdr.first_seq > seq + 1:
            break
        start = num
    return start


def scan_from_snapshot(directory: str, *, schema_major: int, fs: FileSystem = OS_FS,
                       salvage: bool = False, check: bool = True) -> ScanResult | None:
    """``scan(repair=False)`` from the newest snapshot's segment on, if a snapshot on that
    partial log's CRC chain covers the segments it skips; else None (scan the whole log).
    Records a usable snapshot covers are not read, as if compacted. ``check=False``: the
    caller looks for a usable snapshot itself (and falls back to the whole log)."""
    first = snapshot_segment(directory, schema_major, fs)
    if first is None:
        return None
    res = scan(directory, schema_major=schema_major, fs=fs, salvage=salvage, repair=False,
               first_segment=first)
    if not check or any(not isinstance(s, str)
                        for s in usable_snapshots(directory, res, schema_major, fs)):
        return res
    return None


S = TypeVar("S")


def recover_state(directory: str, *, schema_major: int, initial: Callable[[], S],
                  load_snapshot: Callable[[bytes], S],
                  apply_record: Callable[[S, int, memoryview], None],
                  fs: FileSystem = OS_FS, salvage: bool = False,
                  scan_result: ScanResult | None = None, repair: bool = True,
                  skipped: list[str] | None = None,
                  on_snapshot: Callable[[int], None] | None = None
                  ) -> tuple[S, int, ScanResult]:
    """Newest usable snapshot + replay of the tail. Returns (state, last seq, scan).

    Without ``scan_result`` the scan starts at the newest snapshot's segment
    (:func:`snapshot_segment`): records a snapshot covers are not read again, as if
    compacted. If that snapshot turns out unusable the whole log is scanned instead.

    A snapshot that cannot be used (damaged, beyond the log, off its CRC chain, or whose
    payload ``load_snapshot`` refuses) is skipped, logged and listed in ``skipped``;
    ``on_snapshot`` gets the seq of the one used, if any. With
    none usable the whole log is replayed — which needs the log to start at seq 1. A record
    that ``apply_record`` cannot apply raises ``JournalCorrupt`` naming it."""
    def full() -> ScanResult:
        return scan(directory, schema_major=schema_major, fs=fs, salvage=salvage, repair=repair)

    partial = None if scan_result is not None else scan_from_snapshot(
        directory, schema_major=schema_major, fs=fs, salvage=salvage, check=False)
    res = scan_result or partial or full()
    skipped = [] if skipped is None else skipped
    found = _load_snapshot(directory, res, schema_major, fs, load_snapshot)
    if partial is not None:
        if found[0] is None:  # no snapshot the partial scan kept decodes: read it all
            res = full()
            found = _load_snapshot(directory, res, schema_major, fs, load_snapshot)
        elif repair:
            apply_repairs(res, fs)
    state, start, why_skipped = found
    skipped.extend(why_skipped)
    if state is not None and on_snapshot is not None:
        on_snapshot(start - 1)  # the seq of the snapshot recovery starts from
    for why in skipped:
        log.warning("journal.snapshot_skipped", reason=why)
    if state is None:
        if res.first_seq != 1:
            raise JournalCorrupt(res.segments[0].number, 0, "the log starts at seq "
                                 f"{res.first_seq} (compacted, or its first segment is gone) "
                                 "and no usable snapshot covers the records before it")
        state = initial()
    for seq, off, payload in iter_frames(res, start):
        try:
            apply_record(state, seq, payload)
        except APPLY_ERRORS as exc:
            raise JournalCorrupt(res.segment_of(seq), off, f"record {seq} is well-formed but "
                                 f"cannot be applied to the state before it: {exc!r}") from None
    return state, res.last_seq, res


def _load_snapshot(directory: str, res: ScanResult, schema_major: int, fs: FileSystem,
                   load: Callable[[bytes], S]) -> tuple[S | None, int, list[str]]:
    """(state, first seq to replay, why each newer snapshot was skipped) from the newest
    snapshot that is usable on ``res`` and whose payload ``load`` accepts; (None, 1, …) if
    none is."""
    skipped: list[str] = []
    for cand in usable_snapshots(directory, res, schema_major, fs):
        if isinstance(cand, str):
            skipped.append(cand)
            continue
        try:
            return load(cand.payload), cand.seq + 1, skipped
        except Exception as exc:  # a foreign, incompatible or wrong payload: never trusted
            skipped.append(f"snap-{cand.seq:016d}.snap: payload refused (it does not decode, "
                           f"or the engine judged it wrong): {exc!r}")
    return None, 1, skipped
