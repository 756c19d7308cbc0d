"""The record stream itself fails loudly and never silently: review findings on the TP path.
A leader attached with queued commands, a broken send or receive, a note that is not bytes, a
lost or repeated boundary message, a closed follower and malformed fields each end in a typed
error — and either nothing changed or that side stopped, never a follower quietly out of step.
In one process: messages travel through a list."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from ninfer_kv import KVStore
from ninfer_kv.dist import (
    Follower,
    Leader,
    RecordRefused,
    ReplicaDiverged,
    ReplicaError,
    StreamBroken,
    shard_config,
)
from ninfer_kv.dist.stream import MSG_MAGIC, VERSION, decode_hello, encode_hello, seal
from ninfer_kv.engine.state import decode_state, digest, encode_state
from ninfer_kv.errors import InvalidArgument, StoreClosed, StoreFailed
from tests.dist import workers as w


def one_boundary(store: KVStore, leader: Leader, tokens: int = 30) -> int:
    s = store.activate(tokens, 4)
    store.ensure_mapped(s, "main", tokens)
    with leader.boundary():
        pass
    return s


def test_a_leader_attaches_only_to_a_store_with_nothing_queued() -> None:
    """Review repro: a warm-up request finished without a boundary passed the check; its
    events were in the hello's state *and* in record 1, so the follower applied them twice
    and diverged silently."""
    store = KVStore.open(shard_config(w.config(), 2))
    s = store.activate(64, 1)
    store.ensure_mapped(s, "main", 64)
    with store.boundary():
        pass
    store.commit(s, "main", 64)
    store.finish(s)                       # nothing is held, but 3 events are queued
    with pytest.raises(ReplicaError, match="queued events"):
        Leader(store, lambda m: None)
    closed = KVStore.open(shard_config(w.config(), 2))
    closed.close()
    with pytest.raises(ReplicaError, match="open, healthy store"):
        Leader(closed, lambda m: None)
    with store.boundary():
        pass
    sent: list[bytes] = []
    leader = Leader(store, sent.append, send_digest=True)  # after the boundary: attaches
    follower = Follower.from_hello(store.config, sent.pop(0))
    one_boundary(store, leader)
    follower.accept(sent.pop(0))
    assert follower.store.digest() == store.digest()
    store.close()


def test_a_failed_receive_stops_the_follower_with_a_typed_error(pair) -> None:  # noqa: ANN001
    """Review repro: a leader that died mid-stream reached the follower as gloo's raw
    RuntimeError, and the follower was not marked stopped."""
    store, _, _, sent = pair

    def dead() -> bytes:
        raise RuntimeError("Connection closed by peer")

    follower = Follower.from_hello(store.config, _hello(store), dead)
    with pytest.raises(StreamBroken, match=r"the stream broke at seq \d+: RuntimeError"):
        follower.step()
    assert follower.failed is not None
    with pytest.raises(ReplicaDiverged, match="stopped earlier"):
        follower.accept(sent[0])


def _hello(store: KVStore) -> bytes:
    """A hello of a fresh leader-to-be's state (the pair's own was consumed)."""
    sent: list[bytes] = []
    fresh = KVStore.open(store.config)
    Leader(fresh, sent.append)
    fresh.close()
    return sent[0]


def test_a_failed_send_stops_the_stream_and_tells_who_it_can(pair) -> None:  # noqa: ANN001
    """Review repro: a send that raised inside Leader.boundary lost that boundary's records
    while the leader carried on: every later record was refused as out of order. Now the
    leader stops (StreamBroken), the followers that got the message get FAILED after it, and
    the store itself stays usable (its unit completed)."""
    store, leader, follower, sent = pair
    for m in sent:
        follower.accept(m)
    sent.clear()
    calls = {"n": 0}
    got: list[bytes] = []

    def flaky(message: bytes) -> None:   # rank 1 gets each message, rank 2's send fails once
        calls["n"] += 1
        got.append(message)
        if calls["n"] == 1:
            raise RuntimeError("rank 2 unreachable")

    leader._send = flaky
    s = store.activate(20, 3)
    store.ensure_mapped(s, "main", 20)
    with pytest.raises(StreamBroken, match="a send failed: RuntimeError"), leader.boundary():
        pass
    assert leader.failed is not None and store.record_hook is None
    follower.accept(got[0])                           # rank 1 had the boundary ...
    with pytest.raises(ReplicaDiverged, match="the leader failed"):
        follower.accept(got[1])                       # ... and learns the stream stopped
    seq = store.state.seq
    store.activate(10, 2)
    with pytest.raises(StreamBroken, match="stopped streaming earlier"), leader.boundary():
        pass
    assert store.state.seq == seq and store._pending  # refused before the store's boundary
    with pytest.raises(StreamBroken, match="stopped streaming earlier"):
        leader.flush(flags=0)
    with store.boundary():                            # the store itself goes on
        pass


def test_a_dead_rank_first_in_the_list_hides_nothing_from_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review repro: ``wire.sender`` gave up at the first rank whose send failed, and the
    leader's FAILED message went through the same send: with rank 1 dead, rank 2 got neither
    the boundary nor FAILED and waited in recv for the group's timeout. Every rank is tried
    now; rank 2 applies the boundary and learns that the stream stopped."""
    from ninfer_kv.dist import wire

    inbox: dict[int, list[bytes]] = {1: [], 2: []}
    dead = {1: False}

    def send_bytes(data: bytes, dst: int, group: object = None) -> None:
        if dead.get(dst):
            raise RuntimeError(f"connection reset by rank {dst}")
        inbox[dst].append(bytes(data))

    monkeypatch.setattr(wire, "send_bytes", send_bytes)
    cfg = shard_config(w.config(), 2)
    store = KVStore.open(cfg)
    leader = Leader(store, wire.sender([1, 2]))
    follower = Follower.from_hello(cfg, inbox[2][0])
    dead[1] = True
    s = store.activate(20, 3)
    store.ensure_mapped(s, "main", 20)
    with pytest.raises(StreamBroken, match=r"send to ranks \[1\] failed"), leader.boundary():
        pass
    boundary, failed = inbox[2][1:]
    follower.accept(boundary)
    assert follower.store.digest() == store.digest()
    with pytest.raises(ReplicaDiverged, match="the leader failed"):
        follower.accept(failed)
    store.close()


