"""The incremental verifier's own indexes and its page / column checks (see
``engine.incremental`` for the invariants and how the indexes are kept).

``PoolMirror`` holds, per pool, what the checker last saw and counted itself: memberships,
active memberships and the XOR of the holding seqs per slot, each slot's device lease, the
device-page -> slot lease map (arrays, so the page checks run compiled), which seqs are
active, the sum of active reservations, the row leases, one ``SpaceMirror`` per space and
the pins it expects (pending host transfers, queued copies). ``check_pages`` moves those
indexes to what the touched pages hold now and checks each page; ``check_commit`` is the hot
path (a decode round's CommitFrontiers) and ``columns`` the frontier-block check; all three
run in ``invariant_kernels`` and word its rows here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ninfer_kv.engine import invariant_kernels as ik
from ninfer_kv.engine.address_space import NO_ROW
from ninfer_kv.engine.bundle_table import BundleTable
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.journal import events as ev

if TYPE_CHECKING:
    from ninfer_kv.engine.incremental_host import HostMirror


class SpaceMirror:
    """What the checker last saw of one address space."""

    __slots__ = ("members", "mset", "active", "ent", "row", "contrib")

    def __init__(self) -> None:
        self.members: list[int] = []
        self.mset: set[int] = set()
        self.active = False
        self.ent = 0
        self.row = NO_ROW          # leased row (only while active)
        self.contrib = 0           # entitlement - len(members) while active, else 0


class PoolMirror:
    """The checker's own indexes of one pool. The per-slot counts and the device-lease index
    are arrays, so ``check_pages`` runs compiled (``invariant_kernels.check_slots``)."""

    __slots__ = ("name", "n", "refs", "arefs", "owners", "dev", "lease", "lease_outside",
                 "leased", "reserved", "rows", "spaces", "pend", "copy", "ids", "index",
                 "committed", "active", "unused")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.n = 0                              # slots seen (the arrays may be longer)
        self.refs = np.zeros(0, np.int64)       # slot -> memberships
        self.arefs = np.zeros(0, np.int64)      # slot -> memberships in active spaces
        self.owners = np.zeros(0, np.int64)     # slot -> XOR of the seqs holding it
        self.dev = np.zeros(0, np.int64)        # slot -> device lease seen (NO_PAGE: none / dead)
        self.lease = np.full(capacity, NO_PAGE, np.int64)  # device page -> slot
        self.lease_outside: dict[int, int] = {}  # the same for page ids outside the pool
        self.leased = 0                          # pages in range with a lease
        self.reserved = 0
        self.rows: dict[int, int] = {}     # row -> bundle
        self.spaces: dict[int, SpaceMirror] = {}
        self.pend: dict[int, int] = {}     # slot -> pending host transfers
        self.copy: dict[int, int] = {}     # slot -> queued device copies (Pin - Unpin)
        # Per space the mirror holds (``see_committed`` adds one, ``forget`` drops it): the
        # committed frontier last seen and whether it is active, in arrays indexed by a mirror
        # index, so the commit and page checks (the hot paths) run compiled. Bundle ids reach
        # them through ``ids`` (a ``BundleTable``, for the kernels) and ``index`` (the same
        # map, for Python): memory follows the spaces that exist, not the ids handed out.
        self.ids = BundleTable()
        self.index: dict[int, int] = {}
        self.committed = np.full(64, ik.ABSENT, np.int64)
        self.active = np.zeros(64, np.int8)
        self.unused: list[int] = list(range(63, -1, -1))  # free mirror indexes (a stack)

    def seen_committed(self, b: int) -> int:
        k = self.index.get(b)
        return ik.ABSENT if k is None else int(self.committed[k])

    def see_committed(self, b: int, c: int) -> None:
        """Space ``b``'s committed frontier is ``c`` (a new space: also not active)."""
        k = self.index.get(b)
        if k is None:
            if not self.unused:
                n = len(self.committed)
                self.committed = np.concatenate((self.committed, np.full(n, ik.ABSENT,
                                                                          np.int64)))
                self.active = np.concatenate((self.active, np.zeros(n, np.int8)))
                self.unused = list(range(2 * n - 1, n - 1, -1))
            k = self.index[b] = self.unused.pop()
            self.ids.insert(b, k)
            self.active[k] = 0
        self.committed[k] = c

    def see_active(self, b: int, active: bool) -> None:
        """After ``see_committed(b, ..)``: space ``b`` is active or not."""
        self.active[self.index[b]] = active

    def forget(self, b: int) -> None:
        """Space ``b`` is gone from the mirror."""
        k = self.index.pop(b, None)
        if k is not None:
            self.ids.remove(b)
            self.committed[k] = ik.ABSENT
            self.active[k] = 0
            self.unused.append(k)

    def extend(self, n: int) -> None:
        """Room for slots below ``n`` (new slots: no memberships, no lease)."""
        self.n = max(self.n, n)
        k = len(self.refs)
        if n > k:
            size = max(n, 2 * k)
            self.refs = np.concatenate((self.refs, np.zeros(size - k, np.int64)))
            self.arefs = np.concatenate((self.arefs, np.zeros(size - k, np.int64)))
            self.owners = np.concatenate((self.owners, np.zeros(size - k, np.int64)))
            self.dev = np.concatenate((self.dev, np.full(size - k, NO_PAGE, np.int64)))

    def lease_page(self, page: int, slot: int) -> int:
        """``setdefault`` on the lease index: the slot that leases ``page`` now."""
        if 0 <= page < len(self.lease):
            o = int(self.lease[page])
            if o == NO_PAGE:
                self.lease[page] = o = slot
                self.leased += 1
            return o
        return self.lease_outside.setdefault(page, slot)

    def n_leased(self) -> int:
        return self.leased + len(self.lease_outside)


