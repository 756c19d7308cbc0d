"""Read side used by replay and tools: iterate records and events, export NDJSON.

Reading never repairs: a torn tail is skipped in memory, the files are left as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, Any

import msgspec

from ninfer_kv.errors import JournalCorrupt, JournalError, UnappliableRecord
from ninfer_kv.journal.events import CODEC, EventCodec, to_jsonable
from ninfer_kv.journal.fs import OS_FS, FileSystem
from ninfer_kv.journal.recovery import ScanResult, iter_frames, list_segments, scan


class JournalReader:
    """Read-only: takes no lock, never repairs, never writes. A directory without a single
    segment is not a journal (``JournalError``); a record whose payload does not decode is
    ``JournalCorrupt``."""

    def __init__(self, directory: str, codec: EventCodec = CODEC, fs: FileSystem = OS_FS,
                 salvage: bool = False) -> None:
        self.directory = directory
        self.codec = codec
        self.salvage = salvage
        self.scan: ScanResult = scan(directory, schema_major=codec.schema[0], fs=fs,
                                     repair=False, salvage=salvage)
        if not self.scan.segments and not list_segments(directory, fs):
            raise JournalError(f"{directory} holds no journal (no seg-NNNNNNNN.log files)")

    @property
    def last_seq(self) -> int:
        return self.scan.last_seq

    @property
    def bytes(self) -> int:
        return sum(len(s.data) for s in self.scan.segments)

    def records(self, from_seq: int = 0) -> Iterator[tuple[int, list[Any]]]:
        decode = self.codec.decode
        for seq, off, payload in iter_frames(self.scan, from_seq):
            try:
                events = decode(payload)
            except msgspec.MsgspecError as exc:
                raise JournalCorrupt(self.scan.segment_of(seq), off, f"record {seq} has a "
                                     f"valid CRC but its payload does not decode: {exc}") from None
            yield seq, events

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