def test_a_note_that_is_not_bytes_is_refused_before_anything_is_published(
        pair) -> None:  # noqa: ANN001
    store, leader, follower, sent = pair
    for m in sent:
        follower.accept(m)
    sent.clear()
    s = store.activate(20, 3)
    seq, queued = store.state.seq, len(store._pending)
    for bad in ("text", 5, None):
        with pytest.raises(InvalidArgument, match="note must be bytes"), leader.boundary(bad):
            pass
    assert (store.state.seq, len(store._pending), sent) == (seq, queued, [])
    store.ensure_mapped(s, "main", 20)
    with leader.boundary(bytearray(b"step 3")):
        pass
    assert follower.accept(sent.pop(0)).note == b"step 3"
    assert follower.store.digest() == store.digest()


def test_close_tells_the_followers_when_its_last_boundary_fails(pair) -> None:  # noqa: ANN001
    """Review repro: close() published the queued commands; when that failed, neither FAILED
    nor END was sent and the followers waited for the group's timeout."""
    store, leader, follower, sent = pair
    for m in sent:
        follower.accept(m)
    sent.clear()
    s = store.activate(70, 10)
    store.ensure_mapped(s, "main", 70)               # new pages: table writes to fail

    def broken(*_: object) -> None:
        raise RuntimeError("device write failed")

    store.device.write_rows = broken
    with pytest.raises(StoreFailed):
        leader.close()
    with pytest.raises(ReplicaDiverged, match="the leader failed"):
        follower.accept(sent.pop(0))


def test_flush_with_queued_commands_is_refused(pair) -> None:  # noqa: ANN001
    """Review repro: flush() with send_digest sent the digest of a state that included queued
    commands whose records had not been sent: a healthy follower stopped as diverged."""
    store, leader, follower, sent = pair
    for m in sent:
        follower.accept(m)
    sent.clear()
    leader.send_digest = True
    store.activate(10, 2)
    with pytest.raises(ReplicaError, match=r"\d+ queued events"):
        leader.flush()
    assert not sent
    with leader.boundary():
        pass
    follower.accept(sent.pop(0))
    assert follower.failed is None and follower.store.digest() == store.digest()


def test_a_lost_or_repeated_message_is_refused_even_without_records(
        pair) -> None:  # noqa: ANN001
    """Review repro: only records were numbered, so a repeated boundary message with no
    record ran its unit twice, and a refused one was skipped with the digests still equal."""
    store, leader, follower, sent = pair
    for m in sent:
        follower.accept(m)
    sent.clear()
    with leader.boundary(b"a"):                      # no record: nothing was commanded
        pass
    with leader.boundary(b"b"):
        pass
    a, b = sent
    assert follower.accept(a).note == b"a"
    with pytest.raises(RecordRefused, match="message 3 out of order: expected message 4"):
        follower.accept(a)                           # repeated
    damaged = bytearray(b)
    damaged[-1] ^= 1
    with pytest.raises(RecordRefused, match="CRC"):
        follower.accept(bytes(damaged))
    one_boundary(store, leader)
    with pytest.raises(RecordRefused, match="expected message 4.*the last refusal: message"):
        follower.accept(sent[-1])                    # b was lost: the next one is refused
    assert follower.accept(b).note == b"b"           # delivered again, in order: applies
    follower.accept(sent[-1])
    assert follower.store.digest() == store.digest()