def bump(counts: np.ndarray, slots: list[int], d: int) -> None:
    """``counts[s] += d`` for each ``s`` in ``slots`` (repeats count twice): element by element
    when few (``np.add.at`` costs ~1.3 µs a call), else in one call."""
    if len(slots) < 8:
        for s in slots:
            counts[s] += d
    else:
        np.add.at(counts, slots, d)


def toggle(owners: np.ndarray, slots: list[int], b: int) -> None:
    """``owners[s] ^= b`` for each ``s`` in ``slots``: seq ``b``'s membership gained or lost
    them."""
    if len(slots) < 8:
        for s in slots:
            owners[s] ^= b
    else:
        np.bitwise_xor.at(owners, slots, b)


def columns(pool: PoolState, i: int, c: int, lo: int, hi: int, k: int, b: int,
            out: list[str]) -> None:
    """Blocks ``lo..hi`` of space ``b`` (its index ``i`` in the pool's space arrays,
    committed frontier ``c``): each holds the columns the frontier needs; blocks below ``k``
    (pages no other check visits) also get the column range. One compiled pass
    (``invariant_kernels.check_blocks``): a flip reads every block of a long prompt."""
    rows = ik.check_blocks(pool.sp_members[i], int(pool.sp_nmem[i]), c, lo, hi, k,
                           pool.n_slots, pool.pg_live, pool.pg_committed, pool.pg_protected)
    for kind, blk, s, x, y in rows.tolist():
        if kind == ik.B_DEAD:
            out.append(f"bundle {b}: block {blk} -> dead slot {s} (frontier block)")
        elif kind == ik.B_SHORT:
            out.append(f"bundle {b}: block {blk} page {s} committed {x} < {y}")
        elif kind == ik.B_RANGE:
            out.append(f"page {s} columns protected={x} committed={y} out of range "
                       f"(frontier block)")
        else:
            assert kind == ik.B_INDEX, kind
            raise IndexError(f"bundle {b}: block {blk} (slot {s}) outside its membership of "
                             f"{int(pool.sp_nmem[i])} pages, or a negative slot")


def check_pages(pool: PoolState, pm: PoolMirror, slots: list[int], host: HostMirror | None,
                out: list[str]) -> None:
    """Page-level checks on ``slots`` after moving the lease/host indexes to what they hold:
    one compiled pass over the pool's arrays and the mirror's (``invariant_kernels.
    check_slots``; in Python it cost 0.36 µs a slot, 40% of a verified replay), then the
    host-replica ownership (with a host tier: its problems follow the page problems)."""
    if not slots:
        return
    if min(slots) < 0:
        pool.pages[min(slots)]  # IndexError naming the slot, as a page view read raises
    arr = np.fromiter(slots, np.int64, len(slots))
    pend, copy = pm.pend, pm.copy
    want = (np.fromiter((pend.get(s, 0) + copy.get(s, 0) for s in slots), np.int64, len(slots))
            if pend or copy else np.zeros(len(slots), np.int64))
    rows, leased = ik.check_slots(
        arr, pool.n_slots, pool.pg_live, pool.pg_device, pool.pg_refs, pool.pg_active,
        pool.pg_pins, pool.pg_protected, pool.pg_committed, pool.pg_writer, pool.pg_host_off,
        pool.free_slots.bits, pool.free_pages.bits, len(pm.lease), pm.n, pm.refs, pm.arefs,
        pm.owners, pm.ids.array, pm.active, pm.dev, pm.lease, want)
    pm.leased += leased
    if len(rows):
        _word(pm, rows.tolist(), out)
    if host is not None:
        host_of, name, n = pool.host_of, pm.name, pool.n_slots
        for s in slots:
            live = s < n and pool.pg_live[s]
            host.sync_page(name, s, host_of.get(s) if live else None, out)


