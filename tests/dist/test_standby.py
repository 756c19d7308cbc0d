"""A standby follower persists what it applies and is promoted after the leader dies, with
every checkpoint the leader's boundaries reported durable (§5.3) — holding *its own* shard.

In one process: the leader's messages reach the standby synchronously through ``Link`` and
its acks come back through a list, as ``wire.sender`` / ``wire.receiver`` carry them over
gloo (tests/dist/test_tp.py runs that path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer_kv import KVStore
from ninfer_kv.dist import Follower, Leader, PlanMismatch, ReplicaError, StreamBroken, shard_config
from ninfer_kv.errors import ConfigError, InvalidArgument
from tests.dist import workers as w

HOST = 1 << 22


class Link:
    """Delivers each leader message to the standby at once; collects its acks."""

    def __init__(self) -> None:
        self.hello: bytes | None = None
        self.follower: Follower | None = None
        self.acks: list[bytes] = []
        self.errors: list[BaseException] = []
        self.damage = False     # flip a byte of the next message in transit

    def send(self, message: bytes) -> None:
        if self.follower is None:
            self.hello = message
            return
        if self.damage:
            self.damage = False
            message = message[:20] + bytes([message[20] ^ 0x10]) + message[21:]
        try:
            self.follower.accept(message)
        except Exception as exc:  # noqa: BLE001 - the standby's failure is its own
            self.errors.append(exc)

    def ack(self) -> bytes:
        return self.acks.pop(0)


def cfg(tmp_path: Path, name: str, **kw: object) -> object:
    return shard_config(w.config(host_bytes=HOST, persist_dir=str(tmp_path / name), **kw), 2)


def pair(tmp_path: Path) -> tuple[KVStore, Leader, Follower, Link]:
    link = Link()
    store = KVStore.open(cfg(tmp_path, "leader"))  # type: ignore[arg-type]
    leader = Leader(store, link.send, send_digest=True, acks=[link.ack])
    assert link.hello is not None
    link.follower = Follower.from_hello(cfg(tmp_path, "standby"), link.hello,  # type: ignore[arg-type]
                                        ack=link.acks.append)
    return store, leader, link.follower, link


def retain_one(store: KVStore, leader: Leader) -> int:
    """A 64-token request written through one boundary, then finished with retain: its
    record (at the next boundary) changes what a reopen keeps."""
    s = store.activate(64, 1)
    store.ensure_mapped(s, "main", 64)
    with leader.boundary():
        pass
    store.commit(s, "main", 64)
    ck = store.finish(s, retain=True)
    assert ck is not None
    return ck


def _checkpoints(store: KVStore) -> dict[int, int]:
    return {b: store.checkpoint_info(b).frontier for b, x in store.state.bundles.items()
            if not x.active}


def test_a_promoted_standby_keeps_every_acknowledged_checkpoint_with_its_own_shard(
        tmp_path: Path) -> None:
    store, leader, standby, link = pair(tmp_path)
    a, b = store.activate(128, 4), store.activate(100, 4)
    store.ensure_mapped_many("main", [a, b], [128, 100])
    with leader.boundary():
        pass
    w.fill_planes(store, 1)
    w.fill_planes(standby.store, 2)                      # the other rank's shard: other bytes
    store.commit_many("main", [a, b], [128, 100])
    ck_a = store.finish(a, retain=True)
    ck_b = store.finish(b, retain=True)          # stays device-only: not durable anywhere
    assert ck_a is not None and ck_b is not None
    with leader.boundary():
        pass
    theirs = w.page_bytes_of(standby.store, ck_a)
    store.offload(ck_a, drop_device=True)
    with leader.boundary():                      # HostPublish: returns once the standby acked
        pass
    c = store.activate(30, 4)                    # an active sequence: a reopen aborts it
    store.ensure_mapped(c, "main", 30)
    with leader.boundary():
        pass
    assert not link.errors and not link.acks
    assert leader.stats["acked"] == 2            # the retained finishes, then the publish
    assert standby.store.digest() == store.digest()

    promoted = standby.promote()                 # the leader "dies": it never closes
    try:
        assert _checkpoints(promoted) == {ck_a: 128}
        assert sorted(promoted.recovery.dropped) == [ck_b, c]  # device-only, active
        promoted.check_invariants()
        s = promoted.activate_from(ck_a, 128, 130, 2)  # host-only pages: restored (H2D)
        promoted.ensure_mapped(s, "main", 130)
        with promoted.boundary():
            pass
        got = w.page_bytes_of(promoted, s)
        for g, want in zip(got, theirs, strict=True):
            assert torch.equal(g[:2], want), "the promoted standby restored another shard"
    finally:
        promoted.close()
    store.close()                                # the leader's own reopen keeps the same
    again = KVStore.open(store.config)
    try:
        assert _checkpoints(again) == {ck_a: 128}
    finally:
        again.close()


def test_only_messages_with_durable_records_wait_for_the_ack(tmp_path: Path) -> None:
    store, leader, standby, link = pair(tmp_path)
    s = store.activate(64, 8)
    for t in range(60, 68):                      # decode rounds: active sequences only
        store.ensure_mapped(s, "main", t)
        with leader.boundary():
            pass
        store.commit(s, "main", t)
    assert leader.stats["acked"] == 0 and not link.acks
    child = store.fork_live(s, 8)                # a transient checkpoint, made and released
    with leader.boundary():
        pass
    store.set_metadata(child, {"n": 2})          # of a running sequence: a reopen aborts it
    with leader.boundary():
        pass
    assert leader.stats["acked"] == 0
    store.finish(child, retain=False)
    store.finish(s, retain=False)                # nothing survives either way: no ack
    with leader.boundary():
        pass
    assert leader.stats["acked"] == 0
    assert standby.store.digest() == store.digest() and not link.errors
    store.close()


def test_a_durable_boundary_without_the_standbys_ack_stops_the_stream(tmp_path: Path) -> None:
    store, leader, standby, link = pair(tmp_path)
    retain_one(store, leader)         # queued: the next boundary is durable
    standby.store.close()                        # the standby is gone: no ack comes
    with pytest.raises(StreamBroken, match="no ack from standby 0"):
        with leader.boundary():
            pass
    assert leader.failed is not None
    store.close()


def test_a_standby_that_fails_tells_the_leader_why(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from ninfer_kv.dist import standby as sb
    from ninfer_kv.errors import JournalFailed

    store, leader, standby, link = pair(tmp_path)

    def full(store_: KVStore, events: list) -> int:  # noqa: ARG001
        raise JournalFailed("write of record 3: [Errno 28] No space left on device")

    monkeypatch.setattr(sb, "persist", full)
    s = store.activate(64, 1)
    store.ensure_mapped(s, "main", 64)
    with leader.boundary():                      # not durable: the leader does not wait ...
        pass
    assert standby.failed is not None and len(link.errors) == 1
    store.commit(s, "main", 64)
    store.finish(s, retain=True)
    with pytest.raises(StreamBroken, match="standby 0 stopped: .*No space left"):
        with leader.boundary():                  # ... but the next durable one hears why
            pass
    store.close()


def test_standby_refusals(tmp_path: Path) -> None:
    link = Link()
    store = KVStore.open(cfg(tmp_path, "leader"))  # type: ignore[arg-type]
    Leader(store, link.send, acks=[link.ack])
    assert link.hello is not None
    with pytest.raises(ConfigError, match="needs ack="):   # a standby acknowledges
        Follower.from_hello(cfg(tmp_path, "s1"), link.hello)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs ack="):   # a plain follower does not
        Follower.from_hello(shard_config(w.config(host_bytes=HOST), 2), link.hello,
                            ack=link.acks.append)
    with pytest.raises(InvalidArgument, match="one receive function per standby"):
        Leader(KVStore.open(shard_config(w.config(), 2)), link.send, acks=[None])  # type: ignore[list-item]
    link0 = Link()                         # no host tier anywhere: nothing would survive
    bare = KVStore.open(shard_config(w.config(), 2))
    Leader(bare, link0.send, acks=[link0.ack])
    assert link0.hello is not None
    with pytest.raises(ConfigError, match="needs persist_dir and host_bytes > 0"):
        Follower.from_hello(shard_config(w.config(persist_dir=str(tmp_path / "s2")), 2),
                            link0.hello, ack=link0.acks.append)
    assert not (tmp_path / "s2").exists()
    bare.close()
    used = tmp_path / "s3"
    first = Follower.from_hello(cfg(tmp_path, "s3"), link.hello,  # type: ignore[arg-type]
                                ack=link.acks.append)
    first.close()
    with pytest.raises(ConfigError, match="holding no journal or arena yet"):
        Follower.from_hello(cfg(tmp_path, "s3"), link.hello,  # type: ignore[arg-type]
                            ack=link.acks.append)
    assert (used / "journal").is_dir()
    plain = Follower.from_hello(shard_config(w.config(host_bytes=HOST), 2), link.hello)
    with pytest.raises(ReplicaError, match="nothing to promote"):
        plain.promote()
    store.close()

    # a leader whose host arena is in memory: its "durable" checkpoints die with it
    link2 = Link()
    mem = KVStore.open(shard_config(w.config(host_bytes=HOST), 2))
    Leader(mem, link2.send, acks=[link2.ack])
    assert link2.hello is not None
    with pytest.raises(PlanMismatch, match="persistent host tier"):
        Follower.from_hello(cfg(tmp_path, "s4"), link2.hello,  # type: ignore[arg-type]
                            ack=link2.acks.append)
    assert {p.name for p in (tmp_path / "s4" / "journal").iterdir()} <= {"LOCK"}
    assert not (tmp_path / "s4" / "host_arena.bin").exists()
    Follower.from_hello(cfg(tmp_path, "s4"), link.hello,  # type: ignore[arg-type]
                        ack=link.acks.append).close()  # the unused directories still serve
    mem.close()


def test_a_standby_promotes_itself_when_the_leader_process_dies(tmp_path: Path) -> None:
    """Over gloo: the leader process exits mid-stream after an acknowledged offload."""
    import json

    codes = w.launch(w.standby_worker, str(tmp_path))
    assert codes == [0, 0], codes
    lead = json.loads((tmp_path / "leader.json").read_text())
    got = json.loads((tmp_path / "standby.json").read_text())
    assert lead["acked"] >= 1
    assert "stream broke" in got["broke"]
    assert got["checkpoints"] == [lead["checkpoint"]]      # kept, with this rank's bytes
    assert got["own_bytes"] is True
    assert len(got["dropped"]) == 1                        # the active request, aborted
    assert got["violations"] == []


def test_a_standby_whose_sync_fails_after_applying_stops(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Review repro: the records were applied when the fsync before the ack failed; the
    follower then neither counted the message nor stopped, and took the next one for a
    repeat."""
    from ninfer_kv.errors import JournalFailed

    store, leader, standby, link = pair(tmp_path)
    retain_one(store, leader)         # queued: the next boundary is durable

    def broken() -> int:
        raise JournalFailed("fsync: [Errno 5] Input/output error")

    monkeypatch.setattr(standby.store.journal, "sync", broken)
    with pytest.raises(StreamBroken, match="standby 0 stopped: .*Input/output error"):
        with leader.boundary():
            pass
    assert standby.failed is not None and "journal sync failed" in standby.failed
    with pytest.raises(ReplicaError, match="stopped earlier"):
        standby.accept(b"")
    store.close()