def test_a_closed_follower_applies_nothing(pair) -> None:  # noqa: ANN001
    store, _, follower, sent = pair
    follower.accept(sent[0])
    before = follower.store.digest()
    follower.close()
    with pytest.raises(StoreClosed, match="follower is closed"):
        follower.accept(sent[1])
    assert follower.store.digest() == before


BAD_MESSAGES: dict[str, Callable[[bytes, int], list[object]]] = {
    "flags": lambda f, salt: [MSG_MAGIC, VERSION, salt, 2, "x", b"", "", [f]],
    "frames": lambda f, salt: [MSG_MAGIC, VERSION, salt, 2, 0, b"", "", 7],
    "a frame": lambda f, salt: [MSG_MAGIC, VERSION, salt, 2, 0, b"", "", [7]],
    "note": lambda f, salt: [MSG_MAGIC, VERSION, salt, 2, 0, "text", "", [f]],
    "salt": lambda f, salt: [MSG_MAGIC, VERSION, "x", 2, 0, b"", "", [f]],
    "short": lambda f, salt: [MSG_MAGIC, VERSION, salt, 2],
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
def test_malformed_message_fields_are_refused(pair, name: str) -> None:  # noqa: ANN001
    from tests.dist.test_replica_refusals import frames_of

    store, _, follower, sent = pair
    follower.accept(sent[0])
    before = follower.store.digest()
    (frame,) = frames_of(sent[1])
    with pytest.raises(RecordRefused, match="malformed field"):
        follower.accept(seal(msgspec.msgpack.encode(BAD_MESSAGES[name](frame, follower.salt))))
    assert follower.store.digest() == before
    follower.accept(sent[1])


def test_malformed_hellos_are_refused(pair) -> None:  # noqa: ANN001
    store = pair[0]
    raw = msgspec.msgpack.decode(_hello(store)[:-4])
    h = decode_hello(_hello(store))
    for bad in ({k: v for k, v in raw.items() if k != "plan"},
                {k: v for k, v in raw.items() if k != "state"},
                {**raw, "plan": [1, 2]},
                {**raw, "salt": "x"}):
        with pytest.raises(RecordRefused, match="malformed field"):
            Follower.from_hello(store.config, seal(msgspec.msgpack.encode(bad)))
    with pytest.raises(RecordRefused, match="hello state does not decode"):
        Follower.from_hello(store.config, encode_hello(msgspec.structs.replace(
            h, state=b"\x01garbage")))
    broken = decode_state(h.state)        # decodes, digest announced to match, breaks §14
    broken.pools["main"].reserved += 1
    with pytest.raises(RecordRefused, match="breaks §14: main: reserved"):
        Follower.from_hello(store.config, encode_hello(msgspec.structs.replace(
            h, state=encode_state(broken), digest=digest(broken))))
    flipped = bytearray(_hello(store))
    flipped[len(flipped) // 3] ^= 4                   # e.g. the salt: now caught by the CRC
    with pytest.raises(RecordRefused, match="CRC"):
        Follower.from_hello(store.config, bytes(flipped))


def test_shard_config_refuses_bad_overrides_with_a_typed_error() -> None:
    with pytest.raises(InvalidArgument, match="derives model"):
        shard_config(w.config(), 2, model=w.config().model)
    with pytest.raises(InvalidArgument, match="overrides"):
        shard_config(w.config(), 2, no_such_field=1)


def test_a_checked_follower_forgets_what_its_leader_forgets() -> None:
    """Review finding: checked mode records every written position; only the leader's
    commands pruned them, so a follower's record grew with every token forever."""
    cfg = shard_config(w.config(checked=True), 2)
    sent: list[bytes] = []
    store = KVStore.open(cfg)
    leader = Leader(store, sent.append)
    follower = Follower.from_hello(cfg, sent.pop(0))
    s = one_boundary(store, leader, 100)
    follower.accept(sent.pop(0))
    for layer in range(w.LAYERS):                  # what the write guards recorded
        follower.store._written[("main", s, layer)] = set(range(100))
        store._written[("main", s, layer)] = set(range(100))
    store.commit(s, "main", 100)
    store.truncate(s, "main", 70)
    with leader.boundary():
        pass
    follower.accept(sent.pop(0))
    assert follower.store._written == store._written     # the commit settled [0, 100)
    store.finish(s)
    with leader.boundary():
        pass
    follower.accept(sent.pop(0))
    assert follower.store._written == store._written == {}
    store.close()
