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
    ReplicaDiverged,
    ReplicaError,
    shard_config,
)
from ninfer_kv.dist.stream import END, FAILED, MSG_MAGIC, decode_hello, decode_message, encode_hello
from ninfer_kv.errors import StoreFailed
from tests.dist import workers as w
from tests.interrupts import Injector, lines_to_try


def frames_of(message: bytes) -> list[bytes]:
    m = decode_message(message)
    assert m.magic == MSG_MAGIC
    return list(m.frames)


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


@pytest.mark.parametrize("plan", [{}, {"version": 1}, "match"])
def test_a_hello_whose_plan_hides_the_geometry_is_refused(plan: object) -> None:
    """Review finding: the plan check compared only the keys both plans record, so a hello
    (CRC valid) whose plan left them out let a follower of 8 page groups join a leader of
    16 and write its page ids past its planes. Every geometry key must be there, and the
    pools the leader's state was configured with must be the follower's ("match": the
    follower's own plan in the hello, the leader's state behind it)."""
    sent: list[bytes] = []
    store = KVStore.open(shard_config(w.config(), 2))
    Leader(store, sent.append)
    small = shard_config(w.config(), 2, kv_tokens=8 * 64)
    h = decode_hello(sent[0])
    if plan == "match":
        plan = small.plan().to_dict()
    forged = encode_hello(msgspec.structs.replace(h, plan=plan))
    with pytest.raises(PlanMismatch, match="missing from the leader's plan|pools: leader"):
        Follower.from_hello(small, forged)
    assert Follower.from_hello(shard_config(w.config(), 2), sent[0]).seq == h.seq
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


def test_shard_config_refuses_a_tp_that_does_not_divide_the_heads() -> None:
    from ninfer_kv.errors import ConfigError

    with pytest.raises(ConfigError, match="tp=3 must be >= 1 and divide kv_heads=4"):
        shard_config(w.config(), 3)
    with pytest.raises(ConfigError, match="tp=0"):
        shard_config(w.config(), 0)


def test_records_of_another_stream_or_undecodable_are_refused(pair) -> None:  # noqa: ANN001
    from ninfer_kv.journal.events import CODEC
    from ninfer_kv.journal.format import pack_record

    store, _, follower, sent = pair
    (r1,) = frames_of(sent[0])
    before = follower.store.digest()
    other: list[bytes] = []
    second = KVStore.open(shard_config(w.config(), 2))
    lead2 = Leader(second, other.append)              # a different salt
    s = second.activate(10, 1)
    second.ensure_mapped(s, "main", 10)
    with lead2.boundary():
        pass
    (foreign,) = frames_of(other[-1])
    with pytest.raises(RecordRefused, match="another leader"):
        follower.apply_records([foreign])
    garbage, _ = pack_record(follower.store.state.seq + 1, follower.last_crc, follower.salt, 0,
                             b"\xc1 not msgpack")
    with pytest.raises(RecordRefused, match="payload does not decode"):
        follower.apply_records([garbage])
    with pytest.raises(RecordRefused, match="trailing bytes"):
        follower.apply_records([r1 + b"\x00"])
    assert CODEC is not None and follower.store.digest() == before
    follower.apply_records([r1])                      # the stream itself still applies
    second.close()


def test_a_diverged_or_ended_follower_stops(pair) -> None:  # noqa: ANN001
    from ninfer_kv.dist import ReplicaDiverged

    store, leader, follower, sent = pair
    for m in sent:
        follower.accept(m)
    sent.clear()
    leader.send_digest = True
    s = store.activate(30, 2)
    store.ensure_mapped(s, "main", 30)
    with leader.boundary():
        pass
    follower.accept(sent.pop(0))                      # digests agree
    store.commit(s, "main", 30)
    with leader.boundary():
        pass
    slot = follower.store.state.pools["main"].spaces[s].members[0]
    follower.store.state.pools["main"].pages[slot].epoch += 5    # simulate a divergence
    with pytest.raises(ReplicaDiverged, match="follower diverged"):
        follower.accept(sent.pop(0))
    with pytest.raises(ReplicaDiverged, match="stopped earlier"):
        follower.accept(b"anything")
    sent.clear()
    fresh_store = KVStore.open(shard_config(w.config(), 2))
    msgs: list[bytes] = []
    lead = Leader(fresh_store, msgs.append)
    f2 = Follower.from_hello(shard_config(w.config(), 2), msgs.pop(0))
    lead.close()
    assert f2.accept(msgs.pop(0)).end
    with pytest.raises(ReplicaError, match="ended this stream"):
        f2.accept(b"more")
    fresh_store.close()