def test_a_standby_whose_ack_cannot_be_sent_stops(tmp_path: Path) -> None:
    """The records are applied and durable, but the leader will never hear it: the standby
    stops (the stream is broken) instead of going on as if acknowledged."""
    store, leader, standby, link = pair(tmp_path)

    def gone(message: bytes) -> None:  # noqa: ARG001
        raise RuntimeError("Connection closed by peer")

    standby._ack = gone
    retain_one(store, leader)         # queued: the next boundary is durable
    with pytest.raises(StreamBroken, match="no ack from standby 0"):
        with leader.boundary():
            pass
    assert isinstance(link.errors[0], StreamBroken)  # then the FAILED message: refused
    assert standby.failed is not None and "was not sent" in standby.failed
    store.close()


def test_a_damaged_message_makes_the_standby_tell_the_leader_at_once(tmp_path: Path) -> None:
    """A message that fails its CRC does not say whether it asked for an ack; the leader may
    be waiting for one (over gloo, until the group's timeout): the standby tells it."""
    store, leader, standby, link = pair(tmp_path)
    retain_one(store, leader)         # queued: the next boundary is durable
    link.damage = True
    with pytest.raises(StreamBroken, match="standby 0 stopped: RecordRefused: message of"):
        with leader.boundary():
            pass
    store.close()


