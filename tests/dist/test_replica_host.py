"""The host tier on TP followers (§5.3): every rank offloads and restores *its own shard*.

In one process, the leader's and the follower's planes hold different bytes, as two ranks'
KV-head shards do. An offload with ``drop_device`` then a continuation that restores the
pages must give each store back its own bytes, with the digests equal at every boundary and
each rank's host replicas checkable against its own CRCs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ninfer_kv import KVStore
from ninfer_kv.dist import Follower, Leader, ReplicaDiverged, ReplicaUnsupported, shard_config
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import pack_record
from tests.dist import workers as w

TOKENS = 128  # two full pages: every column of every page is committed


@pytest.fixture
def hosted() -> Iterator[tuple[KVStore, Leader, Follower, list[bytes]]]:
    cfg = shard_config(w.config(host_bytes=1 << 22), 2)
    sent: list[bytes] = []
    store = KVStore.open(cfg)
    leader = Leader(store, sent.append, send_digest=True)
    follower = Follower.from_hello(cfg, sent.pop(0))
    yield store, leader, follower, sent
    store.close()
    follower.close()


def _deliver(follower: Follower, sent: list[bytes]) -> None:
    while sent:
        follower.accept(sent.pop(0))


def _offloaded(store: KVStore, leader: Leader, follower: Follower, sent: list[bytes]
               ) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """A checkpoint of TOKENS tokens, offloaded with its device pages dropped on every rank;
    (checkpoint, the leader's page bytes, the follower's page bytes) before the drop."""
    s = store.activate(TOKENS, 8)
    store.ensure_mapped(s, "main", TOKENS)
    with leader.boundary():
        pass
    _deliver(follower, sent)
    w.fill_planes(store, 1)
    w.fill_planes(follower.store, 2)  # another shard: other bytes
    store.commit(s, "main", TOKENS)
    ck = store.finish(s, retain=True)
    assert ck is not None
    with leader.boundary():
        pass
    _deliver(follower, sent)
    mine, theirs = w.page_bytes_of(store, ck), w.page_bytes_of(follower.store, ck)
    assert not torch.equal(mine[0], theirs[0])
    assert store.offload(ck, drop_device=True) == 2
    with leader.boundary():           # HostReserve, the D2H copies, HostPublish + DeviceDrop
        pass
    _deliver(follower, sent)
    return ck, mine, theirs


def test_offload_and_restore_run_on_each_rank_over_its_own_shard(hosted) -> None:  # noqa: ANN001
    store, leader, follower, sent = hosted
    ck, mine, theirs = _offloaded(store, leader, follower, sent)
    p = follower.store.state.pools["main"]
    pages = [p.pages[s] for s in p.spaces[ck].members]
    assert all(pg is not None and pg.device == -1 and pg.host is not None for pg in pages)
    assert follower.store.digest() == store.digest()
    assert follower.stats["d2h_pages"] == 2
    # the state holds the leader's CRCs; the follower's own differ (other bytes) and match
    own = [follower.host_crcs[("main", s)][1] for s in p.spaces[ck].members]
    assert own != [pg.host[3] for pg in pages]  # type: ignore[union-attr]
    assert follower.verify_host() == []

    s2 = store.activate_from(ck, TOKENS, TOKENS + 4, 4)  # host-only pages: restored (H2D)
    store.ensure_mapped(s2, "main", TOKENS + 4)
    with leader.boundary():
        pass
    _deliver(follower, sent)
    assert follower.stats["h2d_pages"] == 2
    assert follower.store.digest() == store.digest()
    for got, want in ((w.page_bytes_of(store, s2), mine), (w.page_bytes_of(follower.store, s2), theirs)):
        for g, x in zip(got, want, strict=True):
            assert torch.equal(g[:2], x), "a rank restored bytes that are not its own shard's"
    follower.store.check_invariants()


def test_a_damaged_follower_replica_is_found_by_its_own_crc(hosted) -> None:  # noqa: ANN001
    store, leader, follower, sent = hosted
    ck, _, _ = _offloaded(store, leader, follower, sent)
    off, _ = follower.host_crcs[("main", follower.store.state.pools["main"].spaces[ck]
                                 .members[1])]
    assert follower.store.arena is not None
    follower.store.arena.data[off + 100] ^= 0xFF
    bad = follower.verify_host()
    assert len(bad) == 1 and f"host offset {off}" in bad[0]
    store.release(ck)                  # the replica goes away with its checkpoint
    with leader.boundary():
        pass
    _deliver(follower, sent)
    assert follower.verify_host() == [] and follower.host_crcs == {}


def test_a_publish_that_differs_from_the_followers_copy_stops_it(hosted, monkeypatch  # noqa: ANN001
                                                                  ) -> None:
    """A shard whose copy saw other epochs or coverage than the leader's (the ranks hold
    different pages) must not publish the leader's replica as its own."""
    from ninfer_kv.engine import host

    store, leader, follower, sent = hosted
    real = host.copy_out

    def skewed(st, tr):  # noqa: ANN001, ANN202 - the follower's copy only
        epochs, cov, crcs = real(st, tr)
        return (epochs, [c - 1 for c in cov], crcs) if st is follower.store else (epochs, cov,
                                                                                   crcs)

    monkeypatch.setattr(host, "copy_out", skewed)
    with pytest.raises(ReplicaDiverged, match="epochs/coverage"):
        _offloaded(store, leader, follower, sent)
    assert follower.failed is not None


