"""The segmented append-only log: one framed record per GPU boundary (group commit).

Format and recovery rules: docs/journal-format.md. Invariants this class keeps:

* records carry seq 1, 2, 3, ... with no gap; each record names the CRC of the one before it;
* a record is written with one ``write`` call, after the previous record's write completed;
* ``durable_seq`` only grows, and only after an fsync that covered it returned;
* after any failed write or fsync the log is *failed*: it refuses every further append and
  sync (never retry and carry on: the kernel may have dropped the dirty pages already).
"""

from __future__ import annotations

import enum
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from ninfer_kv.errors import ConfigError, JournalCorrupt, JournalError, JournalFailed
from ninfer_kv.journal.format import (
    FRAME_OVERHEAD,
    MAX_PAYLOAD,
    TMP_RE,
    SegmentHeader,
    pack_record,
    pack_snapshot,
    segment_name,
    snapshot_name,
)
from ninfer_kv.journal.fs import OS_FS, FileSystem, WritableFile, replace_durably
from ninfer_kv.journal.ids import add_cut_note
from ninfer_kv.journal.lock import DirLock
from ninfer_kv.journal.recovery import (
    ScanResult,
    apply_repairs,
    list_segments,
    list_snapshots,
    scan,
)
from ninfer_kv.journal.restore import first_needed_segment, scan_from_snapshot, usable_snapshots

log = structlog.get_logger(__name__)


class SyncPolicy(enum.StrEnum):
    OFF = "off"            # write only: survives a process crash, not a power loss
    COMMIT = "commit"      # fsync every record marked durable before append() returns
    INTERVAL = "interval"  # fsync at most every interval_ms (checked at append), and on sync()


class PayloadCodec(Protocol):
    schema: tuple[int, int]

    def encode(self, events: list[Any]) -> bytes: ...
    def decode(self, payload: bytes | memoryview) -> list[Any]: ...


@dataclass(frozen=True, slots=True)
class JournalOptions:
    sync: SyncPolicy = SyncPolicy.COMMIT
    interval_ms: float = 10.0
    segment_bytes: int = 64 << 20
    keep_snapshots: int = 2
    salvage: bool = False

    def __post_init__(self) -> None:
        # 0 kept every snapshot (``snaps[:-0]`` is empty); -1 removed the one just written
        if type(self.keep_snapshots) is not int or self.keep_snapshots < 1:
            raise ConfigError(f"keep_snapshots={self.keep_snapshots!r}: want an int >= 1")