def test_a_standby_whose_journal_failed_is_still_promoted(tmp_path: Path, monkeypatch  # noqa: ANN001
                                                          ) -> None:
    """Review repro: after its fsync failed, the first promote() raised StoreFailed from
    close() (which re-synced the failed journal) and only a second call reopened."""

    store, leader, standby, link = pair(tmp_path)
    retain_one(store, leader)         # queued: the next boundary is durable
    journal = standby.store.journal
    assert journal is not None

    def eio() -> int:
        journal._fail("fsync: [Errno 5] Input/output error")
        return 0

    monkeypatch.setattr(journal, "sync", eio)
    with pytest.raises(StreamBroken):
        with leader.boundary():
            pass
    promoted = standby.promote()
    try:
        promoted.check_invariants()
    finally:
        promoted.close()
    store.close()


def test_a_failed_msync_of_the_standby_arena_stops_it(tmp_path: Path) -> None:
    """Review repro: an OSError from the arena's msync escaped raw and left the follower
    running with a HostReserve applied that its journal lacks."""
    from ninfer_kv.dist import ReplicaDiverged

    store, leader, standby, link = pair(tmp_path)
    ck = retain_one(store, leader)
    with leader.boundary():
        pass
    arena = standby.store.arena
    assert arena is not None and ck is not None

    def eio() -> None:
        raise OSError(5, "msync failed")

    arena.flush = eio  # type: ignore[method-assign]
    store.offload(ck)
    with pytest.raises(StreamBroken, match="standby 0 stopped: ReplicaDiverged"):
        with leader.boundary():
            pass
    assert isinstance(link.errors[0], ReplicaDiverged) and standby.failed is not None
    store.close()


