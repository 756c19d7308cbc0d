"""Journal-driven tensor-parallel replicas: one leader commands, followers apply its records.

Every TP rank opens a store of the *same* sharded configuration (``shard_config``: the model's
KV heads divided by ``tp``), so every capacity plan — page counts, rows, page ids — is the
same and only the planes' head extent differs. The leader (a normal ``KVStore``) plans; each
record it publishes is framed exactly as a journal record (docs/journal-format.md, "Record
frame": seq, prev_crc chain, salt, CRC-32C) and, at each boundary, the records since the last
one travel to the followers as one message. A follower verifies every frame of a message
before applying any, then applies the events through the same ``apply`` the store and replay
use, runs the device effects a record carries (partial-tail COW copies, §9.3) on its own
shard, and publishes its block-table rows (§13). Page ids, tables and digests are therefore
the leader's by construction; a follower that cannot follow stops loudly (fail-stop).

    leader = Leader(store, wire.sender([1]))          # rank 0, after KVStore.open(cfg)
    with leader.boundary(note=b"...") as seq:         # instead of store.boundary()
        launch(...)
    follower = Follower.join(cfg, wire.receiver(0))   # rank 1, same cfg
    step = follower.step()                            # the same boundary; step.note
    launch(...)                                       # on follower.store's views

The host tier (§5.3) runs on every rank over its own shard: every rank opens the same
``host_bytes``, so a HostReserve names the same arena offsets everywhere; after the record that
holds it, each follower packs its shard's pages into its own arena and checksums them, as the
leader did before its HostPublish. The state carries the leader's CRCs (digests stay equal);
each follower keeps its own beside it (``Follower.host_crcs``, ``Follower.verify_host``) and
checks the leader's published epochs and coverage against what it copied. Restores (H2D) run
on every rank from its own arena.

A follower opened with ``persist_dir`` is a standby (``dist.standby``): it journals what it
applies, acknowledges every message holding a record that changes what a reopen keeps (the
leader lists it in ``acks=`` and its boundary returns only after the ack), and
``Follower.promote()`` reopens it as a normal store after the leader died. Not in this
version: rebuilding a TP group from promoted ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import structlog
from crc32c import crc32c

from ninfer_kv.dist.errors import ReplicaError, SendFailed, StreamBroken
from ninfer_kv.dist.stream import (
    ACK,
    END,
    FAILED,
    HELLO_MAGIC,
    MSG_MAGIC,
    VERSION,
    Hello,
    Message,
    decode_ack,
    encode_hello,
    encode_message,
)
from ninfer_kv.engine import state as state_mod
from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.config import StoreConfig
from ninfer_kv.engine.durability import changes_what_survives, ids_window
from ninfer_kv.engine.state import digest, encode_state
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import ConfigError, InvalidArgument
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import pack_record

log = structlog.get_logger(__name__)



def shard_config(config: StoreConfig, tp: int, **overrides: Any) -> StoreConfig:
    """``config`` with ``kv_heads`` (and ``draft_kv_heads``) divided by ``tp`` — the store every
    TP rank opens, leader included. Refuses a head count ``tp`` does not divide."""
    tp = as_int("tp", tp)
    m = config.model
    if tp < 1 or m.kv_heads % tp or (m.draft_layers and m.draft_kv_heads % tp):
        raise ConfigError(f"tp={tp} must be >= 1 and divide kv_heads={m.kv_heads}"
                          + (f" and draft_kv_heads={m.draft_kv_heads}" if m.draft_layers else "")
                          + ": each rank holds kv_heads/tp heads")
    if "model" in overrides:
        raise InvalidArgument("shard_config derives model= from config (kv_heads / tp); "
                              "change config.model instead")
    model = dataclasses.replace(m, kv_heads=m.kv_heads // tp,
                                draft_kv_heads=max(1, m.draft_kv_heads // tp))
    try:
        return dataclasses.replace(config, model=model, **overrides)
    except TypeError as exc:
        raise InvalidArgument(f"shard_config overrides {sorted(overrides)}: {exc}") from None


# --- leader -----------------------------------------------------------------------------------
class Leader:
    """Frames every record ``store`` publishes and sends them, one message per boundary, with
    ``send`` (``wire.sender(ranks)`` over torch.distributed, or any callable in tests). Attach
    before any command: followers start from the same empty pools. A failed send stops the
    stream (``StreamBroken``): nothing can re-send what a follower missed."""

    def __init__(self, store: KVStore, send: Callable[[bytes], None], *,
                 send_digest: bool = False, acks: Sequence[Callable[[], bytes]] = ()) -> None:
        """``acks``: one receive function per standby rank (``wire.receiver(r)``). A boundary
        whose records change what a reopen keeps returns only once every standby
        acknowledged them durable (``Follower.promote`` then keeps them, §5.3). Use
        ``wire.sender`` and ``wire.receiver``: after a failed send, the leader reads the acks
        of the standbys that got the message before its FAILED message (on gloo they would
        otherwise wait for each other until the group's timeout), and only these say which
        ranks got it and which rank an ack comes from."""
        st = store.state
        used = {n: p.allocated + p.reserved for n, p in st.pools.items()}
        if st.bundles or any(used.values()) or (st.host is not None and st.host.live_bytes) \
                or store._pending:
            raise ReplicaError(f"attach a Leader before any command: the store already holds "
                               f"{len(st.bundles)} sequences/checkpoints, pages {used} and "
                               f"{len(store._pending)} queued events, which no follower has")
        if store.closed or store.failed is not None:
            raise ReplicaError("attach a Leader to an open, healthy store")
        if store.record_hook is not None:
            raise ReplicaError("this store already streams its records to another Leader")
        if not all(callable(a) for a in acks):
            raise InvalidArgument("acks: one receive function per standby rank")
        self.store = store
        self._send = send
        self._acks = list(acks)
        self._durable = False                 # a record since the last message must survive
        self.send_digest = send_digest
        self.salt = random.getrandbits(32)
        self._crc = crc32c(encode_state(st))  # the chain starts at the state followers load
        self._frames: list[bytes] = []
        self._n = 0                           # boundary messages sent
        self.failed: str | None = None
        self.ended = False                    # an END or FAILED message went: nothing follows
        self.stats = {"messages": 0, "records": 0, "bytes": 0, "acked": 0}
        self._hello = encode_hello(Hello(HELLO_MAGIC, VERSION, self.salt, st.seq, self._crc,
                                         st.plan, encode_state(st), digest(st)))
        self._transmit(self._hello)
        store.record_hook = self._on_record
        if self._acks:
            ids_window(store, st.next_bundle)

    def _detach(self) -> None:
        """The stream is over (ended, failed or closed): the store's records go nowhere. Its
        id window still counts from what the standbys acknowledged — one of them may be
        promoted — so the store hands out at most one more window of ids (then
        ``IdsExhausted``: reopen it, or attach a new Leader)."""
        self.store.record_hook = None

    def _on_record(self, seq: int, events: list[Any]) -> None:
        frame, self._crc = pack_record(seq, self._crc, self.salt, 0, CODEC.encode(events))
        self._frames.append(frame)
        st = self.store.state
        self._durable = self._durable or changes_what_survives(events, st)
        acked = self.store._ids_acked
        if acked is not None:  # a standby's journal must not lag the ids the leader hands
            # out by more than a promotion's reopen skips (state.ID_GAP): past half of it,
            # the message is acknowledged (the standby fsyncs first); the store's window
            # counts from the ids acknowledged too (durability.ids_window)
            self._durable = self._durable or st.next_bundle - acked > state_mod.ID_GAP // 2

    def _await_acks(self, n: int) -> None:
        """Every standby's ack of message ``n``, or stop the stream: a boundary whose durable
        records a standby may lack must not return."""
        for i, recv in enumerate(self._acks):
            try:
                a = decode_ack(recv())
                why = None if a.ok and a.n == n else (
                    f"standby {i} stopped: {a.error}" if not a.ok
                    else f"standby {i} acknowledged message {a.n}, not {n}")
            except Exception as exc:  # noqa: BLE001 - the link or the ack itself: stop
                why = f"no ack from standby {i}: {type(exc).__name__}: {exc}"
            if why is not None:
                self.failed = why
                self._detach()
                self._drain_acks(self._acks[i + 1:])  # the later standbys got it too
                self._n += 1
                with contextlib.suppress(Exception):
                    self._send(encode_message(Message(MSG_MAGIC, VERSION, self.salt, self._n,
                                                      FAILED, b"", "", [])))
                log.error("replica.leader_stopped", reason=why)
                raise StreamBroken(f"leader stopped streaming at message {n}: {why}; its "
                                   "durable records may be missing on that standby")

    def _drain_acks(self, acks: Sequence[Callable[[], bytes]],
                    missed: Sequence[int] | None = None) -> None:
        """Read (and drop) the ack of every standby in ``acks`` that got an ACK-flagged
        message, before a FAILED message goes: a standby sends its ack as soon as it applied
        the message, and on gloo a send waits for the matching receive — the leader's FAILED
        send to it and its ack to the leader would each wait for the other until the group's
        timeout (30 minutes by default). ``missed``: None when every standby got the message;
        else the ranks it did not reach (``SendFailed.ranks``), and only a ``wire.Receiver``
        from another rank is read (of any other receive, which rank it reads is unknown)."""
        for recv in acks:
            src = getattr(recv, "src", None)
            if missed is None or (src is not None and src not in missed):
                with contextlib.suppress(Exception):
                    recv()

    def _transmit(self, message: bytes, acked: bool = False) -> None:
        """Send, or stop the stream: the followers that got the message would wait for a
        next one that never comes, so a FAILED message goes after it (best effort), after
        the acks of the standbys that got an ACK-flagged one (``_drain_acks``)."""
        try:
            self._send(message)
        except Exception as exc:
            self.failed = f"a send failed: {type(exc).__name__}: {exc}"
            self._detach()
            if acked and isinstance(exc, SendFailed):  # who got it is known: drain those
                self._drain_acks(self._acks, exc.ranks)
            self._n += 1
            with contextlib.suppress(Exception):
                self._send(encode_message(Message(MSG_MAGIC, VERSION, self.salt, self._n,
                                                  FAILED, b"", "", [])))
            log.error("replica.leader_stopped", reason=self.failed)
            raise StreamBroken(f"leader stopped streaming: {self.failed}") from exc

    def flush(self, note: bytes = b"", flags: int = 0) -> int:
        """Send the records since the last message (possibly none) and ``note`` (the
        scheduler's output, opaque here). Returns the bytes sent. Refused while commands are
        queued (their records come at the next boundary)."""
        note = _note(note)
        flags = as_int("flags", flags, lo=0, hi=END | FAILED)  # ACK is the leader's to set
        self._check_streaming()
        if self.store._pending and not flags & FAILED:
            raise ReplicaError(f"flush with {len(self.store._pending)} queued events: their "
                               "record is published at the next boundary (Leader.boundary)")
        dig = digest(self.store.state) if self.send_digest and not flags & FAILED else ""
        frames, self._frames = self._frames, []
        wait = bool(self._acks) and self._durable and not flags & FAILED
        self._durable = False
        self._n += 1
        msg = encode_message(Message(MSG_MAGIC, VERSION, self.salt, self._n,
                                     flags | (ACK if wait else 0), note, dig, frames))
        self._transmit(msg, wait)
        self.stats["messages"] += 1
        self.stats["records"] += len(frames)
        self.stats["bytes"] += len(msg)
        if flags & (END | FAILED):  # followers stop here (a standby would never ack a later
            self.ended = True        # message): so does the leader
            self._detach()
        if wait:
            self._await_acks(self._n)
            self.stats["acked"] += 1
            ids_window(self.store, self.store.state.next_bundle)
        return len(msg)

    def _check_streaming(self) -> None:
        if self.failed is not None:
            raise StreamBroken(f"leader stopped streaming earlier: {self.failed}")
        if self.ended:
            why = f" (the store failed: {self.store.failed})" if self.store.failed else ""
            raise ReplicaError("the stream ended (close(), or a flush with END or FAILED): no "
                               f"message may follow it; followers join a new Leader{why}")

    @contextlib.contextmanager
    def boundary(self, note: bytes = b"") -> Iterator[int]:
        """``store.boundary()`` that also ships the boundary's records before the unit runs."""
        note = _note(note)                     # refused before anything is published
        self._check_streaming()
        try:
            seq = self.store.close_boundary()
        except BaseException:
            if self.store.failed is not None:  # the boundary failed: the stream ends here
                self._stop(FAILED)
            raise                              # a refusal (e.g. FrozenUnit) changed nothing
        try:
            self.flush(note)
            yield seq
        finally:
            self.store.unit_complete()

    def _stop(self, flags: int) -> None:
        with contextlib.suppress(Exception):  # best effort: the followers must not wait forever
            self.flush(flags=flags)
        self._detach()

    def close(self) -> None:
        """Ship what is pending and tell the followers the stream ended. The store stays
        open (the caller owns it)."""
        if self.store.record_hook is None:
            return
        if self.store.failed is not None:    # fail-stop: followers must not end "cleanly"
            self._frames.clear()
            self._stop(FAILED)
            return
        if self.store._pending and not self.store.closed:
            try:
                self.store._publish_record()
            except BaseException:
                self._frames.clear()
                self._stop(FAILED)
                raise
        self.flush(flags=END)
        self._detach()


def _note(note: bytes) -> bytes:
    if not isinstance(note, bytes | bytearray | memoryview):
        raise InvalidArgument(f"note must be bytes (the scheduler's output, opaque to the "
                              f"stream), not {type(note).__name__}")
    return bytes(note)


__all__ = ["Leader", "shard_config"]