class Journal:
    """Append side of one journal directory. Open with :meth:`open` (which recovers first)."""

    def __init__(self, directory: str, codec: PayloadCodec, options: JournalOptions,
                 fs: FileSystem, scan_result: ScanResult,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.codec = codec
        self.options = options
        self.fs = fs
        self.recovery = scan_result
        self._clock = clock
        self.last_seq = scan_result.last_seq
        self.last_crc = scan_result.last_crc
        self.durable_seq = scan_result.last_seq  # open() synced everything it kept
        self.bytes_written = 0
        self._failed: str | None = None
        self._file: WritableFile | None = None
        self._seg_no = max((n for n, _ in list_segments(directory, fs)), default=0)
        self._seg_records = 0
        self._salt = 0
        self._last_sync = clock()
        self._lock: DirLock | None = None  # held when open() took it; released by close()
        self._start_segment()

    @classmethod
    def open(cls, directory: str, codec: PayloadCodec, options: JournalOptions | None = None,
             fs: FileSystem = OS_FS, scan_result: ScanResult | None = None,
             lock: bool | None = None) -> Journal:
        """Recover and open for appending. ``scan_result``: a ``scan(repair=False)`` of this
        directory made by the caller (who validated it before anything was written); its
        repairs are carried out here. Only this journal's own temp files are removed.

        One writer per directory: on the real file system the directory's ``LOCK`` is taken
        first (``StoreLocked`` beside a live store) and held until :meth:`close`.
        ``lock=False``: the caller holds it already (``KVStore.open``); a fake file system
        (the crash tests') takes none."""
        options = options or JournalOptions()
        held = None
        if (fs is OS_FS) if lock is None else lock:
            directory = os.path.realpath(directory)  # as KVStore.open resolves it
            try:
                held = DirLock(directory)
            except OSError as exc:
                raise JournalError(f"cannot create journal directory {directory} or its "
                                   f"lock: {exc.strerror or exc}") from None
        try:
            journal = cls._open(directory, codec, options, fs, scan_result)
        except BaseException:
            if held is not None:
                held.release()
            raise
        journal._lock = held
        return journal

    @classmethod
    def _open(cls, directory: str, codec: PayloadCodec, options: JournalOptions,
              fs: FileSystem, scan_result: ScanResult | None) -> Journal:
        try:
            fs.makedirs(directory)
        except OSError as exc:
            raise JournalError(f"cannot create journal directory {directory}: "
                               f"{exc.strerror or exc}") from None
        major = codec.schema[0]
        res = (scan_result
               or scan_from_snapshot(directory, schema_major=major, fs=fs, salvage=options.salvage)
               or scan(directory, schema_major=major, fs=fs, repair=False,
                       salvage=options.salvage))
        try:
            for name in fs.listdir(directory):
                if TMP_RE.match(name):
                    fs.remove(os.path.join(directory, name))
            # first: the records cut may have handed out seq ids a store must not reuse
            add_cut_note(directory, sum(c.bytes_cut for c in res.cuts), fs)
            apply_repairs(res, fs)
            if res.segments:  # make what recovery kept durable before a later segment exists
                f = fs.open_append(res.segments[-1].path)
                try:
                    f.fsync()
                finally:
                    f.close()
        except OSError as exc:
            raise JournalError(f"cannot repair journal {directory}: {exc.strerror or exc}"
                               ) from None
        return cls(directory, codec, options, fs, res)

    # --- segments ---------------------------------------------------------------------------
    def _start_segment(self) -> None:
        self._seg_no += 1
        self._salt = random.getrandbits(32)
        hdr = SegmentHeader(self.codec.schema[0], self.codec.schema[1], self._seg_no, self._salt,
                            self.last_seq + 1, self.last_crc)
        final = os.path.join(self.directory, segment_name(self._seg_no))
        try:
            replace_durably(self.fs, final, hdr.pack())
            self._file = self.fs.open_append(final)
        except OSError as exc:
            self._fail(f"creating segment {self._seg_no}: {exc}")
        self._seg_records = 0
        log.debug("journal.segment", segment=self._seg_no, first_seq=self.last_seq + 1)

    def _end_segment(self) -> None:
        """Close the current (synced) segment and start the next; fatal on error."""
        f = self._check()
        self._file = None
        try:
            f.close()
        except OSError as exc:
            self._fail(f"closing segment {self._seg_no}: {exc}")
        self._start_segment()

    def _fail(self, why: str) -> None:
        self._failed = why
        log.error("journal.failed", reason=why)
        raise JournalFailed(f"journal {self.directory} failed and refuses appends: {why}")

    def _check(self) -> WritableFile:
        if self._failed is not None:
            raise JournalFailed(f"journal {self.directory} failed earlier: {self._failed}")
        if self._file is None:
            raise JournalError(f"journal {self.directory} is closed")
        return self._file

    # --- appends ----------------------------------------------------------------------------
    def append(self, events: list[Any], durable: bool = True) -> int:
        """Append one record holding ``events``; returns its seq once the policy is met.
        ``durable=False``: a record the writer does not need to survive a power loss (the
        store's decode rounds); under ``commit`` it is not fsynced itself, but the next
        durable record's fsync covers it (the log is sequential)."""
        return self.append_payload(self.codec.encode(events), durable)

    def append_payload(self, payload: bytes, durable: bool = True) -> int:
        f = self._check()
        if len(payload) > MAX_PAYLOAD:  # a reader would take it for damage: never write it
            raise JournalError(f"record of {len(payload)} bytes > MAX_PAYLOAD={MAX_PAYLOAD}; "
                               "nothing was written")
        policy = self.options.sync
        if policy is SyncPolicy.COMMIT and durable and self.durable_seq < self.last_seq:
            # make the records before it durable first, so this record's durable_seq stamp
            # proves them: damage among them is then mid-log corruption, never a "torn tail"
            # that would cut this acknowledged record with it (recovery rules)
            self.sync()
        if (self._seg_records and f.tell() + len(payload) + FRAME_OVERHEAD
                > self.options.segment_bytes):
            self.sync()
            self._end_segment()
            f = self._check()
        seq = self.last_seq + 1
        frame, crc = pack_record(seq, self.last_crc, self._salt, self.durable_seq, payload)
        try:
            f.write(frame)
        except OSError as exc:
            self._fail(f"write of record {seq}: {exc}")
        self.last_seq, self.last_crc = seq, crc
        self._seg_records += 1
        self.bytes_written += len(frame)
        if (policy is SyncPolicy.COMMIT and durable) or (
                policy is SyncPolicy.INTERVAL
                and (self._clock() - self._last_sync) * 1000.0 >= self.options.interval_ms):
            self.sync()
        return seq

    def sync(self) -> int:
        """fsync everything appended so far; returns the durable seq. Fatal on error."""
        f = self._check()
        if self.durable_seq == self.last_seq:
            return self.durable_seq
        try:
            f.fsync()
        except OSError as exc:
            self._fail(f"fsync through record {self.last_seq}: {exc}")
        self.durable_seq = self.last_seq
        self._last_sync = self._clock()
        return self.durable_seq

    def close(self) -> None:
        """Sync (unless failed) and close; the descriptor is closed and the lock released
        either way (also after a failed rotation left no segment open)."""
        f = self._file
        try:
            if f is None:
                return
            try:
                if self._failed is None:
                    self.sync()
            finally:
                self._file = None  # closed whatever close(2) says: the number may be reused
                try:
                    f.close()
                except OSError as exc:
                    self._fail(f"closing segment {self._seg_no}: {exc}")
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    # --- snapshots --------------------------------------------------------------------------
    def write_snapshot(self, payload: bytes,
                       accept: Callable[[bytes], bool] | None = None) -> str:
        """Persist an engine state taken after record ``last_seq`` (log synced first), then
        end the segment: the next record starts a new one whose header names the snapshot's
        record CRC, so recovery scans from there and never re-reads what the snapshot covers
        (``restore.snapshot_segment``).

        Then all but the newest ``keep_snapshots`` are removed — only if ``accept`` (the
        engine's check that recovery would load it) takes the new payload: an older snapshot
        may be the only one covering a compacted log, and a new one recovery would skip must
        not take its place (as ``compact``: a snapshot recovery skips licenses nothing)."""
        self.sync()
        path = os.path.join(self.directory, snapshot_name(self.last_seq))
        try:
            replace_durably(self.fs, path, pack_snapshot(self.codec.schema[0], self.last_seq,
                                                         self.last_crc, payload))
        except OSError as exc:
            self._fail(f"writing snapshot at seq {self.last_seq}: {exc}")
        doomed = list_snapshots(self.directory, self.fs)[:-self.options.keep_snapshots]
        if doomed and accept is not None and not accept(payload):
            log.warning("journal.snapshot_unusable", seq=self.last_seq,
                        kept=[os.path.basename(p) for _, p in doomed])
            doomed = []
        for _, old in doomed:
            try:  # an old snapshot that stays is harmless: recovery picks the newest usable
                self.fs.remove(old)
            except OSError as exc:
                log.warning("journal.snapshot_not_removed", path=old, error=str(exc))
        log.info("journal.snapshot", seq=self.last_seq, bytes=len(payload))
        if self._seg_records:
            self._end_segment()
        return path

    def compact(self, accept: Callable[[bytes], bool] = lambda payload: True) -> int:
        """Remove segments wholly covered by the oldest snapshot recovery would use — on the
        log's CRC chain (``usable_snapshots``) and whose payload ``accept`` takes (the engine
        decodes it). A damaged or stale snapshot never licenses removing records. Returns
        how many segments were removed."""
        self.sync()
        major = self.codec.schema[0]
        try:  # the whole log, so every snapshot still on its chain keeps what it needs
            res: ScanResult | None = scan(self.directory, schema_major=major, fs=self.fs,
                                          repair=False)
        except JournalCorrupt:  # damage only a snapshot covers (recovery reads past it too)
            res = scan_from_snapshot(self.directory, schema_major=major, fs=self.fs)
            if res is None:
                raise
        usable = [s.seq for s in usable_snapshots(self.directory, res, major, self.fs)
                  if not isinstance(s, str) and accept(s.payload)]
        if not usable:
            return 0
        keep = first_needed_segment(self.directory, min(usable), self.fs)
        removed = 0
        for num, path in list_segments(self.directory, self.fs):
            if keep is None or num >= keep:
                break
            self.fs.remove(path)  # records only up to the snapshot's (a damaged header too)
            removed += 1
        if removed:
            self.fs.fsync_dir(self.directory)
        return removed

