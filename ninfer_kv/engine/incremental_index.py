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

from ninfer_kv.engine.address_space import NO_ROW
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import unpack

if TYPE_CHECKING:
    from ninfer_kv.engine.incremental_host import HostMirror


class SpaceMirror:
    """What the checker last saw of one address space."""

    __slots__ = ("members", "mset", "active", "ent", "row", "committed", "contrib")

    def __init__(self) -> None:
        self.members: list[int] = []
        self.mset: set[int] = set()
        self.active = False
        self.ent = 0
        self.row = NO_ROW          # leased row (only while active)
        self.committed = 0
        self.contrib = 0           # entitlement - len(members) while active, else 0


class PoolMirror:
    """The checker's own indexes of one pool."""

    __slots__ = ("name", "refs", "arefs", "dev", "lease", "reserved", "rows", "spaces",
                 "pend", "copy")

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
    """Page-level checks on ``slots`` after moving the lease/host indexes to what they hold."""
    pages, n = pool.pages, len(pool.pages)
    refs, arefs, devs, lease = pm.refs, pm.arefs, pm.dev, pm.lease
    cap, free_pages, free_slots = pool.capacity, pool.free_pages, pool.free_slots
    spaces, pend, copy = pm.spaces, pm.pend, pm.copy
    pins_on = bool(pend or copy)
    no, p = NO_PAGE, P
    for s in slots:
        pg = pages[s] if s < n else None
        old, new = devs[s], (no if pg is None else pg.device)
        if old != new:
            if old != no:
                if lease.get(old) == s:
                    del lease[old]
                if old not in free_pages:
                    out.append(f"released device page {old} (slot {s}) is not on the free "
                               "list")
            if new != no:
                if not 0 <= new < cap:
                    out.append(f"device page id {new} of slot {s} out of range")
                o = lease.setdefault(new, s)
                if o != s:
                    out.append(f"device page {new} leased by slots {o} and {s} (§14)")
                if new in free_pages:
                    out.append(f"leased device page {new} (slot {s}) is also on the free list")
            devs[s] = new
        if host is not None:
            host.sync_page(pm.name, s, pg, out)
        if pg is not None and s in free_slots:
            out.append(f"free slot {s} is live")
        if pg is None:
            if refs[s]:
                out.append(f"dead slot {s} still has {refs[s]} memberships")
            continue
        r, a, pr = refs[s], arefs[s], pg.refs
        if pr != r:
            out.append(f"page {s} refs {pr} != memberships {r}")
        if pg.active_refs != a:
            out.append(f"page {s} active_refs {pg.active_refs} != {a}")
        if not 0 <= pg.protected <= pg.committed <= p:
            out.append(f"page {s} columns protected={pg.protected} committed="
                       f"{pg.committed} out of range")
        w = pg.writer
        if w != no:
            m = spaces.get(w)
            if m is None or not m.active or s not in m.mset:
                out.append(f"page {s} writer {w} is not an active member")
            if pr > 1:
                out.append(f"page {s} is shared ({pr} refs) but has writer {w} (§9.4)")
        if new == no and a:
            out.append(f"page {s} is mapped by {a} active spaces but has no device replica")
        want = (pend.get(s, 0) + copy.get(s, 0)) if pins_on else 0
        if pg.pins != want:
            out.append(f"page {pm.name}:{s} pins {pg.pins} != pending transfers and queued "
                       f"copies {want}")
        if pr == 0 and pg.pins == 0 and pg.host is None:
            out.append(f"page {s} has no reference, pin or replica but is not recycled")


def check_commit(pool: PoolState, pm: PoolMirror, e: ev.CommitFrontiers, out: list[str]) -> None:
    """CommitFrontiers: per bundle the frontier order, then every block between the old and
    the new committed frontier holds the columns it needs (a decode step: one block)."""
    spaces, ms, pages = pool.spaces, pm.spaces, pool.pages
    n_pages, p = len(pages), P
    for b in unpack(e.bundles).tolist():
        sp = spaces.get(b)
        m = ms.get(b)
        if sp is None or m is None:
            out.append(f"commit names bundle {b} without a space in {e.pool}")
            continue
        c = sp.committed
        oc = m.committed
        m.committed = c
        members = sp.members
        n = len(members)
        if not sp.protected <= c <= n * p:
            out.append(f"bundle {b}: frontiers protected={sp.protected} committed={c} "
                       f"membership={n * p} out of order (commit)")
        if oc < c:
            i, hi = oc // p, (c + p - 1) // p
        else:
            i, hi = c // p, (oc + p - 1) // p
        if hi > n:
            hi = n
        while i < hi:  # ``columns``, inlined: this is the decode hot path
            s = members[i]
            pg = pages[s] if s < n_pages else None
            if pg is None:
                out.append(f"bundle {b}: block {i} -> dead slot {s} (committed block)")
            else:
                pc = pg.committed
                need = c - i * p
                if pc < (need if need < p else p):
                    out.append(f"bundle {b}: block {i} page {s} committed {pc} < "
                               f"{min(p, need)} (commit)")
                if not 0 <= pg.protected <= pc <= p:
                    out.append(f"page {s} columns protected={pg.protected} committed={pc} out "
                               "of range (commit)")
            i += 1