@pytest.mark.parametrize("how", ["END", "FAILED", "close failed", "boundary failed"])
def test_nothing_follows_an_end_or_failed_message(how: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Review findings: after ``flush(flags=END)`` — and after a FAILED message, from
    ``flush(flags=FAILED)`` or a ``close()`` whose publication raised — the leader kept
    streaming boundaries the followers refuse (a standby, stopped, would never ack: the
    leader waited out the group's timeout). Either message ends the stream on the leader
    too: later boundaries and flushes are refused before anything is published, and
    close() has nothing left to do."""
    store = KVStore.open(shard_config(w.config(), 2))
    msgs: list[bytes] = []
    lead = Leader(store, msgs.append)
    follower = Follower.from_hello(shard_config(w.config(), 2), msgs.pop(0))
    if how == "close failed":
        store.activate(10, 10)                  # queued: close() publishes it first
        real = store._publish_record

        def interrupted() -> int:
            raise KeyboardInterrupt

        store._publish_record = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            lead.close()
        store._publish_record = real  # type: ignore[method-assign]
    elif how == "boundary failed":
        store.activate(10, 10)
        with monkeypatch.context() as m:
            m.setattr(store, "_append_pending", lambda: 1 / 0)  # the record cannot be written
            with pytest.raises(StoreFailed):
                with lead.boundary():
                    pass
    else:
        lead.flush(flags=END if how == "END" else FAILED)
    if how == "END":
        assert follower.accept(msgs.pop(0)).end
    else:
        with pytest.raises(ReplicaDiverged, match="the leader failed"):
            follower.accept(msgs.pop(0))
    if how == "boundary failed":  # the refusal says why
        for call in (lead.flush, lambda: lead.boundary().__enter__()):
            with pytest.raises(ReplicaError, match="the stream ended.*the store failed"):
                call()
        assert msgs == []
        lead.close()
        store.close()
        return
    store.activate(10, 10)
    seq = store.state.seq
    with pytest.raises(ReplicaError, match="the stream ended"):
        with lead.boundary():
            pass
    with pytest.raises(ReplicaError, match="the stream ended"):
        lead.flush()
    assert store.state.seq == seq and msgs == []
    lead.close()
    with store.boundary():  # the store goes on by itself
        pass
    assert msgs == []
    store.close()


def test_one_store_one_leader_and_a_failed_apply_stops_the_follower(pair) -> None:  # noqa: ANN001
    from ninfer_kv.dist import ReplicaDiverged

    store, leader, follower, sent = pair
    empty = KVStore.open(shard_config(w.config(), 2))
    Leader(empty, lambda m: None)
    with pytest.raises(ReplicaError, match="already streams its records"):
        Leader(empty, lambda m: None)
    empty.close()
    for m in sent:
        follower.accept(m)
    sent.clear()
    s = store.active()[-1]
    store.ensure_mapped(s, "main", 20)
    with leader.boundary():
        pass
    del follower.store.state.pools["main"].spaces[s]   # a follower whose state went wrong
    with pytest.raises(ReplicaDiverged, match="follower stopped: record"):
        follower.accept(sent.pop(0))
    assert follower.failed is not None


def test_bad_hellos_and_messages_are_refused(tmp_path) -> None:  # noqa: ANN001
    from crc32c import crc32c
    from msgspec.structs import replace

    from ninfer_kv.dist import ReplicaDiverged
    from ninfer_kv.dist.stream import END, FAILED, VERSION, decode_hello, encode_hello
    from ninfer_kv.errors import ConfigError, StoreClosed

    cfg = shard_config(w.config(), 2)
    sent: list[bytes] = []
    store = KVStore.open(cfg)
    Leader(store, sent.append)
    hello = decode_hello(sent[0])
    with pytest.raises(RecordRefused, match="hello of 3 bytes fails its CRC-32C"):
        Follower.from_hello(cfg, b"\x01\x02\x03")
    with pytest.raises(RecordRefused, match="hello magic/version"):
        Follower.from_hello(cfg, encode_hello(replace(hello, magic="XXXX")))
    with pytest.raises(ConfigError, match="needs ack="):
        Follower.from_hello(shard_config(w.config(journal_dir=str(tmp_path)), 2), sent[0])
    with pytest.raises(RecordRefused, match="the leader announced"):
        Follower.from_hello(cfg, encode_hello(replace(hello, digest="0" * 64)))
    follower = Follower.from_hello(cfg, sent[0])
    with pytest.raises(ReplicaError, match="no receive function"):
        follower.step()

    def framed(body: bytes) -> bytes:
        return body + crc32c(body).to_bytes(4, "little")

    before = follower.store.digest()
    with pytest.raises(RecordRefused, match="message does not decode"):
        follower.accept(framed(b"\xc1"))
    with pytest.raises(RecordRefused, match="message magic/version"):
        follower.accept(framed(msgspec.msgpack.encode(["XXXX", VERSION, hello.salt, 1, 0, b"",
                                                       "", []])))
    assert follower.store.digest() == before
    # review finding: another leader's record-less messages were applied (its note handed
    # to the engine, its END ending this stream) and any FAILED message, whatever its
    # number, stopped the follower: the salt is checked first, the number before FAILED
    other = (hello.salt + 1) & 0xFFFFFFFF
    for flags in (0, END, FAILED):
        with pytest.raises(RecordRefused, match="another leader"):
            follower.accept(framed(msgspec.msgpack.encode([MSG_MAGIC, VERSION, other, 1, flags,
                                                           b"B's schedule", "", []])))
    with pytest.raises(RecordRefused, match="out of order"):
        follower.accept(framed(msgspec.msgpack.encode([MSG_MAGIC, VERSION, hello.salt, 0,
                                                       FAILED, b"", "", []])))
    assert follower.store.digest() == before and follower.failed is None
    with pytest.raises(ReplicaDiverged, match=r"follower at seq \d+: the leader failed"):
        follower.accept(framed(msgspec.msgpack.encode([MSG_MAGIC, VERSION, hello.salt, 2,
                                                       FAILED, b"", "", []])))  # one late
    follower.close()
    with pytest.raises(StoreClosed, match="closed"):
        follower.store.activate(10, 1)
    store.close()


def test_a_refused_boundary_keeps_the_stream_a_failed_one_ends_it(pair) -> None:  # noqa: ANN001
    """Regression: a harmless FrozenUnit inside Leader.boundary detached the leader (later
    records were never shipped), and close() after a fail-stop told followers 'ended'."""
    from ninfer_kv.dist import ReplicaDiverged
    from ninfer_kv.errors import FrozenUnit, StoreFailed

    store, leader, follower, sent = pair
    with leader.boundary(), pytest.raises(FrozenUnit):
        with leader.boundary():                        # nested: refused, nothing changed
            pass
    s = store.activate(40, 60)
    store.ensure_mapped(s, "main", 40)
    with leader.boundary():
        pass
    for m in sent:
        follower.accept(m)
    assert follower.store.digest() == store.digest()    # still in step
    sent.clear()
    store.ensure_mapped(s, "main", 70)                  # a new page: its table entry

    def broken(*_: object) -> None:
        raise RuntimeError("device write failed")

    store.device.write_rows = broken                    # the next boundary fails
    with pytest.raises(StoreFailed), leader.boundary():
        pass
    leader.close()
    with pytest.raises(ReplicaDiverged, match="the leader failed"):
        for m in sent:
            follower.accept(m)


def test_export_waits_for_queued_copies_and_a_leader_store_imports_nothing() -> None:
    """Regression: export read pages whose COW tail copy was still queued (the receiver
    published the bytes before the copy), and import_ on a TP leader gave followers a
    checkpoint without bytes."""
    from ninfer_kv.dist import TransferRefused, import_
    from ninfer_kv.dist.transfer import _pages_of

    store = KVStore.open(w.config())
    s = store.activate(100, 1)
    store.ensure_mapped(s, "main", 100)
    with store.boundary():
        pass
    store.commit(s, "main", 100)
    ck = store.finish(s, retain=True)
    with store.boundary():
        pass
    child = store.activate_from(ck, 70, 70, 1)          # queues the tail copy (Fork mid-page)
    kept = store.finish(child, retain=True)
    with pytest.raises(TransferRefused, match="copies are queued"):
        _pages_of(store, kept)
    with store.boundary():
        pass
    assert [len(p) for _, _, p in _pages_of(store, kept)] == [2]
    store.close()
    leader_store = KVStore.open(shard_config(w.config(), 2))
    Leader(leader_store, lambda m: None)
    with pytest.raises(TransferRefused, match="streams its records"):
        import_(leader_store, 0)
    leader_store.close()


def test_bad_arguments_to_the_dist_api_are_typed() -> None:
    """Review finding: operator.index and unchecked bytes let TypeError escape; every entry
    point now refuses with InvalidArgument before anything moves, the follower unchanged."""
    from ninfer_kv.dist import export, import_
    from ninfer_kv.errors import InvalidArgument

    cfg = shard_config(w.config(), 2)
    store = KVStore.open(cfg)
    sent: list[bytes] = []
    leader = Leader(store, sent.append)
    follower = Follower.from_hello(cfg, sent.pop(0))
    cases = [lambda: shard_config(w.config(), 2.0), lambda: shard_config(w.config(), None),
             lambda: Follower.from_hello(cfg, "text"), lambda: follower.accept(None),
             lambda: follower.apply_records([None]), lambda: follower.apply_records(None),
             lambda: export(store, "1", 1), lambda: export(store, 1, 1.0),
             lambda: export(store, 1, 1, chunk_bytes=None), lambda: import_(store, "0"),
             lambda: leader.flush(flags="x"), lambda: leader.flush(flags=4)]
    for case in cases:
        with pytest.raises(InvalidArgument):
            case()
    assert follower.failed is None and follower.expect == 1
    assert follower.store.digest() == store.digest()
    store.close()



def test_an_interrupt_while_applying_leaves_the_follower_as_it_was_or_failed() -> None:
    """``KeyboardInterrupt`` at any line of ``apply_records``: the follower is as it was (the
    same record then applies), has applied the record whole, or failed (``ReplicaDiverged``
    from then on) — never a record half applied, or applied with the follower's seq not
    advanced (the next message would apply it again, or be refused as out of order)."""
    cfg = shard_config(w.config(), 2)
    sent: list[bytes] = []
    store = KVStore.open(cfg)
    leader = Leader(store, sent.append)
    hello = sent.pop(0)
    s = store.activate(100, 10)
    store.ensure_mapped(s, "main", 100)
    with leader.boundary():
        pass
    store.commit(s, "main", 100)
    store.activate(20, 5)
    with leader.boundary():
        pass
    (r1,), (r2,) = frames_of(sent[0]), frames_of(sent[1])
    dry = Injector(0, first="_apply")
    whole = Follower.from_hello(cfg, hello)
    assert dry.run(lambda: whole.apply_records([r1])) is None
    applied = (whole.seq, whole.store.digest())  # r1 applied whole
    outcomes = {"as it was": 0, "applied": 0, "failed": 0}
    for at in lines_to_try(dry.lines, dry.first_emit):
        f = Follower.from_hello(cfg, hello)
        before = (f.seq, f.store.digest())
        err = Injector(at).run(lambda f=f: f.apply_records([r1]))
        if err is None:
            continue  # past the lines this run took (from_hello ran untraced)
        assert isinstance(err, KeyboardInterrupt), (at, err)
        if f.failed is None:
            now = (f.seq, f.store.digest())
            assert now in (before, applied), at
            outcomes["as it was" if now == before else "applied"] += 1
            if now == before:
                f.apply_records([r1])
            f.apply_records([r2])
            assert f.store.digest() == store.digest(), at
        else:
            outcomes["failed"] += 1
            with pytest.raises(ReplicaDiverged):
                f.apply_records([r2])
        f.close()
    store.close()
    assert outcomes["failed"] and outcomes["as it was"], outcomes
