"""Replay's compiled decode rounds (engine/record_kernels.py, replay/plain.py): the parser
takes a record only when msgspec reads the same events from it, and plain replay, which
applies such records in compiled stretches, reaches the state event-by-event replay reaches —
in every field a later event reads, not only the digest. The refusal cases (a record and
event named, lengths that pair off, arrays that must grow) are tests/engine/test_replay_runs.py.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import ninfer_kv.replay.plain as plain
from ninfer_kv.engine import record_kernels as rk
from ninfer_kv.engine.state import StoreState, digest
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import JournalCorrupt
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC, EventCodec, pack
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import replay
from ninfer_kv.tools.sim_data import DEFAULT_TRACE, SimOptions, load_trace
from ninfer_kv.tools.simulate import simulate
from tests.engine.conftest import small_config
from tests.engine.test_continuation import running, step

MAIN = np.frombuffer(b"main", np.uint8)


def shape(payload: bytes, with_mat: bool = True) -> tuple[int, np.ndarray]:
    out = np.zeros((rk.MAX_EVENTS, 5), np.int64)
    buf = np.frombuffer(payload, np.uint8)
    return rk.record_shape(buf, 0, len(buf), MAIN, with_mat, out), out


def test_the_tags_are_the_events_tags() -> None:
    assert rk.COMMIT_TAG.tobytes().decode() == ev.CommitFrontiers.__struct_config__.tag
    assert rk.MAT_TAG.tobytes().decode() == ev.Materialize.__struct_config__.tag


ints = hs.lists(hs.integers(-(1 << 31), (1 << 31) - 1), max_size=6)
raw = hs.one_of(ints.map(pack), hs.binary(max_size=9))  # mostly int32s, some any length
pools = hs.sampled_from(["main", "mtp", "mai", "mainx"])
events = hs.one_of(
    hs.builds(ev.CommitFrontiers, pools, raw, raw),
    hs.builds(ev.Materialize, pools, raw, raw, raw),
    hs.builds(ev.ProvisionalFrontiers, pools, raw, raw),
    hs.builds(ev.PublishActive, hs.integers(0, 100)))
damage = hs.one_of(hs.none(), hs.tuples(hs.sampled_from(["cut", "flip", "add"]),
                                        hs.integers(0, 1 << 16), hs.integers(1, 255)))


def _damaged(payload: bytes, how: tuple[str, int, int] | None) -> bytes:
    if how is None or not payload:
        return payload
    what, at, byte = how
    at %= len(payload)
    if what == "cut":
        return payload[:at]
    if what == "add":
        return payload + bytes([byte])
    return payload[:at] + bytes([payload[at] ^ byte]) + payload[at + 1:]


@settings(max_examples=400, deadline=None)
@given(hs.lists(events, max_size=5), damage, hs.booleans())
def test_a_record_is_taken_only_as_msgspec_reads_it(evs: list[Any],
                                                    how: tuple[str, int, int] | None,
                                                    with_mat: bool) -> None:
    """Whatever the bytes: when the parser takes a record, msgspec decodes the same events
    from it — each a commit (or, ``with_mat``, a Materialize) of pool ``main``, fields of
    equally many int32s, at the offsets the parser found. And every undamaged record of only
    such events is taken (else the fast path would never run)."""
    payload = _damaged(CODEC.encode(evs), how)
    n, rows = shape(payload, with_mat)
    if n >= 0:
        got = CODEC.decode(payload)
        assert len(got) == n
        kinds = (ev.CommitFrontiers, ev.Materialize) if with_mat else (ev.CommitFrontiers,)
        for e, (kind, s1, s2, s3, m) in zip(got, rows[:n].tolist(), strict=True):
            assert type(e) in kinds and e.pool == "main"
            assert kind == (rk.MAT if type(e) is ev.Materialize else rk.COMMIT)
            second = e.slots if kind == rk.MAT else e.frontiers
            assert (payload[s1:s1 + 4 * m], payload[s2:s2 + 4 * m]) == (e.bundles, second)
            if kind == rk.MAT:
                assert payload[s3:s3 + 4 * m] == e.pages
    if how is None and all(
            (type(e) is ev.CommitFrontiers or (with_mat and type(e) is ev.Materialize))
            and e.pool == "main" and len(e.bundles) % 4 == 0
            and all(len(f) == len(e.bundles) for f in msgspec.structs.astuple(e)[2:])
            for e in evs):
        assert n == len(evs)


def _str8(s: bytes) -> bytes:
    return b"\xd9" + bytes([len(s)]) + s


def _bin(b: bytes, width: int) -> bytes:
    return {1: b"\xc4", 2: b"\xc5", 4: b"\xc6"}[width] + len(b).to_bytes(width, "big") + b


@pytest.mark.parametrize("width", [1, 2, 4])
def test_longer_encodings_msgspec_reads_are_taken(width: int) -> None:
    """A writer may use str8 and bin16/32 where ours writes the short forms, and an array
    header of 3 or 5 bytes: msgspec reads them, and so does the parser."""
    b, f = pack([1, 2]), pack([64, 70])
    event = b"\x94" + _str8(b"commit") + _str8(b"main") + _bin(b, width) + _bin(f, width)
    for header in (b"\x91", b"\xdc\x00\x01", b"\xdd\x00\x00\x00\x01"):
        payload = header + event
        assert CODEC.decode(payload) == [ev.CommitFrontiers("main", b, f)]
        n, rows = shape(payload)
        assert n == 1 and payload[rows[0, 1]:rows[0, 1] + 8] == b


@pytest.mark.parametrize("payload", [
    b"\x91\x94\xa6commit\xa4main\xc4\x04\x01\x00\x00\x00\xc4\x04\x40\x00\x00\x00\x00",  # after
    b"\x92\x94\xa6commit\xa4main\xc4\x04\x01\x00\x00\x00\xc4\x04\x40\x00\x00\x00",  # 1 of 2
    b"\x91\x94\xa6commit\xa4main\xc4\x04\x01\x00\x00\x00\xc4\x08\x40\x00\x00\x00",  # past end
    b"\x91\x95\xa6commit\xa4main\xc4\x00\xc4\x00\xc4\x00",  # a commit of five fields
    b"\x91\x94\xa3mat\xa4main\xc4\x00\xc4\x00",  # a Materialize of four
    b"\x91\x95\xa3mat\xa4main\xc4\x04\x01\x00\x00\x00\xc4\x04\x01\x00\x00\x00\xc4\x00",  # 0 pages
    b"\x91\x95\xa3mat\xa4main\xc4\x04\x01\x00\x00\x00\xc4\x00\xc4\x04\x01\x00\x00\x00",  # 0 slots
    b"\x91\x94\xa6commit\xa4main\xc4\x04\x01\x00\x00\x00\xc4\x00",  # 1 seq, 0 frontiers
    b"\x91\x94\xa6commit\xa4main\xc4\x02\x01\x00\xc4\x02\x40\x00",  # 2 bytes each
    b"\x91\x94\xa6commit\xa3mtp\xc4\x00\xc4\x00",  # another pool
    b"\x91\x94\xa6commiT\xa4main\xc4\x00\xc4\x00",  # another tag
])
def test_what_the_parser_leaves_to_msgspec(payload: bytes) -> None:
    """Each is left to the caller, which decodes it: trailing bytes, fewer events than the
    header says, a field past the payload, the wrong field count for its tag, fields of
    different or non-int32 lengths, another pool, another tag."""
    assert shape(payload)[0] == -1


@pytest.mark.parametrize("payload", [
    b"\x91\x94\xa6commit\xa4main\xc4",  # a bin header without its length
    b"\x91\x94\xa6commit\xa4main",  # no fields at all
    b"\x92\x94\xa6commit\xa4main\xc4\x00\xc4\x00\x94\xa6commit\xa4main\xc4",  # 2nd cut
])
def test_no_row_is_written_for_an_event_whose_fields_do_not_parse(payload: bytes) -> None:
    """Review finding (fuzzing, no bug): such an event's row got a start of -1 and was left
    for the final check to reject; a slice of it under ``njit`` would wrap to the buffer's end.
    The parser stops at that event now, its row untouched (earlier events' rows are kept)."""
    n, rows = shape(payload)
    bad = payload.count(b"commit") - 1  # the event that is cut
    assert n == -1 and not rows[bad:].any()


def test_a_materialize_is_left_to_apply_while_the_pool_holds_host_replicas() -> None:
    """``apply(Materialize)`` refuses a new page in a slot that still records a host replica,
    a check on ``PoolState.host_of`` the kernel cannot make: with replicas, the parser does
    not take a Materialize."""
    payload = CODEC.encode([ev.Materialize("main", pack([1]), pack([3]), pack([5]))])
    assert shape(payload, with_mat=True)[0] == 1
    assert shape(payload, with_mat=False)[0] == -1


def full_state(st: StoreState) -> tuple[Any, ...]:
    """The digest and what it leaves out that a later event reads: reservations, slot counts,
    the free lists' bits and counts."""
    pools = tuple((p.reserved, p.n_slots, p.free_slots.n, p.free_pages.n,
                   p.free_slots.bits.tobytes(), p.free_pages.bits.tobytes(),
                   sorted(p.host_of)) for p in st.pools.values())
    return digest(st), st.seq, st.next_bundle, pools


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the compiled stretches applied, summed over the calls."""
    taken = [0]
    real = plain.apply_rounds

    def count(*args: Any) -> Any:
        out = real(*args)
        taken[0] += out[0] - args[3]
        return out
    monkeypatch.setattr(plain, "apply_rounds", count)
    return taken


SIMS = {"plain": {}, "offload": {"offload": True, "host_bytes": 8 << 20},
        "share": {"share": True}}


def by_event(d: str, until: int | None = None) -> Any:
    return replay(d, until_record=until, on_event=lambda *a: None)


@pytest.mark.parametrize("name", sorted(SIMS))
def test_plain_replay_is_event_by_event_replay(tmp_path: Path, name: str,
                                               counted: list[int]) -> None:
    """Simulated journals (memory pressure: Forks, COW tails, trims, releases; offloads and
    device drops; live sharing), replayed whole and to some records: plain replay (compiled
    stretches) and event-by-event replay reach the same state, the live store's digest, and
    plain replay took most records compiled."""
    d = str(tmp_path / "j")
    opts = SimOptions(max_concurrency=16, max_context=8192, kv_tokens=32768, scale=16,
                      journal_dir=d, **SIMS[name])
    store, _ = simulate(load_trace(DEFAULT_TRACE, 120), opts)
    live = store.digest()
    store.close()
    whole = replay(d)
    assert full_state(whole.state) == full_state(by_event(d).state) and whole.digest == live
    assert counted[0] > whole.records // 2, (counted[0], whole.records)
    for until in (1, 2, whole.records // 3, whole.records // 2 + 1):
        assert full_state(replay(d, until_record=until).state) \
            == full_state(by_event(d, until).state), until


def test_rounds_that_grow_the_arrays_across_segments(tmp_path: Path,
                                                     counted: list[int]) -> None:
    """Decode rounds whose Materialize makes the arrays grow (a 17th page), in a journal of
    many small segments: plain replay of the whole journal, and to the records on either side
    of a segment's start, equals event-by-event replay in every field above, and the whole
    equals the live store."""
    s = KVStore.open(small_config(tmp_path, segment_bytes=1024))
    a, b = running(s, 1000), running(s, 30)
    front = np.array([1000, 30])
    for _ in range(80):
        front += 1
        s.ensure_mapped_many("main", [a, b], front)
        step(s)
        s.commit_many("main", [a, b], front)
    step(s)
    want = full_state(s.state)
    s.close()
    d = str(tmp_path / "journal")
    whole = replay(d)
    assert full_state(whole.state)[0] == want[0] and full_state(whole.state)[2:] == want[2:]
    assert full_state(whole.state) == full_state(by_event(d).state)
    assert counted[0] > 40
    segs = JournalReader(d).scan.segments
    assert len(segs) >= 3
    for seg in segs[1:3]:
        first = int(seg.frames.rows[0, 2])
        for until in (first - 1, first, first + 1):
            assert full_state(replay(d, until_record=until).state) \
                == full_state(by_event(d, until).state), until


def test_struct_layout_is_what_the_parser_reads() -> None:
    """The fields after the tag, in order: pool, then the packed int32 fields."""
    assert ev.CommitFrontiers.__struct_fields__ == ("pool", "bundles", "frontiers")
    assert ev.Materialize.__struct_fields__ == ("pool", "bundles", "slots", "pages")
    assert ev.CommitFrontiers.__struct_config__.array_like
    assert struct.pack("<i", 1) == pack([1])  # little-endian int32s, as the kernel views them


def test_a_record_of_more_events_than_the_rows_is_left_to_msgspec() -> None:
    """The parser's rows hold ``MAX_EVENTS`` events: a longer record is decoded instead
    (never written past the rows)."""
    one = ev.CommitFrontiers("main", pack([1]), pack([64]))
    assert shape(CODEC.encode([one] * rk.MAX_EVENTS))[0] == rk.MAX_EVENTS
    assert shape(CODEC.encode([one] * (rk.MAX_EVENTS + 1)))[0] == -1


def u8(b: bytes) -> np.ndarray:
    return np.frombuffer(b, np.uint8)


NO = rk.NOT_TAKEN


@pytest.mark.parametrize(("data", "want"), [
    (b"\x93", (3, 1)), (b"\xdc\x01\x02", (258, 3)), (b"\xdd\x00\x01\x00\x02", (65538, 5)),
    (b"", (NO, NO)), (b"\xdc\x01", (NO, NO)), (b"\xdd\x00\x01\x00", (NO, NO)),
    (b"\xa3", (NO, NO)), (b"\xc4", (NO, NO))])
def test_array_header(data: bytes, want: tuple[int, int]) -> None:
    """Each form msgpack has, and each cut short: the end is ``len(data)``, and the buffer
    goes on with an array header, which a read past the end would take."""
    assert rk.array_header(u8(data + b"\x91\x91\x91\x91\x91"), 0, len(data)) == want


@pytest.mark.parametrize(("data", "want"), [
    (b"\xa4main", 5), (b"\xd9\x04main", 6), (b"\xda\x00\x04main", 7),
    (b"\xdb\x00\x00\x00\x04main", 9), (b"\xa4mai", NO), (b"\xa3mai", NO), (b"\xa5mainx", NO),
    (b"\xa4maiN", NO), (b"\xd9", NO), (b"\xda\x00", NO), (b"\xdb\x00\x00\x00", NO),
    (b"\xc4\x04main", NO)])
def test_str_equal(data: bytes, want: int) -> None:
    assert rk.str_equal(u8(data + b"n"), 0, len(data), MAIN) == want


@pytest.mark.parametrize(("data", "want"), [
    (b"\xc4\x02ab", (2, 2, 4)), (b"\xc5\x00\x02ab", (3, 2, 5)),
    (b"\xc6\x00\x00\x00\x02ab", (5, 2, 7)), (b"\xc4\x03ab", (NO, 0, NO)),
    (b"\xc4", (NO, 0, NO)), (b"\xc5\x00", (NO, 0, NO)), (b"\xc6\x00\x00\x00", (NO, 0, NO)),
    (b"\xa2ab", (NO, 0, NO))])
def test_bin_field(data: bytes, want: tuple[int, int, int]) -> None:
    assert rk.bin_field(u8(data + b"\x02\x02"), 0, len(data)) == want


def test_a_position_past_the_end_or_not_taken_reads_nothing() -> None:
    """Each parser refuses a position at the end (the bytes after it, here a well-formed
    value, are another field's or another record's) and passes on ``NOT_TAKEN`` (numba
    indexes from the end with -1: here the last byte would start a well-formed value)."""
    assert rk.array_header(u8(b"\x91"), 0, 0) == (NO, NO)
    assert rk.array_header(u8(b"\x91"), NO, 1) == (NO, NO)
    assert rk.str_equal(u8(b"\xa4main"), 0, 0, MAIN) == NO
    assert rk.str_equal(u8(b"main\xa4"), NO, 5, MAIN) == NO
    assert rk.bin_field(u8(b"\xc4\x00"), 0, 0) == (NO, 0, NO)
    assert rk.bin_field(u8(b"\x00\xc4"), NO, 2) == (NO, 0, NO)


def test_replay_to_a_record_does_not_read_the_next(tmp_path: Path) -> None:
    """Review finding: ``until_record=k`` with record k+1 undecodable. Plain replay never
    read it; event-by-event replay decoded it before checking its seq and raised. Both now
    stop at k with the same state."""
    s = KVStore.open(small_config(tmp_path))
    running(s, 100)
    step(s)
    assert s.journal is not None
    k = s.journal.append([ev.CommitFrontiers("main", pack([1]), pack([110]))], durable=True)
    s.journal.append_payload(b"\x91\xc1", durable=True)  # a valid CRC, no msgpack
    s.close()
    d = str(tmp_path / "journal")
    a, b, c = (replay(d, until_record=k), replay(d, until_record=k, until_event=1 << 62),
               replay(d, until_record=k, verify_every=1))
    assert a.digest == b.digest == c.digest and a.records == b.records == c.records
    for kw in ({}, {"until_event": 1 << 62}):
        with pytest.raises(JournalCorrupt, match=f"record {k + 1} has a valid CRC"):
            replay(d, **kw)  # type: ignore[arg-type]


def test_a_reader_with_another_codec_decodes_every_record(tmp_path: Path) -> None:
    """Review finding: the parser reads what the default codec writes; a ``JournalReader``
    given another codec (here one that does not know CommitFrontiers) had its decode-round
    records applied anyway. Plain replay now decodes them all with that codec, as
    event-by-event replay does."""
    import typing
    s = KVStore.open(small_config(tmp_path))
    running(s, 100)
    step(s)
    assert s.journal is not None
    s.journal.append([ev.CommitFrontiers("main", pack([1]), pack([110]))], durable=True)
    s.close()
    d = str(tmp_path / "journal")
    codec = EventCodec(typing.Union[tuple(t for t in typing.get_args(ev.Event)  # noqa: UP007
                                          if t is not ev.CommitFrontiers)])
    for kw in ({}, {"until_event": 1 << 62}):
        with pytest.raises(JournalCorrupt, match="commit"):
            replay(JournalReader(d, codec=codec), **kw)  # type: ignore[arg-type]