def _word(pm: PoolMirror, rows: list[list[int]], out: list[str]) -> None:
    """``check_slots``' rows as messages, in order; finishes the checks it leaves here."""
    for kind, a, b, c in rows:
        if kind == ik.K_RELEASED_NOT_FREE:
            out.append(f"released device page {a} (slot {b}) is not on the free list")
        elif kind == ik.K_OUT_OF_RANGE:
            out.append(f"device page id {a} of slot {b} out of range")
        elif kind == ik.K_DOUBLE_LEASE:
            out.append(f"device page {a} leased by slots {b} and {c} (§14)")
        elif kind == ik.K_LEASE_OUTSIDE:
            outside = pm.lease_outside
            if not c and outside.get(a) == b:      # released
                del outside[a]
            elif c and (o := outside.setdefault(a, b)) != b:
                out.append(f"device page {a} leased by slots {o} and {b} (§14)")
        elif kind == ik.K_ON_FREE_LIST:
            out.append(f"leased device page {a} (slot {b}) is also on the free list")
        elif kind == ik.K_FREE_SLOT_LIVE:
            out.append(f"free slot {a} is live")
        elif kind == ik.K_DEAD_REFS:
            out.append(f"dead slot {a} still has {b} memberships")
        elif kind == ik.K_REFS:
            out.append(f"page {a} refs {b} != memberships {c}")
        elif kind == ik.K_ACTIVE_REFS:
            out.append(f"page {a} active_refs {b} != {c}")
        elif kind == ik.K_COLUMNS:
            out.append(f"page {a} columns protected={b} committed={c} out of range")
        elif kind == ik.K_WRITER_NOT_MEMBER:
            out.append(f"page {a} writer {b} is not an active member")
        elif kind == ik.K_WRITER:
            m = pm.spaces.get(b)
            if m is None or not m.active or a not in m.mset:
                out.append(f"page {a} writer {b} is not an active member")
        elif kind == ik.K_SHARED_WRITER:
            out.append(f"page {a} is shared ({b} refs) but has writer {c} (§9.4)")
        elif kind == ik.K_NO_DEVICE:
            out.append(f"page {a} is mapped by {b} active spaces but has no device replica")
        elif kind == ik.K_PINS:
            out.append(f"page {pm.name}:{a} pins {b} != pending transfers and queued copies {c}")
        elif kind == ik.K_NOT_RECYCLED:
            out.append(f"page {a} has no reference, pin or replica but is not recycled")
        elif kind == ik.K_LOST:
            out.append(f"page {a} is held but has neither a device nor a host replica (lost, "
                       "§5.1)")
        else:
            assert kind == ik.K_MIRROR_SHORT, kind
            raise IndexError(f"slot {a} is past the checker's index of {pm.name} "
                             f"({pm.n} slots)")


def check_commit(pool: PoolState, pm: PoolMirror, e: ev.CommitFrontiers, out: list[str]) -> None:
    """CommitFrontiers: per bundle the frontier order, then every block between the old and
    the new committed frontier holds the columns it needs (a decode step: one block). One
    compiled pass over the pool's arrays (``invariant_kernels.check_commit``): this is a
    verified replay's hot path."""
    rows = ik.check_commit(e.bundles, pool.bundle_index, pool.sp_committed, pool.sp_nmem,
                           pool.sp_protected, pool.sp_members, pool.n_slots, pool.pg_live,
                           pool.pg_committed, pool.pg_protected, pm.ids.array,
                           pm.committed)
    for kind, x, a, b, c, d in rows.tolist():
        if kind == ik.C_NO_SPACE:
            out.append(f"commit names bundle {x} without a space in {e.pool}")
        elif kind == ik.C_ORDER:
            out.append(f"bundle {x}: frontiers protected={a} committed={b} membership={c} out "
                       "of order (commit)")
        elif kind == ik.C_DEAD:
            out.append(f"bundle {x}: block {a} -> dead slot {b} (committed block)")
        elif kind == ik.C_SHORT:
            out.append(f"bundle {x}: block {a} page {b} committed {c} < {d} (commit)")
        elif kind == ik.C_RANGE:
            out.append(f"page {x} columns protected={a} committed={b} out of range (commit)")
        else:
            pool.pages[x]  # IndexError naming the slot, as a page view read raises
