"""The compiled frame walk (journal/frames.py) against the one-frame-at-a-time parser it
replaced: same accepted frames, same stop offset, same reason, on whole, torn and damaged
segments. And its CRC-32C against the ``crc32c`` library."""

from __future__ import annotations

import numpy as np
import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.journal.format import (
    FRAME_OVERHEAD,
    FRAME_SIZE,
    MAX_PAYLOAD,
    SEG_HEADER_SIZE,
    Frame,
    pack_record,
    parse_frame,
)
from ninfer_kv.journal.frames import (
    CRC_TABLES,
    END,
    IMPLAUSIBLE,
    FrameTable,
    crc32c_range,
    scan_frames,
    walk_frames,
)

SALT = 0x5A17


def reference(data: bytes, off: int, salt: int, seq: int,
              chain: int) -> tuple[list[Frame], int, str | None]:
    """The scan's loop before the compiled walk (recovery.scan up to 2b2995b)."""
    frames: list[Frame] = []
    bad: str | None = None
    while off < len(data):
        f = parse_frame(data, off)
        if isinstance(f, str):
            bad = f
        elif f.salt != salt:
            bad = f"salt {f.salt:#x} != segment salt {salt:#x}"
        elif f.seq != seq:
            bad = f"seq {f.seq}, expected {seq}"
        elif f.prev_crc != chain:
            bad = f"chain broken: prev_crc {f.prev_crc:#x} != {chain:#x}"
        if bad is not None:
            break
        frames.append(f)
        seq, chain, off = f.seq + 1, f.crc, f.end
    return frames, off, bad


def segment(payloads: list[bytes], first: int = 1, chain: int = 0, salt: int = SALT) -> bytes:
    out = [bytes(SEG_HEADER_SIZE)]  # the walk never reads the header
    for i, p in enumerate(payloads):
        rec, chain = pack_record(first + i, chain, salt, first + i - 1, p)
        out.append(rec)
    return b"".join(out)


def same(data: bytes, salt: int = SALT, seq: int = 1, chain: int = 0) -> FrameTable:
    frames, off, why = scan_frames(data, SEG_HEADER_SIZE, salt, seq, chain)
    assert (list(frames), off, why) == reference(data, SEG_HEADER_SIZE, salt, seq, chain)
    return frames


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 299), st.integers(0, 299))
def test_crc_matches_crc32c(data: bytes, a: int, b: int) -> None:
    lo, hi = sorted((min(a, len(data)), min(b, len(data))))
    got = crc32c_range(np.frombuffer(data, np.uint8), lo, hi, CRC_TABLES)
    assert int(got) == crc32c(data[lo:hi])


def test_whole_segment() -> None:
    payloads = [bytes([i]) * (i * 7 % 50) for i in range(40)]
    frames = same(segment(payloads))
    assert len(frames) == 40 and frames.last_seq() == 40
    assert [bytes(segment(payloads)[lo:hi]) for _, _, lo, hi in frames.payloads(1)] == payloads
    assert [s for s, *_ in frames.payloads(38)] == [38, 39, 40]
    assert list(frames.payloads(41)) == []


def test_each_rule_stops_the_walk() -> None:
    """One segment per rule of parse_frame and the scan, each broken in frame 3."""
    payloads = [b"x" * 10] * 5
    data = segment(payloads)
    third = SEG_HEADER_SIZE + 2 * (FRAME_OVERHEAD + 10)
    cases = {
        "torn frame header": data[:third + FRAME_OVERHEAD - 1],
        "torn record": data[:third + FRAME_OVERHEAD + 5],
        "record CRC mismatch": data[:third + FRAME_SIZE] + b"y" + data[third + FRAME_SIZE + 1:],
        "implausible length": (data[:third] + (MAX_PAYLOAD + 1).to_bytes(4, "little")
                               + data[third + 4:]),
    }
    for want, bad in cases.items():
        frames, off, why = scan_frames(bad, SEG_HEADER_SIZE, SALT, 1, 0)
        assert len(frames) == 2 and off == third and why is not None and why.startswith(want)
        same(bad)
    # salt, seq and chain: a CRC-valid third frame written with the wrong value
    good = segment(payloads[:2])
    chain = crc32c(good[-FRAME_OVERHEAD - 10:-4])
    for want, rec in (("salt", pack_record(3, chain, SALT + 1, 2, b"x" * 10)[0]),
                      ("seq 4, expected 3", pack_record(4, chain, SALT, 2, b"x" * 10)[0]),
                      ("chain broken", pack_record(3, chain ^ 1, SALT, 2, b"x" * 10)[0])):
        frames, off, why = scan_frames(good + rec, SEG_HEADER_SIZE, SALT, 1, 0)
        assert len(frames) == 2 and off == third and why is not None and why.startswith(want)
        same(good + rec)


