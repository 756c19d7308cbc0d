"""The follower side of the TP record stream (the protocol: ``replica``'s docstring, the
message format: ``stream``): a ``FollowerStore`` that never commands, fed by a ``Follower``
that verifies each boundary message whole before applying its records with the same
``apply`` the store and replay use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ninfer_kv.dist import standby
from ninfer_kv.dist.errors import (
    NotLeader,
    PlanMismatch,
    RecordRefused,
    ReplicaDiverged,
    ReplicaError,
    ReplicaUnsupported,
    StreamBroken,
)
from ninfer_kv.dist.follower_tables import forget_written, sync_tables
from ninfer_kv.dist.stream import (
    ACK,
    ACK_MAGIC,
    END,
    FAILED,
    VERSION,
    Ack,
    decode_hello,
    decode_message,
    encode_ack,
)
from ninfer_kv.engine import effects, host
from ninfer_kv.engine.capacity import GEOMETRY_KEYS, geometry_mismatch
from ninfer_kv.engine.config import StoreConfig
from ninfer_kv.engine.device import DeviceState
from ninfer_kv.engine.host_arena import HostArenaBuffer
from ninfer_kv.engine.invariants import load_snapshot
from ninfer_kv.engine.opening import pool_specs
from ninfer_kv.engine.state import digest
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import ConfigError, InvalidArgument, KVStoreError, StoreClosed
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import parse_frame
from ninfer_kv.replay.core import APPLY_ERRORS, apply_event

log = structlog.get_logger(__name__)

HOST_COPIES = (ev.HostReserve, ev.DeviceRestore, ev.HostPublish)
"""Events whose effect is a copy between this rank's planes and its host arena."""


# --- follower ---------------------------------------------------------------------------------
class FollowerStore(KVStore):
    """A store that only a ``Follower`` mutates: every command raises ``NotLeader``; views,
    ``table_rows``, ``digest``, ``checkpoint_info`` and ``check_invariants`` work."""

    def _usable(self, what: str) -> None:
        if self._closed:
            raise StoreClosed(f"{what} refused: the store is closed")
        raise NotLeader(f"{what} refused: this store follows a leader's records and never "
                        "commands; issue commands on the leader rank")


@dataclass(frozen=True, slots=True)
class Step:
    seq: int        # last record applied
    records: int    # records in this message
    note: bytes     # what the leader attached (scheduler output)
    end: bool       # the leader closed the stream


