"""A follower refuses what it cannot follow — a record out of order, a flipped byte, another
leader's plan — with a typed error, and its state (digest) is as it was. In one process: the
leader's messages are collected in a list instead of travelling over gloo."""

from __future__ import annotations

import msgspec
import pytest

from ninfer_kv import KVStore
from ninfer_kv.dist import (
    Follower,
    Leader,
    NotLeader,
    PlanMismatch,
    RecordRefused,
    ReplicaError,
    shard_config,
)
from ninfer_kv.dist.replica import MSG_MAGIC
from tests.dist import workers as w


def frames_of(message: bytes) -> list[bytes]:
    magic, _, _, _, _, frames = msgspec.msgpack.decode(message[:-4])
    assert magic == MSG_MAGIC
    return list(frames)


@pytest.fixture
def pair() -> tuple[KVStore, Leader, Follower, list[bytes]]:
    cfg = shard_config(w.config(), 2)
    sent: list[bytes] = []
    store = KVStore.open(cfg)
    leader = Leader(store, sent.append)
    follower = Follower.from_hello(cfg, sent.pop(0))
    assert follower.store.digest() == store.digest()
    s = store.activate(100, 10)                      # record 1: activate
    store.ensure_mapped(s, "main", 100)
    with leader.boundary():
        pass
    store.commit(s, "main", 100)                     # record 2: commit + second sequence
    store.activate(20, 5)
    with leader.boundary():
        pass
    yield store, leader, follower, sent
    store.close()


def test_reordered_record_is_refused_and_nothing_applied(pair) -> None:  # noqa: ANN001
    store, _, follower, sent = pair
    (r1,), (r2,) = frames_of(sent[0]), frames_of(sent[1])
    before = follower.store.digest()
    with pytest.raises(RecordRefused, match=r"out of order: expected seq \d+"):
        follower.apply_records([r2])
    with pytest.raises(RecordRefused, match="out of order"):
        follower.apply_records([r1, r1])            # a replayed record: refused as a whole
    assert follower.store.digest() == before
    follower.apply_records([r1])
    follower.apply_records([r2])
    assert follower.store.digest() == store.digest()
    follower.store.check_invariants()
    assert (follower.store.device.pools["main"].host_tables
            == store.device.pools["main"].host_tables).all()


def test_flipped_byte_is_refused_by_crc(pair) -> None:  # noqa: ANN001
    store, _, follower, sent = pair
    (r1,) = frames_of(sent[0])
    before = follower.store.digest()
    for at in (5, 40, len(r1) - 2):                 # frame header, payload, CRC itself
        bad = bytearray(r1)
        bad[at] ^= 0x10
        with pytest.raises(RecordRefused, match="CRC mismatch"):
            follower.apply_records([bytes(bad)])
        assert follower.store.digest() == before
    damaged = bytearray(sent[0])
    damaged[len(damaged) // 2] ^= 0x01
    with pytest.raises(RecordRefused, match="fails its CRC-32C"):
        follower.accept(bytes(damaged))
    assert follower.store.digest() == before
    for m in sent:                                   # the undamaged stream still applies
        follower.accept(m)
    assert follower.store.digest() == store.digest()


def test_leader_with_another_plan_is_refused() -> None:
    sent: list[bytes] = []
    store = KVStore.open(shard_config(w.config(), 2))
    Leader(store, sent.append)
    with pytest.raises(PlanMismatch, match=r"model: journal .*'kv_heads': 2.* != config "
                       r".*'kv_heads': 4"):
        Follower.from_hello(w.config(), sent[0])  # a follower that was not sharded
    with pytest.raises(PlanMismatch, match=r"M: journal 16 != config 8"):
        Follower.from_hello(shard_config(w.config(), 2, kv_tokens=8 * 64), sent[0])
    store.close()


def test_follower_never_commands_and_leader_attaches_first(pair) -> None:  # noqa: ANN001
    store, _, follower, sent = pair
    for m in sent:
        follower.accept(m)
    before = follower.store.digest()
    with pytest.raises(NotLeader, match="activate refused"):
        follower.store.activate(10, 1)
    with pytest.raises(NotLeader, match="commit refused"):
        follower.store.commit(follower.store.active()[0], "main", 1)
    assert follower.store.digest() == before
    with pytest.raises(ReplicaError, match="attach a Leader before any command"):
        Leader(store, lambda m: None)
