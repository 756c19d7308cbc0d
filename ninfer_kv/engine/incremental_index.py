"""The incremental verifier's own indexes and its page / column checks (see
``engine.incremental`` for the invariants and how the indexes are kept).

``PoolMirror`` holds, per pool, what the checker last saw and counted itself: memberships and
active memberships per slot, each slot's device lease, the device-page -> slot
lease map, the sum of active reservations, the row leases, one ``SpaceMirror`` per space and
the pins it expects (pending host transfers, queued copies). ``check_pages`` moves those
indexes to what the touched pages hold now and checks each page; ``check_commit`` is the hot
path (a decode round's CommitFrontiers) and ``columns`` the frontier-block check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ninfer_kv.engine import invariant_kernels as ik
from ninfer_kv.engine.address_space import NO_ROW
from ninfer_kv.engine.layout import P
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
    """The checker's own indexes of one pool."""

    __slots__ = ("name", "refs", "arefs", "dev", "lease", "reserved", "rows", "spaces",
                 "pend", "copy", "committed")

    def __init__(self, name: str) -> None:
        self.name = name
        self.refs: list[int] = []          # slot -> memberships
        self.arefs: list[int] = []         # slot -> memberships in active spaces
        self.dev: list[int] = []           # slot -> device lease seen (NO_PAGE: none / dead)
        self.lease: dict[int, int] = {}    # device page -> slot
        self.reserved = 0
        self.rows: dict[int, int] = {}     # row -> bundle
        self.spaces: dict[int, SpaceMirror] = {}
        self.pend: dict[int, int] = {}     # slot -> pending host transfers
        self.copy: dict[int, int] = {}     # slot -> queued device copies (Pin - Unpin)
        # bundle -> the committed frontier last seen of its space (ik.ABSENT: no space);
        # an array, so the commit check (the hot path) runs compiled
        self.committed = np.full(64, ik.ABSENT, np.int64)

    def seen_committed(self, b: int) -> int:
        return int(self.committed[b])

    def see_committed(self, b: int, c: int) -> None:
        if b >= len(self.committed):
            grown = np.full(max(b + 1, 2 * len(self.committed)), ik.ABSENT, np.int64)
            grown[:len(self.committed)] = self.committed
            self.committed = grown
        self.committed[b] = c

    def forget(self, b: int) -> None:
        """Space ``b`` is gone from the mirror."""
        if b < len(self.committed):
            self.committed[b] = ik.ABSENT

    def extend(self, n: int) -> None:
        k = n - len(self.refs)
        if k > 0:
            self.refs += [0] * k
            self.arefs += [0] * k
            self.dev += [NO_PAGE] * k


def columns(pages: list[Any], members: list[int], c: int, lo: int, hi: int, k: int, b: int,
            out: list[str]) -> None:
    """Blocks ``lo..hi`` of space ``b`` (committed frontier ``c``): each holds the columns the
    frontier needs; blocks below ``k`` (pages no other check visits) also get the column range."""
    n = len(pages)
    for i in range(lo, hi):
        s = members[i]
        pg = pages[s] if s < n else None
        if pg is None:
            if i < k:
                out.append(f"bundle {b}: block {i} -> dead slot {s} (frontier block)")
            continue
        pc = pg.committed
        need = c - i * P
        if pc < (need if need < P else P):
            out.append(f"bundle {b}: block {i} page {s} committed {pc} < {min(P, need)}")
        if i < k and not 0 <= pg.protected <= pc <= P:
            out.append(f"page {s} columns protected={pg.protected} committed={pc} out of range "
                       f"(frontier block)")



