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

Not in this version: the host tier on followers (HostReserve, DeviceRestore are refused with
``ReplicaUnsupported``) and standby promotion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import structlog
from crc32c import crc32c

from ninfer_kv.dist.errors import (
    NotLeader,
    PlanMismatch,
    RecordRefused,
    ReplicaDiverged,
    ReplicaError,
    ReplicaUnsupported,
)
from ninfer_kv.engine.capacity import geometry_mismatch
from ninfer_kv.engine.config import StoreConfig
from ninfer_kv.engine.device import DeviceState
from ninfer_kv.engine.state import decode_state, digest, encode_state
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import ConfigError, KVStoreError, StoreClosed
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import FRAME_OVERHEAD, pack_record, parse_frame
from ninfer_kv.replay.core import APPLY_ERRORS, apply_event

log = structlog.get_logger(__name__)

HELLO_MAGIC, MSG_MAGIC, VERSION = "NKVH", "NKVB", 1
END, FAILED = 1, 2
UNSUPPORTED = (ev.HostReserve, ev.DeviceRestore)
"""Events whose effect (a D2H or H2D copy of the rank's shard) a follower does not run yet."""


def shard_config(config: StoreConfig, tp: int, **overrides: Any) -> StoreConfig:
    """``config`` with ``kv_heads`` (and ``draft_kv_heads``) divided by ``tp`` — the store every
    TP rank opens, leader included. Refuses a head count ``tp`` does not divide."""
    tp = operator.index(tp)
    m = config.model
    if tp < 1 or m.kv_heads % tp or (m.draft_layers and m.draft_kv_heads % tp):
        raise ConfigError(f"tp={tp} must be >= 1 and divide kv_heads={m.kv_heads}"
                          + (f" and draft_kv_heads={m.draft_kv_heads}" if m.draft_layers else "")
                          + ": each rank holds kv_heads/tp heads")
    model = dataclasses.replace(m, kv_heads=m.kv_heads // tp,
                                draft_kv_heads=max(1, m.draft_kv_heads // tp))
    return dataclasses.replace(config, model=model, **overrides)


# --- leader -----------------------------------------------------------------------------------
class Leader:
    """Frames every record ``store`` publishes and sends them, one message per boundary, with
    ``send`` (``wire.sender(ranks)`` over torch.distributed, or any callable in tests). Attach
    before any command: followers start from the same empty pools."""

    def __init__(self, store: KVStore, send: Callable[[bytes], None], *,
                 send_digest: bool = False) -> None:
        st = store.state
        used = {n: p.allocated + p.reserved for n, p in st.pools.items()}
        if st.bundles or any(used.values()) or (st.host is not None and st.host.live_bytes):
            raise ReplicaError(f"attach a Leader before any command: the store already holds "
                               f"{len(st.bundles)} sequences/checkpoints and pages {used} "
                               "whose bytes no follower has")
        if store.record_hook is not None:
            raise ReplicaError("this store already streams its records to another Leader")
        self.store = store
        self._send = send
        self.send_digest = send_digest
        self.salt = random.getrandbits(32)
        self._crc = crc32c(encode_state(st))  # the chain starts at the state followers load
        self._frames: list[bytes] = []
        self.stats = {"messages": 0, "records": 0, "bytes": 0}
        self._hello = msgspec.msgpack.encode({
            "magic": HELLO_MAGIC, "version": VERSION, "salt": self.salt, "seq": st.seq,
            "chain": self._crc, "plan": st.plan, "state": encode_state(st),
            "digest": digest(st)})
        send(self._hello)
        store.record_hook = self._on_record

    def _on_record(self, seq: int, events: list[Any]) -> None:
        frame, self._crc = pack_record(seq, self._crc, self.salt, 0, CODEC.encode(events))
        self._frames.append(frame)

    def flush(self, note: bytes = b"", flags: int = 0) -> int:
        """Send the records since the last message (possibly none) and ``note`` (the
        scheduler's output, opaque here). Returns the bytes sent."""
        frames, self._frames = self._frames, []
        dig = digest(self.store.state) if self.send_digest else ""
        body = msgspec.msgpack.encode([MSG_MAGIC, VERSION, flags, bytes(note), dig, frames])
        msg = body + crc32c(body).to_bytes(4, "little")
        self._send(msg)
        self.stats["messages"] += 1
        self.stats["records"] += len(frames)
        self.stats["bytes"] += len(msg)
        return len(msg)

    @contextlib.contextmanager
    def boundary(self, note: bytes = b"") -> Iterator[int]:
        """``store.boundary()`` that also ships the boundary's records before the unit runs."""
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
        self.store.record_hook = None

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
            self.store._publish_record()
        self.flush(flags=END)
        self.store.record_hook = None


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
                 recv: Callable[[], bytes] | None = None) -> None:
        self.store = store
        self.salt = salt
        self.last_crc = chain
        self._recv = recv
        self.failed: str | None = None
        self.ended = False
        self.stats = {"messages": 0, "records": 0, "bytes": 0, "cow_copies": 0}

    @classmethod
    def join(cls, config: StoreConfig, recv: Callable[[], bytes]) -> Follower:
        """Receive the leader's hello with ``recv`` and open the follower store."""
        return cls.from_hello(config, recv(), recv)

    @classmethod
    def from_hello(cls, config: StoreConfig, hello: bytes,
                   recv: Callable[[], bytes] | None = None) -> Follower:
        try:
            h = msgspec.msgpack.decode(hello)
            magic, version = h["magic"], h["version"]
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            raise RecordRefused(f"hello of {len(hello)} bytes does not decode: {exc}") from None
        if (magic, version) != (HELLO_MAGIC, VERSION):
            raise RecordRefused(f"hello magic/version {magic!r}/{version} != "
                                f"{HELLO_MAGIC!r}/{VERSION}")
        if config.journal_path is not None or config.persist_dir is not None:
            raise ConfigError("a follower keeps no journal in this version (standby is not "
                              "implemented): open it with journal_dir=None, persist_dir=None")
        plan = config.plan()
        differ = geometry_mismatch(h["plan"], plan.to_dict())
        if differ or not h["plan"]:
            raise PlanMismatch("the leader's capacity plan differs from this follower's "
                               "(every TP rank opens the same shard_config; §3.3): "
                               + ("; ".join(differ) if differ else "leader has no plan"))
        state = decode_state(h["state"])
        if digest(state) != h["digest"] or state.seq != h["seq"]:
            raise RecordRefused(f"hello state at seq {state.seq} has digest {digest(state)}, "
                                f"the leader announced {h['digest']} at seq {h['seq']}")
        device = DeviceState({k.value: g for k, g in plan.layout.pools.items()}, plan.C,
                             plan.L, config.device, config.allocate_planes)
        store = FollowerStore(config, plan, state, None, (), device)
        log.info("replica.joined", seq=state.seq, pools=list(state.pools))
        return cls(store, h["salt"], h["chain"], recv)

    # --- the stream -------------------------------------------------------------------------
    def step(self) -> Step:
        """Receive one message (one leader boundary) and apply it."""
        if self._recv is None:
            raise ReplicaError("this follower has no receive function; call accept(message)")
        return self.accept(self._recv())

    def accept(self, message: bytes) -> Step:
        self._check_usable()
        if len(message) < 4 or crc32c(message[:-4]) != int.from_bytes(message[-4:], "little"):
            raise RecordRefused(f"message of {len(message)} bytes fails its CRC-32C: damaged "
                                "in transit; nothing applied")
        try:
            magic, version, flags, note, dig, frames = msgspec.msgpack.decode(message[:-4])
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            raise RecordRefused(f"message does not decode: {exc}") from None
        if (magic, version) != (MSG_MAGIC, VERSION):
            raise RecordRefused(f"message magic/version {magic!r}/{version} != "
                                f"{MSG_MAGIC!r}/{VERSION}")
        if flags & FAILED:
            self.failed = "the leader failed (fail-stop) and stopped streaming"
            raise ReplicaDiverged(f"follower at seq {self.store.state.seq}: {self.failed}")
        seq = self.apply_records(frames, dig or None)
        self.ended = bool(flags & END)
        self.stats["messages"] += 1
        self.stats["bytes"] += len(message)
        return Step(seq, len(frames), bytes(note), self.ended)

    def _check_usable(self) -> None:
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
        seq, crc = st.seq, self.last_crc
        decoded: list[tuple[int, int, list[Any]]] = []
        for i, f in enumerate(frames):
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
            bad = [type(e).__name__ for e in events if isinstance(e, UNSUPPORTED)]
            if bad:
                raise ReplicaUnsupported(f"record {fr.seq} holds {bad}: a follower does not "
                                         "run host-tier copies (§5.3) in this version; keep "
                                         "offload/restore off on TP stores")
            decoded.append((fr.seq, fr.crc, events))
            seq, crc = fr.seq, fr.crc
        for rseq, rcrc, events in decoded:
            self._apply(rseq, events)
            self.last_crc = rcrc
            self.stats["records"] += 1
        if leader_digest is not None and digest(st) != leader_digest:
            self.failed = f"digest {digest(st)} != leader's {leader_digest} at seq {st.seq}"
            raise ReplicaDiverged(f"follower diverged: {self.failed}")
        return st.seq

    def _apply(self, seq: int, events: list[Any]) -> None:
        store, st = self.store, self.store.state
        try:
            for i, e in enumerate(events):
                apply_event(st, e, seq, i)
            st.seq = seq
            for e in events:  # the device effects, in emission order (core._publish_record)
                if isinstance(e, ev.CopyTail) and store.device.pools[e.pool].planes:
                    store.device.copy_columns(e.pool, e.src_page, e.page, e.columns)
                    self.stats["cow_copies"] += 1
            sync_tables(store)
        except (*APPLY_ERRORS, KVStoreError, RuntimeError) as exc:  # UnappliableRecord too
            self.failed = f"record {seq}: {type(exc).__name__}: {exc}"
            log.error("replica.failed", reason=self.failed)
            raise ReplicaDiverged(f"follower stopped: {self.failed}") from exc
        store.stats["records"] += 1
        store.stats["events"] += len(events)

    def run(self, on_step: Callable[[Step], None] | None = None) -> int:
        """Follow until the leader ends the stream; returns the last seq."""
        while not self.ended:
            s = self.step()
            if on_step is not None:
                on_step(s)
        return self.store.state.seq

    def close(self) -> None:
        self.store.close()


def sync_tables(store: KVStore) -> int:
    """Publish every active row's membership (§7.2, §13): write each row from its first entry
    that differs and unmap what an earlier write mapped after it — the slice the leader wrote
    for its touched rows, so both tables are equal entry for entry. Returns rows written."""
    written = 0
    for name, pool in store.state.pools.items():
        pd = store.device.pools[name]
        pages = pool.pages
        for sp in pool.spaces.values():
            if not sp.active:
                continue
            n = sp.nmem
            want = np.fromiter((pages[s].device for s in sp.members),  # type: ignore[union-attr]
                               np.int32, n)
            diff = np.flatnonzero(pd.host_tables[sp.row, :n] != want)
            start = int(diff[0]) if diff.size else n
            if start == n and int(pd.published[sp.row]) == n:
                continue
            store.device.write_table(name, sp.row, start, want[start:])
            written += 1
    return written


def frame_bytes(frames: Sequence[bytes]) -> int:
    """Payload bytes of framed records (without the 32-byte frames)."""
    return sum(len(f) - FRAME_OVERHEAD for f in frames)


__all__ = ["Follower", "FollowerStore", "Leader", "Step", "shard_config", "sync_tables"]