class GlooLike:
    """``wire.send_bytes`` / ``recv_bytes`` with gloo's rule that matters here: a send waits
    for the matching receive, so a send to a standby whose own ack to the leader is not yet
    read would block both for the group's timeout (recorded in ``deadlocks``). Ranks in
    ``dead`` refuse sends; standbys apply at once and queue their acks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ninfer_kv.dist import wire
        self.standbys: dict[int, Follower] = {}
        self.hello: bytes = b""
        self.outbox: dict[int, list[bytes]] = {}
        self.dead: set[int] = set()
        self.ack_dead: set[int] = set()   # applied, then died before its ack was read
        self.deadlocks: list[int] = []
        monkeypatch.setattr(wire, "send_bytes", self.send_bytes)
        monkeypatch.setattr(wire, "recv_bytes", self.recv_bytes)

    def send_bytes(self, data: bytes, dst: int, group: object = None) -> None:
        if dst in self.dead:
            raise RuntimeError(f"connection reset by rank {dst}")
        if dst not in self.standbys:
            self.hello = bytes(data)
            return
        if self.outbox[dst]:
            self.deadlocks.append(dst)
            raise RuntimeError(f"timeout: rank {dst} is sending its ack")
        self.standbys[dst].accept(bytes(data))

    def recv_bytes(self, src: int, group: object = None) -> bytes:
        if src in self.ack_dead or src in self.dead:
            self.dead.add(src)
            raise RuntimeError(f"connection reset by rank {src}")
        if not self.outbox[src]:  # a live rank with nothing to send: gloo waits (a hang)
            self.deadlocks.append(src)
            raise RuntimeError(f"timeout: rank {src} sends nothing")
        return self.outbox[src].pop(0)

    def join(self, tmp_path: Path, rank: int, standby: bool) -> None:
        self.outbox[rank] = []
        config = cfg(tmp_path, f"rank{rank}") if standby else \
            shard_config(w.config(host_bytes=HOST), 2)
        self.standbys[rank] = Follower.from_hello(
            config, self.hello, ack=self.outbox[rank].append if standby else None)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", ["a follower's send fails", "a standby's ack fails",
                                  "a standby's send fails"])
def test_a_failed_durable_boundary_reads_the_pending_acks_before_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Review finding: a standby acks a durable message as soon as it applied it, and a
    gloo send waits for its receive. When the send to another rank failed (or another
    standby's ack did), the leader sent FAILED without reading the acks that were on their
    way: its send and the standby's ack waited for each other until the group's timeout
    (30 minutes by default; 12 s in the reviewer's 3-rank gloo run, the old code). Now the
    pending acks are read first; every live standby learns that the stream stopped."""
    from ninfer_kv.dist import wire
    from ninfer_kv.dist.errors import ReplicaDiverged
    net = GlooLike(monkeypatch)
    store = KVStore.open(cfg(tmp_path, "leader"))  # type: ignore[arg-type]
    leader = Leader(store, wire.sender([1, 2, 3]),
                    acks=[wire.receiver(2), wire.receiver(3)])
    for r in (1, 2, 3):  # rank 1 a plain follower, 2 and 3 standbys
        net.join(tmp_path, r, standby=r > 1)
    retain_one(store, leader)
    if case == "a follower's send fails":
        net.dead.add(1)
        stopped, live = "send to ranks \\[1\\] failed", (2, 3)
    elif case == "a standby's ack fails":
        net.ack_dead.add(2)
        stopped, live = "no ack from standby 0", (3,)
    else:  # standby 3 never got the message: the leader must not wait for its ack
        net.dead.add(3)
        stopped, live = "send to ranks \\[3\\] failed", (2,)
    with pytest.raises(StreamBroken, match=stopped), leader.boundary():
        pass
    assert net.deadlocks == []
    for r in live:  # each applied the durable boundary, then got FAILED: it stopped
        assert net.standbys[r].store.digest() == store.digest()
        with pytest.raises(ReplicaDiverged, match="the leader failed"):
            net.standbys[r].accept(b"")
    store.close()