def test_start_seq_and_chain() -> None:
    """A segment that continues the log: its first frame must carry the expected seq and the
    CRC of the record before it."""
    data = segment([b"a", b"bc"], first=7, chain=0xDEAD)
    assert len(same(data, seq=7, chain=0xDEAD)) == 2
    assert len(same(data, seq=8, chain=0xDEAD)) == 0
    assert len(same(data, seq=7, chain=0xBEEF)) == 0


def test_many_frames_grow_the_table() -> None:
    frames = same(segment([b""] * 1000))
    assert len(frames) == 1000 and frames[-1].seq == 1000 and frames[0].offset == SEG_HEADER_SIZE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=12), st.data())
def test_damage_matches_reference(payloads: list[bytes], data: st.DataObject) -> None:
    """Random segments, cut short or with bytes overwritten: the walk and the old loop agree."""
    raw = bytearray(segment(payloads))
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(SEG_HEADER_SIZE, max(len(raw) - 1, SEG_HEADER_SIZE)))
        if i < len(raw):
            raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(SEG_HEADER_SIZE, len(raw)))
    same(bytes(raw[:cut]))


@pytest.mark.parametrize("first", [5, (1 << 63) - 1, (1 << 63) + 7, (1 << 64) - 3])
def test_seqs_are_exact_up_to_the_field_width(first: int) -> None:
    """Review finding: a seq of 2**63 or more raised OverflowError once the walk had been
    called with a small one (it took a Python int as int64), and the counter wrapped at
    2**64, accepting a record numbered 0 after 2**64 - 1."""
    same(segment([b"a", b"b"], first=5), seq=5)  # compiled with a small seq first
    frames = same(segment([b"a", b"b", b"c"], first=first), seq=first)
    assert len(frames) == 3 and frames.last_seq() == first + 2


def test_no_record_follows_seq_2_64_minus_1() -> None:
    last = (1 << 64) - 1
    good = segment([b"a"], first=last)
    rec, _ = pack_record(0, crc32c(good[-FRAME_OVERHEAD - 1:-4]), SALT, 0, b"b")
    frames, off, why = scan_frames(good + rec, SEG_HEADER_SIZE, SALT, last, 0)
    assert len(frames) == 1 and why == f"seq 0, expected {1 << 64}"
    same(good + rec, seq=last)
    frames, off, why = scan_frames(rec, 0, SALT, 1 << 64, 0)  # nothing is in sequence
    assert len(frames) == 0 and why == f"seq 0, expected {1 << 64}"


def test_the_longest_payload_is_accepted() -> None:
    """``length > max_payload`` is implausible, ``== max_payload`` is a record the writer may
    have acknowledged (the walk takes the limit as an argument: MAX_PAYLOAD is 256 MiB)."""
    data = segment([b"x" * 10])
    buf = np.frombuffer(data, np.uint8)
    for limit, code in ((10, END), (9, IMPLAUSIBLE)):
        rows, _, got = walk_frames(buf, SEG_HEADER_SIZE, np.uint64(SALT), np.uint64(1), 10,
                                   np.uint64(0), limit, CRC_TABLES)
        assert (len(rows), got) == (int(code == END), code)


def test_a_frame_breaking_two_rules_is_named_by_the_first() -> None:
    """The scan's order: salt, then seq, then chain (the old loop's)."""
    good = segment([b"x"])
    chain = crc32c(good[-FRAME_OVERHEAD - 1:-4])
    for want, rec in (("salt", pack_record(9, chain, SALT + 1, 0, b"y")[0]),
                      ("salt", pack_record(2, chain ^ 1, SALT + 1, 0, b"y")[0]),
                      ("seq 9", pack_record(9, chain ^ 1, SALT, 0, b"y")[0])):
        _, _, why = scan_frames(good + rec, SEG_HEADER_SIZE, SALT, 1, 0)
        assert why is not None and why.startswith(want), (want, why)
        same(good + rec)