class Follower:
    """Applies a leader's records to a ``FollowerStore`` of the same (sharded) config."""

    def __init__(self, store: FollowerStore, salt: int, chain: int,
                 recv: Callable[[], bytes] | None = None, seq: int | None = None,
                 ack: Callable[[bytes], None] | None = None) -> None:
        self.store = store
        self.salt = salt
        self.last_crc = chain
        self.seq = store.state.seq if seq is None else seq  # the leader's last record applied
        self._recv = recv
        self._ack = ack               # a standby's: acknowledges ACK-flagged messages
        self._nacked = False
        self.expect = 1                 # the next boundary message's number
        self.refused: str | None = None  # why the last message was refused
        self.failed: str | None = None
        self.ended = False
        self.stats = {"messages": 0, "records": 0, "bytes": 0, "cow_copies": 0,
                      "d2h_pages": 0, "h2d_pages": 0}
        self._copied: list[tuple[host.Transfer, list[int], list[int], list[int]]] = []
        """D2H copies of this rank's shard run after their HostReserve's record, waiting for
        the leader's HostPublish: (transfer, epochs, coverages, this shard's CRCs)."""
        self.host_crcs: dict[tuple[str, int], tuple[int, int]] = {}
        """(pool, slot) -> (host offset, CRC-32C of *this rank's* packed page). The state
        holds the leader's CRCs (digests stay equal); these check this rank's arena."""

    @classmethod
    def join(cls, config: StoreConfig, recv: Callable[[], bytes],
             ack: Callable[[bytes], None] | None = None) -> Follower:
        """Receive the leader's hello with ``recv`` and open the follower store. A config
        with ``persist_dir`` opens a standby (``dist.standby``), which acknowledges durable
        records with ``ack`` (``wire.sender([leader])``; the leader lists it in ``acks``)."""
        return cls.from_hello(config, recv(), recv, ack)

    @classmethod
    def from_hello(cls, config: StoreConfig, hello: bytes,
                   recv: Callable[[], bytes] | None = None,
                   ack: Callable[[bytes], None] | None = None) -> Follower:
        h = decode_hello(hello)
        if standby.is_standby(config) != (ack is not None):
            raise ConfigError("a standby (a config with persist_dir or journal_dir) needs ack=, "
                              "the function that acknowledges durable records to the leader; "
                              "a follower without directories takes no ack")
        try:  # judged as open judges a snapshot: it decodes, and passes §14
            state = load_snapshot(h.state)
        except Exception as exc:  # noqa: BLE001 - any undecodable or broken state is refused
            raise RecordRefused(f"hello state does not decode or breaks §14: {exc}") from None
        specs = pool_specs(plan := config.plan())  # what page ids index; a key missing: foreign
        differ = [*geometry_mismatch(h.plan, plan.to_dict()),
                  *(f"{k}: missing from the leader's plan" for k in GEOMETRY_KEYS if k not in h.plan),
                  *([f"pools: leader {state.pool_specs} != {specs}"] if state.pool_specs != specs else [])]
        if differ:
            raise PlanMismatch("the leader's capacity plan differs from this follower's "
                               "(every TP rank opens the same shard_config; §3.3): "
                               + "; ".join(differ))
        if digest(state) != h.digest or state.seq != h.seq:
            raise RecordRefused(f"hello state at seq {state.seq} has digest {digest(state)}, "
                                f"the leader announced {h.digest} at seq {h.seq}")
        cap = state.host.capacity if state.host is not None else 0
        if cap != config.host_bytes:
            raise PlanMismatch(f"the leader's host arena holds {cap} B, this follower's "
                               f"host_bytes is {config.host_bytes} (every TP rank opens the "
                               "same shard_config; its offloads land at the leader's offsets)")
        if ack is not None:
            store = standby.open_standby(FollowerStore, config, h.digest)
        else:
            device = DeviceState({k.value: g for k, g in plan.layout.pools.items()}, plan.C,
                                 plan.L, config.device, config.allocate_planes)
            store = FollowerStore(config, plan, state, None, (), device)
            if cap:
                store.arena = HostArenaBuffer(cap)
        log.info("replica.joined", seq=state.seq, pools=list(state.pools),
                 standby=ack is not None)
        return cls(store, h.salt, h.chain, recv, h.seq, ack)

    # --- the stream -------------------------------------------------------------------------
    def step(self) -> Step:
        """Receive one message (one leader boundary) and apply it. A failed receive (the
        leader died, the link dropped) stops the follower: ``StreamBroken``."""
        if self._recv is None:
            raise ReplicaError("this follower has no receive function; call accept(message)")
        self._check_usable()
        try:
            message = self._recv()
        except Exception as exc:
            self.failed = f"the stream broke at seq {self.seq}: " \
                          f"{type(exc).__name__}: {exc}"
            log.error("replica.failed", reason=self.failed)
            raise StreamBroken(f"follower stopped: {self.failed}") from exc
        return self.accept(message)

    def accept(self, message: bytes) -> Step:
        """Apply one boundary message, or refuse it whole (``RecordRefused``: the state and
        the expected message number are as they were)."""
        self._check_usable()
        m = None
        try:
            m = decode_message(message)
            if m.salt != self.salt:  # before any flag: another stream's END or FAILED too
                raise RecordRefused(f"message {m.n}: salt {m.salt:#x} is not this stream's "
                                    f"{self.salt:#x} (another leader); nothing applied")
            if m.flags & FAILED and m.n >= self.expect:  # the one before may not have come
                self.failed = "the leader failed (fail-stop) and stopped streaming"
                raise ReplicaDiverged(f"follower at seq {self.seq}: {self.failed}")
            if m.n != self.expect:
                raise RecordRefused(
                    f"message {m.n} out of order: expected message {self.expect} (a lost, "
                    "repeated or reordered boundary; nothing applied)"
                    + (f"; the last refusal: {self.refused}" if self.refused else ""))
            seq = self.apply_records(m.frames, m.digest or None)
            if self._ack is not None and m.flags & ACK:
                self._acknowledge(m.n)
        except Exception as exc:
            if isinstance(exc, ReplicaError):  # named again when the next message is refused
                self.refused = str(exc)
            # a standby tells the leader, which may be waiting for its ack: when it stopped,
            # when the message asked for an ack, or when it could not read whether it did
            # (nothing re-sends a message; the leader's next ACK boundary stops the stream)
            leader_stopped = m is not None and m.flags & FAILED
            if self._ack is not None and not self._nacked and not leader_stopped and (
                    self.failed is not None or m is None or m.flags & ACK):
                self._nack(f"{type(exc).__name__}: {exc}")
            raise
        self.expect += 1
        self.refused = None
        self.ended = bool(m.flags & END)
        self.stats["messages"] += 1
        self.stats["bytes"] += len(message)
        return Step(seq, len(m.frames), m.note, self.ended)

    def _acknowledge(self, n: int) -> None:
        """A standby: make everything applied durable, then say so. Its records are applied
        already, so a failure here stops the follower (the leader hears it, or its wait for
        the ack fails)."""
        try:
            self.store.journal.sync()  # type: ignore[union-attr]
        except KVStoreError as exc:
            self.failed = f"the standby's journal sync failed at seq {self.seq}: {exc}"
            raise ReplicaDiverged(f"follower stopped: {self.failed}") from exc
        try:
            self._ack(encode_ack(Ack(ACK_MAGIC, VERSION, n, True, "")))  # type: ignore[misc]
        except Exception as exc:
            self.failed = f"the ack of message {n} was not sent: {type(exc).__name__}: {exc}"
            raise StreamBroken(f"follower stopped: {self.failed}") from exc

    def _nack(self, why: str) -> None:
        """Tell the leader this standby stopped, once (it reads it at its next ACK)."""
        self._nacked = True
        try:
            assert self._ack is not None
            self._ack(encode_ack(Ack(ACK_MAGIC, VERSION, self.expect, False, why[:500])))
        except Exception as exc:  # noqa: BLE001 - the leader may be gone: nothing to tell
            log.warning("replica.nack_failed", error=str(exc))

    def promote(self) -> KVStore:
        """Close this standby and reopen its directories as a normal ``KVStore`` (after the
        leader died): every checkpoint it acknowledged durable is kept, with this rank's
        shard in its host replicas; active sequences are aborted (``dist.standby``)."""
        if not standby.is_standby(self.store.config):
            raise ReplicaError("only a standby (a follower opened with persist_dir) keeps "
                               "what it applied: this follower has nothing to promote")
        self.failed = self.failed or "promoted"
        promoted = standby.promote(self.store)
        log.info("replica.promoted", seq=promoted.state.seq, leader_seq=self.seq,
                 checkpoints=sum(not b.active for b in promoted.state.bundles.values()))
        return promoted

    def _check_usable(self) -> None:
        if self.store.closed:
            raise StoreClosed("this follower is closed")
        if self.failed is not None:
            raise ReplicaDiverged(f"follower stopped earlier ({self.failed}); rebuild it")
        if self.ended:
            raise ReplicaError("the leader ended this stream")

    def apply_records(self, frames: Sequence[bytes], leader_digest: str | None = None) -> int:
        """Verify every frame (CRC, salt, seq = last + 1, prev_crc chain), decode every
        payload, and only then apply them in order with their device effects. A refusal
        leaves the state (and its digest) as it was."""
        self._check_usable()
        st = self.store.state
        seq, crc = self.seq, self.last_crc
        decoded: list[tuple[int, int, list[Any]]] = []
        if not isinstance(frames, list | tuple):
            raise InvalidArgument(f"frames: a list of framed records, not {type(frames).__name__}")
        for i, f in enumerate(frames):
            if not isinstance(f, bytes | bytearray | memoryview):
                raise InvalidArgument(f"frame {i}: {type(f).__name__}, not bytes")
            fr = parse_frame(f, 0)
            if isinstance(fr, str) or fr.end != len(f):
                why = fr if isinstance(fr, str) else f"{len(f) - fr.end} trailing bytes"
                raise RecordRefused(f"frame {i} of the message (expected record {seq + 1}): "
                                    f"{why}; nothing applied")
            if fr.salt != self.salt:
                raise RecordRefused(f"record {fr.seq}: salt {fr.salt:#x} is not this stream's "
                                    f"{self.salt:#x} (another leader); nothing applied")
            if fr.seq != seq + 1 or fr.prev_crc != crc:
                raise RecordRefused(f"record {fr.seq} out of order: expected seq {seq + 1} "
                                    f"with prev_crc {crc:#010x}, got prev_crc {fr.prev_crc:#010x}"
                                    " (records apply in journal order, no gap; nothing applied)")
            try:
                events = CODEC.decode(memoryview(f)[fr.payload_slice])
            except Exception as exc:  # noqa: BLE001 - any undecodable payload is refused
                raise RecordRefused(f"record {fr.seq}: payload does not decode: {exc}") from None
            if self.store.arena is None and any(isinstance(e, HOST_COPIES) for e in events):
                raise ReplicaUnsupported(f"record {fr.seq} holds a host-tier copy (§5.3) but "
                                         "this follower has no host arena: open every TP rank "
                                         "with the leader's host_bytes")
            decoded.append((fr.seq, fr.crc, events))
            seq, crc = fr.seq, fr.crc
        try:
            for rseq, rcrc, events in decoded:
                self._apply(rseq, events)
                self.seq, self.last_crc = rseq, rcrc
                self.stats["records"] += 1
        except BaseException as exc:  # an interrupt (Ctrl-C, a signal handler's SystemExit)
            # or a bug: a record half applied, or applied with seq not advanced — stop, as
            # ``engine.command.command`` stops a store; _apply named what it refused already
            if self.failed is None:
                self.failed = f"record {self.seq + 1}: {type(exc).__name__}: {exc}"
                log.error("replica.failed", reason=self.failed)
            raise
        if leader_digest is not None and digest(st) != leader_digest:
            self.failed = f"digest {digest(st)} != leader's {leader_digest} at seq {self.seq}"
            raise ReplicaDiverged(f"follower diverged: {self.failed}")
        return self.seq

    def _apply(self, seq: int, events: list[Any]) -> None:
        """Apply one record, then its effects as the leader's boundary ran them
        (``core._publish_record``): device copies and restores in emission order, the table
        rows, then the D2H copies its HostReserves queued — before the next record, whose
        HostPublish (and DeviceDrops) the leader emitted after those copies."""
        store, st = self.store, self.store.state
        try:
            kept = events   # what a standby journals: its own CRCs in each HostPublish
            for i, e in enumerate(events):
                if isinstance(e, ev.HostPublish):
                    crcs = self._published(e)
                    if store.journal is not None:
                        kept = [standby.own_publish(x, crcs) if x is e else x for x in kept]
                apply_event(st, e, seq, i)
            if store.journal is None:
                st.seq = seq
            device_effects = [e for e in events if type(e) in (ev.CopyTail, ev.DeviceRestore)]
            effects.run(store, device_effects)  # as the leader's boundary runs them
            for e in device_effects:
                if type(e) is ev.DeviceRestore:
                    self.stats["h2d_pages"] += len(ev.unpack(e.pages))
                elif store.device.pools[e.pool].planes:
                    self.stats["cow_copies"] += 1
            sync_tables(store)
            reserved = [host.Transfer(e.pool, ev.unpack(e.slots).tolist(),
                                      ev.unpack_i64(e.offsets).tolist(), set())
                        for e in events if isinstance(e, ev.HostReserve)]
            for tr in reserved:  # this rank's shard into its own arena (§5.3)
                self._copied.append((tr, *host.copy_out(store, tr)))
                self.stats["d2h_pages"] += len(tr.slots)
            if reserved and store.arena is not None:
                store.arena.flush()  # a standby's file: durable before its HostPublish is
            if store.journal is not None:
                st.seq = standby.persist(store, kept)
            forget_written(store, events)
        except (*APPLY_ERRORS, KVStoreError, RuntimeError, OSError) as exc:  # an msync too
            store._unjournaled += events  # applied, maybe unjournaled: reported as not durable
            self.failed = f"record {seq}: {type(exc).__name__}: {exc}"
            log.error("replica.failed", reason=self.failed)
            raise ReplicaDiverged(f"follower stopped: {self.failed}") from exc
        store.stats["records"] += 1
        store.stats["events"] += len(events)

    def _published(self, e: ev.HostPublish) -> list[int]:
        """The leader published the copy this rank ran after the HostReserve: the same pages
        at the same offsets, of the same epochs and coverage (else the shards differ in what
        they hold). Records and returns this rank's CRCs."""
        slots = ev.unpack(e.slots).tolist()
        if not self._copied or self._copied[0][0].pool != e.pool \
                or self._copied[0][0].slots != slots or self._copied[0][0].offsets[0] != e.offset:
            raise ReplicaError(f"HostPublish of pool {e.pool} pages {slots[:8]} at offset "
                               f"{e.offset}: this follower ran no such D2H copy (queued: "
                               f"{[(t.pool, t.slots[:8]) for t, *_ in self._copied]})")
        tr, epochs, cov, crcs = self._copied.pop(0)
        if ev.unpack(e.epochs).tolist() != epochs or ev.unpack(e.coverage).tolist() != cov:
            raise ReplicaError(f"HostPublish of pool {e.pool} pages {slots[:8]}: the leader "
                               f"copied epochs/coverage {ev.unpack(e.epochs).tolist()[:8]}/"
                               f"{ev.unpack(e.coverage).tolist()[:8]}, this rank "
                               f"{epochs[:8]}/{cov[:8]}")
        for slot, off, crc in zip(tr.slots, tr.offsets, crcs, strict=True):
            self.host_crcs[(tr.pool, slot)] = (off, crc)
        return crcs

    def verify_host(self) -> list[str]:
        """Recompute the CRC-32C of every host replica this rank holds (its own shard's
        packed page) against the CRC it computed at the copy: what ``verify_checkpoint`` is
        to a leader. Returns the mismatches (empty: all match). Forgets replicas the state
        no longer has."""
        if self.store.closed:
            raise StoreClosed("verify_host refused: this follower is closed (its arena with it)")
        st, arena, bad = self.store.state, self.store.arena, []
        for (pool, slot), (off, crc) in list(self.host_crcs.items()):
            pg = st.pools[pool].pages[slot]
            if pg is None or pg.host is None or pg.host[0] != off:
                del self.host_crcs[(pool, slot)]
                continue
            assert arena is not None
            pb = next(s.page_bytes for s in st.pool_specs if s.name == pool)
            got = host.page_checksum(arena.data[off:off + pb].numpy())
            if got != crc:
                bad.append(f"pool {pool} page {slot} at host offset {off}: CRC-32C {got:#010x}"
                           f" != {crc:#010x} computed at its copy")
        return bad

    def run(self, on_step: Callable[[Step], None] | None = None) -> int:
        """Follow until the leader ends the stream; returns the leader's last seq."""
        while not self.ended:
            s = self.step()
            if on_step is not None:
                on_step(s)
        return self.seq

    def close(self) -> None:
        self.store.close()


__all__ = ["Follower", "FollowerStore", "Step"]