def check_pages(pool: PoolState, pm: PoolMirror, slots: list[int], host: HostMirror | None,
                out: list[str]) -> None:
    """Page-level checks on ``slots`` after moving the lease/host indexes to what they hold.
    The page fields are read from the pool's arrays in one compiled gather
    (``invariant_kernels.gather_pages``; a page view per field read cost most of a verified
    replay, a numpy gather per field a fifth of it)."""
    if not slots:
        return
    n = pool.n_slots
    if min(slots) < 0:
        pool.pages[min(slots)]  # IndexError naming the slot, as a page view read raises
    live_l, dev_l, refs_l, act_l, pins_l, prot_l, comm_l, wr_l, free_slot_l = ik.gather_pages(
        np.fromiter(slots, np.int64, len(slots)), n, pool.pg_live, pool.pg_device, pool.pg_refs,
        pool.pg_active, pool.pg_pins, pool.pg_protected, pool.pg_committed, pool.pg_writer,
        pool.free_slots.bits).tolist()
    host_of = pool.host_of
    hosted = bool(host_of)  # once: the view's len is a method call
    fpb = pool.free_pages.bits
    nfp = len(fpb)
    refs, arefs, devs, lease = pm.refs, pm.arefs, pm.dev, pm.lease
    cap = pool.capacity
    spaces, pend, copy = pm.spaces, pm.pend, pm.copy
    pins_on = bool(pend or copy)
    no, p = NO_PAGE, P
    for j, s in enumerate(slots):
        live = live_l[j]
        old, new = devs[s], (dev_l[j] if live else no)
        if old != new:
            if old != no:
                if lease.get(old) == s:
                    del lease[old]
                if not (0 <= old < nfp and fpb[old]):
                    out.append(f"released device page {old} (slot {s}) is not on the free "
                               "list")
            if new != no:
                if not 0 <= new < cap:
                    out.append(f"device page id {new} of slot {s} out of range")
                o = lease.setdefault(new, s)
                if o != s:
                    out.append(f"device page {new} leased by slots {o} and {s} (§14)")
                if 0 <= new < nfp and fpb[new]:
                    out.append(f"leased device page {new} (slot {s}) is also on the free list")
            devs[s] = new
        h = host_of.get(s) if live and hosted else None
        if host is not None:
            host.sync_page(pm.name, s, h, out)
        if live and free_slot_l[j]:
            out.append(f"free slot {s} is live")
        if not live:
            if refs[s]:
                out.append(f"dead slot {s} still has {refs[s]} memberships")
            continue
        r, a_, pr = refs[s], arefs[s], refs_l[j]
        if pr != r:
            out.append(f"page {s} refs {pr} != memberships {r}")
        if act_l[j] != a_:
            out.append(f"page {s} active_refs {act_l[j]} != {a_}")
        if not 0 <= prot_l[j] <= comm_l[j] <= p:
            out.append(f"page {s} columns protected={prot_l[j]} committed="
                       f"{comm_l[j]} out of range")
        w = wr_l[j]
        if w != no:
            m = spaces.get(w)
            if m is None or not m.active or s not in m.mset:
                out.append(f"page {s} writer {w} is not an active member")
            if pr > 1:
                out.append(f"page {s} is shared ({pr} refs) but has writer {w} (§9.4)")
        if new == no and a_:
            out.append(f"page {s} is mapped by {a_} active spaces but has no device replica")
        want = (pend.get(s, 0) + copy.get(s, 0)) if pins_on else 0
        if pins_l[j] != want:
            out.append(f"page {pm.name}:{s} pins {pins_l[j]} != pending transfers and queued "
                       f"copies {want}")
        if pr == 0 and pins_l[j] == 0 and h is None:
            out.append(f"page {s} has no reference, pin or replica but is not recycled")


def check_commit(pool: PoolState, pm: PoolMirror, e: ev.CommitFrontiers, out: list[str]) -> None:
    """CommitFrontiers: per bundle the frontier order, then every block between the old and
    the new committed frontier holds the columns it needs (a decode step: one block). One
    compiled pass over the pool's arrays (``invariant_kernels.check_commit``): this is a
    verified replay's hot path."""
    rows = ik.check_commit(e.bundles, pool.bundle_index, pool.sp_committed, pool.sp_nmem,
                           pool.sp_protected, pool.sp_members, pool.n_slots, pool.pg_live,
                           pool.pg_committed, pool.pg_protected, pm.committed)
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
