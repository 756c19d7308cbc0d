"""Read side used by replay and tools: iterate records and events, export NDJSON.

Reading never repairs: a torn tail is skipped in memory, the files are left as they are.

A reader takes no lock, so a live store may be appending, snapshotting and compacting while
it reads. It therefore reads the directory once, into memory, as one consistent view
(:func:`capture`), and every later question (the scan, the snapshots replay starts from) is
answered from those bytes, never from the directory again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import IO, Any, NoReturn

import msgspec
import structlog

from ninfer_kv.errors import JournalCorrupt, JournalError, UnappliableRecord
from ninfer_kv.journal.events import CODEC, EventCodec
from ninfer_kv.journal.export import to_jsonable
from ninfer_kv.journal.fs import OS_FS, FileSystem, WritableFile, cannot_read
from ninfer_kv.journal.recovery import (
    ScanResult,
    iter_frames,
    list_segments,
    list_snapshots,
    scan,
)
from ninfer_kv.journal.restore import scan_from_snapshot

log = structlog.get_logger(__name__)

CAPTURE_ATTEMPTS = 8


class FrozenDir:
    """A read-only :class:`FileSystem` over the bytes of one journal directory's segments and
    snapshots, read once by :func:`capture`. Every write is refused."""

    def __init__(self, directory: str, files: dict[str, bytes]) -> None:
        self.directory = directory
        self.files = files

    def listdir(self, directory: str) -> list[str]:
        return list(self.files)

    def read(self, path: str, limit: int = -1) -> bytes:
        try:
            data = self.files[os.path.basename(path)]
        except KeyError:
            raise FileNotFoundError(2, "No such file or directory", path) from None
        return data if limit < 0 else data[:limit]

    def refuse(self, what: str) -> NoReturn:
        raise JournalError(f"{self.directory}: a reader's view of the journal is read-only "
                           f"({what} refused)")

    def create(self, path: str) -> WritableFile:
        self.refuse("create")

    def open_append(self, path: str) -> WritableFile:
        self.refuse("open_append")

    def rename(self, src: str, dst: str) -> None:
        self.refuse("rename")

    def remove(self, path: str) -> None:
        self.refuse("remove")

    def truncate(self, path: str, size: int) -> None:
        self.refuse("truncate")

    def fsync_dir(self, directory: str) -> None:
        self.refuse("fsync_dir")

    def makedirs(self, directory: str) -> None:
        self.refuse("makedirs")


def capture(directory: str, fs: FileSystem = OS_FS,
            attempts: int = CAPTURE_ATTEMPTS) -> FrozenDir:
    """Read the journal's snapshots, then its segments, into memory as one consistent view of
    a journal a live writer may be changing (the reader holds no lock).

    The order is the one ``recovery.scan`` relies on: snapshots first, so the log read after
    them holds every record they name. Two things a writer does meanwhile would make the view
    inconsistent, and both make us read again (up to ``attempts`` times):
    - a listed file is gone when read (compaction removed a segment, a new snapshot pruned an
      old one);
    - the newest snapshot listed once the segments are read is not one we read: the writer
      snapshotted meanwhile, and may have compacted the log past every snapshot we hold (a
      snapshot we hold that is still listed is not enough: it may be one recovery skips, which
      pruning keeps and compaction ignores). When no snapshot was written meanwhile, every
      compaction since used a snapshot we read (compaction keeps what the oldest usable one
      does not cover), so the segments read are the ones it needs. With no snapshot at either
      end nothing was compacted.
    """
    for attempt in range(attempts):
        snaps = list_snapshots(directory, fs)
        files: dict[str, bytes] = {}
        try:
            for _, path in snaps:
                files[os.path.basename(path)] = fs.read(path)
            for _, path in list_segments(directory, fs):  # listed after the snapshots are read
                files[os.path.basename(path)] = fs.read(path)
        except FileNotFoundError as exc:
            log.debug("journal.reader.retry", attempt=attempt, vanished=exc.filename)
            continue
        except OSError as exc:
            raise JournalError(cannot_read(directory, exc)) from None
        now = list_snapshots(directory, fs)
        if (now[-1] in snaps) if now else not snaps:
            return FrozenDir(directory, files)
        log.debug("journal.reader.retry", attempt=attempt, snapshots_before=len(snaps),
                  snapshots_after=len(now))
    raise JournalError(f"{directory} changed under each of {attempts} reads (a live writer "
                       "compacting faster than it can be read): read it again, or stop the "
                       "writer first")


class JournalReader:
    """Read-only: takes no lock, never repairs, never writes. It reads the directory once, as
    one consistent view (:func:`capture`: safe beside a live writer), into ``self.fs``; the
    scan and the snapshots replay starts from come from there. A directory without a single
    segment is not a journal (``JournalError``); a record whose payload does not decode is
    ``JournalCorrupt``.

    By default the whole log is read and checked, from its first segment. ``from_snapshot``:
    read as the store's recovery does, from the newest snapshot on the log's CRC chain (the
    segments it covers are not read, so damage there is not seen); without such a snapshot,
    the whole log."""

    def __init__(self, directory: str, codec: EventCodec = CODEC, fs: FileSystem = OS_FS,
                 salvage: bool = False, from_snapshot: bool = False) -> None:
        self.directory = directory
        self.codec = codec
        self.salvage = salvage
        self.fs: FileSystem = capture(directory, fs)
        major = codec.schema[0]
        partial = scan_from_snapshot(directory, schema_major=major, fs=self.fs,
                                     salvage=salvage) if from_snapshot else None
        try:
            self.scan: ScanResult = partial or scan(directory, schema_major=major, fs=self.fs,
                                                    repair=False, salvage=salvage)
        except JournalCorrupt as exc:
            first = None if from_snapshot else self._recovery_start(exc.segment)
            if first is None:
                raise
            raise JournalCorrupt(exc.segment, exc.offset, f"{exc.reason} (a snapshot covers "
                                 f"this segment: the store's recovery reads from segment "
                                 f"{first} on, and so does --from-snapshot)") from None
        if not self.scan.segments and not list_segments(directory, self.fs):
            raise JournalError(f"{directory} holds no journal (no seg-NNNNNNNN.log files)")

    def _recovery_start(self, damaged: int) -> int | None:
        """The segment recovery starts at when a usable snapshot covers segment ``damaged``
        (the store reopens this journal without reading it), else None."""
        try:
            res = scan_from_snapshot(self.directory, schema_major=self.codec.schema[0],
                                     fs=self.fs, salvage=self.salvage)
        except JournalError:  # damage past the snapshot too
            return None
        if res is None or not res.segments or res.segments[0].number <= damaged:
            return None
        return res.segments[0].number

    @property
    def last_seq(self) -> int:
        return self.scan.last_seq

    @property
    def bytes(self) -> int:
        return sum(len(s.data) for s in self.scan.segments)

    def records(self, from_seq: int = 0) -> Iterator[tuple[int, list[Any]]]:
        for seq, off, payload in iter_frames(self.scan, from_seq):
            yield seq, self.decode(seq, off, payload)

    def decode(self, seq: int, off: int, payload: bytes | memoryview) -> list[Any]:
        """The events of record ``seq`` (its frame at ``off``), or ``JournalCorrupt``."""
        try:
            return self.codec.decode(payload)
        except msgspec.MsgspecError as exc:
            raise JournalCorrupt(self.scan.segment_of(seq), off, f"record {seq} has a "
                                 f"valid CRC but its payload does not decode: {exc}") from None

    def events(self, from_seq: int = 0) -> Iterator[tuple[int, int, Any]]:
        for seq, events in self.records(from_seq):
            for i, ev in enumerate(events):
                yield seq, i, ev

    def export_ndjson(self, out: IO[bytes], from_seq: int = 0) -> int:
        """One JSON object per event: ``{"seq": .., "i": .., "type": .., fields...}``."""
        enc = msgspec.json.Encoder()
        n = 0
        for seq, i, ev in self.events(from_seq):
            try:  # a packed field whose length is no multiple of its dtype (a hand-made record)
                fields = to_jsonable(ev)
            except ValueError as exc:
                raise UnappliableRecord(seq, i, type(ev).__name__, exc) from None
            out.write(enc.encode({"seq": seq, "i": i, **fields}))
            out.write(b"\n")
            n += 1
        return n
