"""Byte layouts of docs/journal-format.md: segment header, record frame, snapshot header.

Only packing and checking lives here; writing is log.py, scanning is recovery.py.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from crc32c import crc32c

FORMAT_VERSION = 1
SEG_MAGIC = b"NKVJ"
SNAP_MAGIC = b"NKVS"
MAX_PAYLOAD = 256 << 20

# magic, format_version, schema_major, schema_minor, reserved, segment_no, salt, first_seq,
# prev_crc, reserved  (then header_crc)
SEG_HEADER = struct.Struct("<4sHHHHIIQII")
SEG_HEADER_SIZE = SEG_HEADER.size + 4  # 40
# length, seq, prev_crc, salt, durable_seq
FRAME = struct.Struct("<IQIIQ")
FRAME_SIZE = FRAME.size  # 28
CRC = struct.Struct("<I")
FRAME_OVERHEAD = FRAME_SIZE + CRC.size  # 32
# magic, format_version, schema_major, seq, last_crc, reserved, payload_len, payload_crc
SNAP_HEADER = struct.Struct("<4sHHQIIQI")
SNAP_HEADER_SIZE = SNAP_HEADER.size + 4  # 40

SEG_RE = re.compile(r"^seg-(\d{8})\.log$")
SNAP_RE = re.compile(r"^snap-(\d{16})\.snap$")
TMP_RE = re.compile(r"^(seg-\d{8}\.log|snap-\d{16}\.snap)\.tmp$")
"""The journal's own temp files (a segment or snapshot being created); the only files an
open removes. Anything else in the directory is left alone."""


def segment_name(n: int) -> str:
    return f"seg-{n:08d}.log"


def snapshot_name(seq: int) -> str:
    return f"snap-{seq:016d}.snap"


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    schema_major: int
    schema_minor: int
    segment_no: int
    salt: int
    first_seq: int
    prev_crc: int

    def pack(self) -> bytes:
        body = SEG_HEADER.pack(SEG_MAGIC, FORMAT_VERSION, self.schema_major, self.schema_minor, 0,
                               self.segment_no, self.salt, self.first_seq, self.prev_crc, 0)
        return body + CRC.pack(crc32c(body))

    @staticmethod
    def parse(buf: bytes | memoryview) -> SegmentHeader | str:
        """The header, or a string saying why it is not one."""
        if len(buf) < SEG_HEADER_SIZE:
            return f"short header ({len(buf)} < {SEG_HEADER_SIZE} bytes)"
        body = bytes(buf[:SEG_HEADER.size])
        (crc,) = CRC.unpack_from(buf, SEG_HEADER.size)
        if crc32c(body) != crc:
            return "segment header CRC mismatch"
        magic, ver, major, minor, _, seg, salt, first, prev, _ = SEG_HEADER.unpack(body)
        if magic != SEG_MAGIC:
            return f"bad magic {magic!r}"
        if ver != FORMAT_VERSION:
            return f"format version {ver} (this reader knows {FORMAT_VERSION})"
        return SegmentHeader(major, minor, seg, salt, first, prev)


def pack_record(seq: int, prev_crc: int, salt: int, durable_seq: int,
                payload: bytes) -> tuple[bytes, int]:
    """Frame one record; returns (bytes, its crc)."""
    head = FRAME.pack(len(payload), seq, prev_crc, salt, durable_seq)
    crc = crc32c(payload, crc32c(head))
    return b"".join((head, payload, CRC.pack(crc))), crc


@dataclass(frozen=True, slots=True)
class Frame:
    offset: int
    length: int
    seq: int
    prev_crc: int
    salt: int
    durable_seq: int
    crc: int

    @property
    def end(self) -> int:
        return self.offset + FRAME_OVERHEAD + self.length

    @property
    def payload_slice(self) -> slice:
        return slice(self.offset + FRAME_SIZE, self.offset + FRAME_SIZE + self.length)


def parse_frame(buf: bytes | memoryview, offset: int) -> Frame | str:
    """A CRC-valid frame at ``offset`` (salt/seq/chain are checked by the caller), or why not."""
    if offset + FRAME_OVERHEAD > len(buf):
        return "torn frame header"
    length, seq, prev, salt, durable = FRAME.unpack_from(buf, offset)
    if length > MAX_PAYLOAD:
        return f"implausible length {length}"
    end = offset + FRAME_SIZE + length
    if end + CRC.size > len(buf):
        return f"torn record: needs {end + CRC.size - offset} bytes, {len(buf) - offset} left"
    (crc,) = CRC.unpack_from(buf, end)
    if crc32c(buf[offset:end]) != crc:
        return "record CRC mismatch"
    return Frame(offset, length, seq, prev, salt, durable, crc)


def pack_snapshot(schema_major: int, seq: int, last_crc: int, payload: bytes) -> bytes:
    body = SNAP_HEADER.pack(SNAP_MAGIC, FORMAT_VERSION, schema_major, seq, last_crc, 0,
                            len(payload), crc32c(payload))
    return body + CRC.pack(crc32c(body)) + payload


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int
    last_crc: int
    schema_major: int
    payload: bytes


def parse_snapshot(buf: bytes) -> Snapshot | str:
    if len(buf) < SNAP_HEADER_SIZE:
        return "short snapshot header"
    body = buf[:SNAP_HEADER.size]
    (crc,) = CRC.unpack_from(buf, SNAP_HEADER.size)
    if crc32c(body) != crc:
        return "snapshot header CRC mismatch"
    magic, ver, major, seq, last_crc, _, n, pcrc = SNAP_HEADER.unpack(body)
    if magic != SNAP_MAGIC or ver != FORMAT_VERSION:
        return f"bad snapshot magic/version {magic!r}/{ver}"
    payload = buf[SNAP_HEADER_SIZE:SNAP_HEADER_SIZE + n]
    if len(payload) != n:
        return f"torn snapshot payload ({len(payload)} of {n} bytes)"
    if crc32c(payload) != pcrc:
        return "snapshot payload CRC mismatch"
    return Snapshot(seq, last_crc, major, payload)
