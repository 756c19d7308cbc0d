"""StoreCore: the store's lifecycle and event plumbing, under the commands of ``KVStore``.

What every command relies on lives here: the one path by which events reach the state
(``_emit`` -> ``apply``), the queues of the next boundary (pending events, device copies,
touched table rows, D2H transfers), the boundary itself (one journal record, then the device
effects in emission order, then the table-slice writes, then the transfers and their
publication), and fail-stop: after any failed write, fsync, msync, device effect or apply,
every later mutating call raises ``StoreFailed`` until the store is reopened.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from ninfer_kv.engine import effects, host, restart
from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.capacity import CapacityPlan
from ninfer_kv.engine.config import RecoveryReport, StoreConfig
from ninfer_kv.engine.device import DeviceState
from ninfer_kv.engine.durability import changes_what_survives, settle_ids
from ninfer_kv.engine.host_arena import HostArenaBuffer
from ninfer_kv.engine.invariants import load_snapshot
from ninfer_kv.engine.opening import open_store
from ninfer_kv.engine.state import StoreState, encode_state
from ninfer_kv.errors import FrozenUnit, KVStoreError, StoreClosed, StoreFailed
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack
from ninfer_kv.journal.ids import raise_floor
from ninfer_kv.journal.lock import DirLock, Process
from ninfer_kv.journal.log import Journal

if TYPE_CHECKING:
    from typing import Self

log = structlog.get_logger(__name__)


def loads(payload: bytes) -> bool:
    """Whether open would use a snapshot payload (``invariants.load_snapshot``: it decodes,
    and its state passes §14). Compaction and snapshot pruning ask it first."""
    try:
        load_snapshot(payload)
    except Exception:  # noqa: BLE001 - any failure means recovery would skip it
        return False
    return True


class StoreCore:
    """Lifecycle (open, close, snapshot, compact), fail-stop and the boundary. Not thread-safe
    (one engine loop). ``KVStore`` adds the commands."""

    def __init__(self, config: StoreConfig, plan: CapacityPlan, state: StoreState,
                 journal: Journal | None, locks: Sequence[DirLock] = (),
                 device: DeviceState | None = None) -> None:
        self.config = config
        self.plan = plan
        self.state = state
        self.journal = journal
        self.device = device or DeviceState({k.value: g for k, g in plan.layout.pools.items()},
                                            plan.C, plan.L, config.device,
                                            config.allocate_planes)
        self._journaled = journal is not None  # close() drops the journal, not this fact
        self._pending: list[Any] = []
        self._ids_durable = self._ids_base = state.next_bundle  # durability.settle_ids
        self._ids_acked: int | None = None  # a Leader's: the next id its standbys hold
        self._unjournaled: list[Any] = []  # applied, in no record for sure: never "surviving"
        self._in_boundary: list[Any] = []  # the events the running boundary journaled
        self._applied = 0  # events handed to apply, ever: ``command`` compares it
        # device copies for the next boundary, in emission order (a page group freed and
        # reused within one record must be read by an earlier copy before it is overwritten)
        self._effects: list[ev.CopyTail | ev.DeviceRestore] = []
        self._touched: dict[str, dict[int, int]] = {}  # pool -> bundle -> first block to publish
        # the same, since the last unit (a boundary's freeze .. unit_complete; a snapshot
        # publishes tables too but runs no unit): blocks no unit has written yet
        # (decode.refuse_unwritten)
        self._unwritten: dict[str, dict[int, int]] = {}
        self._freed_rows: dict[str, set[int]] = {}  # pool -> rows left by a finish: unmap
        self._written: dict[tuple[str, int, int], set[int]] = {}  # checked mode (checked.py)
        self._transfers: list[host.Transfer] = []       # D2H copies for the next boundary
        self._unpin_drops: dict[tuple[str, int], Any] = {}  # (pool, slot): drop at the Unpin
        self.arena: HostArenaBuffer | None = None
        self._frozen = self._closed = False
        self._failed: str | None = None
        self._locks = list(locks)
        self._snapshot_seq = state.seq
        self._pid = Process.pid  # a forked child must not use this store (commands check)
        self._os_pid = os.getpid()  # ... nor write its files (what writes asks the kernel)
        self.fault_hook: Callable[[str, str], None] | None = None
        """Test hook called as (step, pool) at each planning step of an activation."""
        self.record_hook: Callable[[int, list[Any]], None] | None = None
        """Called as (seq, events) for every record this store publishes (ninfer_kv.dist)."""
        self.recovery = RecoveryReport()
        self.stats = {"records": 0, "events": 0, "materialized": 0, "cow_copies": 0,
                      "d2h_pages": 0, "d2h_runs": 0, "h2d_pages": 0, "published": 0}

    # --- open / close -----------------------------------------------------------------------
    @classmethod
    def open(cls, config: StoreConfig | None = None) -> Self:
        """Lock, recover (read-only), validate, then open for writing (engine/opening.py)."""
        return open_store(cls, config)

    def _recover_cleanup(self) -> None:
        restart.recover_cleanup(self)

    @property
    def failed(self) -> str | None:
        """Why the store failed (fail-stop), or None."""
        return self._failed

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Publish what is pending (unless failed), sync, release files and locks. Idempotent."""
        if self._closed:
            self._release_locks()  # a close interrupted in its last lines left some
            return
        if os.getpid() != self._os_pid:  # a forked child's copy: write nothing, keep no lock
            self._closed = True
            return
        try:
            if self._failed is None and (self._pending or self._transfers or self._effects):
                self._frozen = False
                self._publish_record()
            if self.journal is not None and self._failed is None:
                try:
                    self.journal.sync()
                except KVStoreError as exc:
                    self._fail("close", exc)
                    raise StoreFailed(f"close: {self._failed}") from exc
        finally:
            self._closed = True
            try:
                if self.journal is not None:
                    with contextlib.suppress(KVStoreError, OSError):
                        self.journal.close()
                    self.journal = None
                if self.arena is not None:
                    with contextlib.suppress(OSError):
                        self.arena.close()
                    self.arena = None
            finally:  # whatever stopped the closing of the files: the locks go
                self._release_locks()

    def _release_locks(self) -> None:
        """Release every directory lock still held; each leaves the list only once released,
        so a release interrupted half way is finished by the next call (``close`` again)."""
        while self._locks:
            self._locks[-1].release()
            self._locks.pop()

    def snapshot(self) -> str | None:
        self._writer("snapshot")
        if self.journal is None:
            return None
        if self._pending or self._transfers or self._effects:
            self._publish_record()
        try:
            return self.journal.write_snapshot(encode_state(self.state), loads)
        except KVStoreError as exc:
            self._fail("snapshot", exc)
            raise StoreFailed(f"snapshot: {self._failed}") from exc

    def compact(self) -> int:
        """Remove journal segments wholly covered by the oldest kept snapshot."""
        self._writer("compact")
        if self.journal is None:
            return 0
        try:  # a snapshot open would skip licenses removing nothing
            raise_floor(self.journal.directory, self.state.next_bundle)  # their ids stay below
            return self.journal.compact(loads)
        except (OSError, KVStoreError) as exc:
            self._fail("compact", exc)
            raise StoreFailed(f"compact: {self._failed}") from exc

    # --- fail-stop ------------------------------------------------------------------------------
    def _usable(self, what: str) -> None:
        """Every mutating command starts here: closed, failed and frozen stores refuse."""
        if self._closed:
            raise StoreClosed(f"{what} refused: the store is closed")
        if Process.pid != self._pid:
            raise StoreFailed(f"{what} refused: this store was opened by process "
                              f"{self._os_pid}; a forked child must open its own (one writer "
                              "per directory)")
        if self._failed is not None:
            raise StoreFailed(f"{what} refused: the store failed earlier ({self._failed}); "
                              "reopen it to recover from the journal")
        if self._frozen:
            raise FrozenUnit(f"{what} refused: a GPU unit is in flight; tables, memberships and "
                             "frontiers are frozen until unit_complete() (§8.4)")

    def _writer(self, what: str) -> None:
        """``_usable``, then the kernel's pid: what writes the store's files (a boundary,
        snapshot, compact) refuses in a child that ``Process`` missed — one forked by C code
        bypassing ``PyOS_AfterFork`` — whose commands changed only its own memory."""
        self._usable(what)
        if os.getpid() != self._os_pid:
            raise StoreFailed(f"{what} refused: this store was opened by process "
                              f"{self._os_pid}, not this one ({os.getpid()}); a forked child "
                              "must open its own (one writer per directory)")

    def _fail(self, what: str, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = f"{what}: {type(exc).__name__}: {exc}"
            log.error("store.failed", reason=self._failed)
        # queued work is abandoned, never half-run later: the journal is the truth on reopen
        self._unjournaled += self._in_boundary + self._pending
        self._in_boundary = []
        self._pending.clear()
        self._effects.clear()
        self._touched.clear()
        self._unwritten.clear()
        self._freed_rows.clear()
        self._transfers.clear()
        self._unpin_drops.clear()

    # --- event plumbing ---------------------------------------------------------------------
    def _emit(self, *events: Any) -> None:
        st = self.state
        for e in events:
            self._applied += 1  # first: ``command`` fails the store if apply is interrupted
            try:
                apply(st, e)
            except Exception as exc:  # a validated event that does not apply is a bug: stop
                self._fail(f"apply {type(e).__name__}", exc)
                raise StoreFailed(f"event {type(e).__name__} could not be applied; the store "
                                  f"stopped: {self._failed}") from exc
            self._pending.append(e)

    def _touch(self, pool: str, bundle: int, block: int) -> None:
        for touched in (self._touched, self._unwritten):
            d = touched.get(pool)
            if d is None:
                d = touched[pool] = {}
            cur = d.get(bundle)
            if cur is None or block < cur:
                d[bundle] = block

    def _free_row(self, pool: str, row: int) -> None:
        """Row ``row`` of ``pool`` is left by a sequence leaving execution: the boundary unmaps
        its published entries (§7.2: an inactive space holds no row; a row nobody holds maps
        nothing), unless a new sequence leased it first (then it is published whole as its).
        Without this the row kept naming pages that are freed and reused: a ``table_rows``
        kept for the finished request read another's KV, or wrote it."""
        rows = self._freed_rows.get(pool)
        if rows is None:
            rows = self._freed_rows[pool] = set()
        rows.add(row)

    def _touch_many(self, pool: str, bundles: list[int], blocks: list[int]) -> None:
        """``_touch`` of each (bundle, block) pair; ``bundles`` are distinct (a batch)."""
        for touched in (self._touched, self._unwritten):
            d = touched.get(pool)
            if not d:  # the decode round's case: nothing else touched in this interval
                touched[pool] = dict(zip(bundles, blocks, strict=True))
                continue
            for bundle, block in zip(bundles, blocks, strict=True):
                cur = d.get(bundle)
                if cur is None or block < cur:
                    d[bundle] = block

    def _append_pending(self) -> int:
        seq = self.state.seq
        if self._pending:
            if self.journal is not None:
                seq = self.journal.append(self._pending, durable=changes_what_survives(
                    self._pending, self.state))
            else:
                seq += 1
            self.state.seq = seq
            settle_ids(self, seq)
            self.stats["records"] += 1
            self.stats["events"] += len(self._pending)
            self._in_boundary += self._pending
            if self.record_hook is not None:
                self.record_hook(seq, self._pending)
            self._pending = []
        return seq

    def _publish_record(self) -> int:
        """One boundary; any failure inside stops the store (fail-stop) and raises
        ``StoreFailed`` — nothing queued is left to run later (``KeyboardInterrupt`` and
        ``SystemExit`` stop it too, and reach the engine unchanged)."""
        self._in_boundary = []
        try:
            seq = self._publish_record_unguarded()
            self._in_boundary = []  # all of it is journaled: a later failure is not its
            return seq
        except BaseException as exc:
            self._fail("boundary", exc)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: as ``command``
                raise
            raise StoreFailed(f"boundary failed; the store stopped: {self._failed}") from exc

    def _publish_record_unguarded(self) -> int:
        """Append pending events as one record (write-ahead), then run the device effects in
        emission order — H2D restores and COW copies — and the table-slice writes. If copies
        ran, their pins are released in a second record; queued D2H transfers then run, are
        verified and published (with the device drops they allow) in that record, which is
        synced before the boundary returns (a durability point)."""
        seq = self._append_pending()
        if self._effects:  # none in a decode round
            effects.run(self, self._effects)
            self._effects.clear()
        if self.state.copy_pins:  # every queued copy ran: release what they pinned
            by_pool: dict[str, list[int]] = {}
            for (pool, slot), n in sorted(self.state.copy_pins.items()):
                by_pool.setdefault(pool, []).extend([slot] * n)
            self._emit(*(ev.Unpin(pool, pack(slots)) for pool, slots in by_pool.items()))
        if self._unpin_drops:  # device drops a copy pin held back (host._drop_when_published)
            drops, self._unpin_drops = self._unpin_drops, {}
            self._emit(*host.drops_after_unpin(self, drops))
        if self._freed_rows:
            self._unpublish_rows()
        if self._touched:
            self._publish_tables()
        durable = False
        if self._transfers:
            transfers, self._transfers = self._transfers, []
            published = host.run_transfers(self, transfers)
            self._emit(*published)
            self._emit(*host.drops_after_publish(self, transfers))
            durable = True
        if self._pending:
            seq = self._append_pending()
        if durable:
            if self.journal is not None:
                self.journal.sync()
            self.stats["published"] += len(published)  # once durable, not before
        every = self.config.snapshot_every
        if every and self.journal is not None and seq - self._snapshot_seq >= every:
            self.journal.write_snapshot(encode_state(self.state), loads)
            self._snapshot_seq = seq
        return seq

    def _unpublish_rows(self) -> None:
        """Unmap every entry of each row a finish left that no sequence leased since."""
        freed, self._freed_rows = self._freed_rows, {}
        for pool, rows in freed.items():
            owners = self.state.pools[pool].row_owner
            for r in rows:
                if r not in owners:
                    self.device.write_table(pool, r, 0, ())

    def _publish_tables(self) -> None:
        """The block-table slices of every touched active space, from its first changed block
        on (unmapping what an earlier write mapped after it): one compiled pass per pool."""
        touched, self._touched = self._touched, {}
        for pool, d in touched.items():
            n = len(d)
            self.device.write_rows(self.state.pools[pool], np.fromiter(d, np.int64, n),
                                   np.fromiter(d.values(), np.int64, n))

    # --- the GPU boundary (§8.4, §13) ---------------------------------------------------------
    def close_boundary(self) -> int:
        """Publish: journal record, device effects; then freeze until unit_complete(). An
        interrupt after the record (a ``KeyboardInterrupt`` between these lines) leaves the
        store unfrozen: the caller never learned that a unit may run, so none does."""
        self._writer("close_boundary")
        seq = self._publish_record()
        try:
            self._frozen = True
            return seq
        except BaseException:
            self._frozen = False
            raise

    def unit_complete(self) -> None:
        if self._frozen:  # a unit ran on the tables the boundary published: it may have
            self._unwritten = {}  # written every block they map
        self._frozen = False

    def boundary(self) -> _Boundary:
        """``with store.boundary() as seq:`` — ``close_boundary()`` on entry (the record's
        seq), ``unit_complete()`` on exit, whatever the unit raised."""
        return _Boundary(self)


class _Boundary:
    """``StoreCore.boundary``'s context manager: a class, not a generator, since it runs in
    every decode round (``contextlib.contextmanager`` cost 2 µs more a boundary here)."""

    __slots__ = ("_store",)

    def __init__(self, store: StoreCore) -> None:
        self._store = store

    def __enter__(self) -> int:
        return self._store.close_boundary()

    def __exit__(self, *exc: object) -> None:
        self._store.unit_complete()