def test_a_publish_without_the_followers_copy_stops_it(hosted) -> None:  # noqa: ANN001
    store, leader, follower, sent = hosted
    with leader.boundary():
        pass
    _deliver(follower, sent)
    e = ev.HostPublish("main", 0, ev.pack([0]), ev.pack([0]), ev.pack([64]), ev.pack_u32([1]))
    rec, _ = pack_record(follower.store.state.seq + 1, follower.last_crc, follower.salt, 0,
                         CODEC.encode([e]))
    with pytest.raises(ReplicaDiverged, match="ran no such D2H copy"):
        follower.apply_records([rec])


def test_a_follower_needs_the_leaders_host_arena() -> None:
    from ninfer_kv.dist import PlanMismatch

    cfg = shard_config(w.config(host_bytes=1 << 22), 2)
    sent: list[bytes] = []
    store = KVStore.open(cfg)
    Leader(store, sent.append)
    hello = sent.pop(0)
    for host_bytes in (0, 1 << 21):
        with pytest.raises(PlanMismatch, match="host arena"):
            Follower.from_hello(shard_config(w.config(host_bytes=host_bytes), 2), hello)
    store.close()


def test_host_copy_records_are_refused_whole_by_a_follower_without_an_arena(pair  # noqa: ANN001
                                                                             ) -> None:
    store, _, follower, sent = pair
    _deliver(follower, sent)
    before = follower.store.digest()
    for e in (ev.HostReserve("main", ev.pack([0]), ev.pack_i64([0])),
              ev.DeviceRestore("main", ev.pack([0]), ev.pack([0])),
              ev.HostPublish("main", 0, ev.pack([0]), ev.pack([0]), ev.pack([64]),
                             ev.pack_u32([1]))):
        rec, _ = pack_record(follower.store.state.seq + 1, follower.last_crc, follower.salt, 0,
                             CODEC.encode([e]))
        with pytest.raises(ReplicaUnsupported, match="no host arena"):
            follower.apply_records([rec])
        assert follower.store.digest() == before
        assert follower.failed is None


def test_verify_host_on_a_closed_follower_is_refused(hosted) -> None:  # noqa: ANN001
    from ninfer_kv.errors import StoreClosed

    store, leader, follower, sent = hosted
    _offloaded(store, leader, follower, sent)
    follower.close()
    with pytest.raises(StoreClosed, match="verify_host refused"):
        follower.verify_host()
