"""Incremental §14 verifier: the checks of ``invariants.violations``, restricted to what one event
touched, in time O(touched) per event.

``IncrementalChecker(state)`` runs the full check once and builds its *own* indexes from the
state's primary facts (memberships, active flags, entitlements, rows, each page's device and
host replica); pins come from the Pin/Unpin/HostReserve/HostPublish/HostAbort events themselves.
Call ``check(event)`` after each ``apply(state, event)``: it re-reads only the spaces, pages,
rows and host extents the event names, updates its indexes from what it sees and compares them
with apply's own bookkeeping, so a bug in apply that corrupts a derived counter is caught:

* per pool: ``allocated + reserved + available == capacity`` where allocated = own lease count,
  reserved = own sum over active spaces of ``entitlement - len(members)`` (== ``pool.reserved``),
  available = ``len(free_pages) - reserved >= 0``; a device page is leased by at most one logical
  page, is in range, is never on the free list, and returns to it when released (§5.2, §14);
* rows: an active space holds exactly one row, no row is leased twice, an inactive space holds
  none; ``row_owner`` / ``free_rows`` agree with the spaces on every touched row and in count;
* spaces: key == bundle; no page twice in a membership; ``len(members) <= L``;
  ``protected <= committed <= len(members) * P``; membership <= entitlement while active; every
  block below the committed frontier holds that many committed columns;
* pages: generation == slot generation; ``refs`` / ``active_refs`` == own membership counts; no
  membership names a dead slot; ``0 <= protected <= committed <= P``; a writer is an active
  member and the page is private (§9.4); a member of an active space has a device replica;
  ``pins`` == own pending host transfers + queued copies (and ``copy_pins`` agrees); a page
  with a reference or pin has a device or host replica (§5.1); a page with no reference, pin
  or replica is recycled; a live slot is not on the free-slot list;
* host (``incremental_host``): extents tile the arena around every touched offset, the size
  index agrees, ``free + own live bytes == capacity``; each live extent is owned once (a
  pending transfer's or one page's replica of the pool's size), nothing leaks;
* bundles: every listed pool has the space; an active bundle has an active space in every pool.

``check`` returns a list of strings (empty = clean). No "before" hook is needed: the indexes
hold what each object was before the event. They always follow the state's primary facts, so
damage to a derived counter that persists is reported again by every later event that touches
it (as the full check would); ``rebuild()`` starts over from the state. Keep the full
``violations()`` as the periodic cross-check: it sees what no event touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from ninfer_kv.engine.address_space import NO_ROW
from ninfer_kv.engine.incremental_host import HostMirror
from ninfer_kv.engine.incremental_index import (
    PoolMirror,
    SpaceMirror,
    bump,
    check_commit,
    check_pages,
    columns,
    toggle,
)
from ninfer_kv.engine.invariants import violations
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import StoreState
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import unpack

log = structlog.get_logger(__name__)


class IncrementalChecker:
    """Checks the §14 invariants after each event, touching only what the event touched."""

    def __init__(self, st: StoreState) -> None:
        self.st = st
        self.pools: dict[str, PoolMirror] = {}
        self.host = HostMirror(st)
        self.n_copy = 0
        self.initial = self.rebuild()

    # --- indexes from scratch -----------------------------------------------------------------
    def rebuild(self) -> list[str]:
        """Rebuild every index from the state; returns the full check's violations."""
        st = self.st
        self.pools = {}
        for name, pool in st.pools.items():
            pm = self.pools[name] = PoolMirror(name, pool.capacity)
            pm.extend(len(pool.pages))
            for pg in pool.pages:
                if pg is not None:
                    pm.dev[pg.slot] = pg.device
                    if pg.device != NO_PAGE:
                        pm.lease_page(pg.device, pg.slot)
            for b, sp in pool.spaces.items():
                m = pm.spaces[b] = SpaceMirror()
                m.members, m.mset = list(sp.members), set(sp.members)
                m.active, m.ent = sp.active, sp.entitlement
                pm.see_committed(b, sp.committed)
                pm.extend(max(sp.members, default=-1) + 1)
                bump(pm.refs, m.members, 1)
                toggle(pm.owners, m.members, b)
                pm.see_active(b, sp.active)
                if sp.active:
                    bump(pm.arefs, m.members, 1)
                    m.contrib = sp.entitlement - sp.nmem - sp.incoming
                    pm.reserved += m.contrib
                    if sp.row >= 0 and sp.row not in pm.rows:
                        m.row = sp.row
                        pm.rows[sp.row] = b
        for (pool_name, slot), n in st.copy_pins.items():
            if pool_name in self.pools:
                self.pools[pool_name].copy[slot] = n
        self.n_copy = sum(len(p.copy) for p in self.pools.values())  # pages with copy pins
        self.host.rebuild(self.pools)
        return violations(st)

    # --- per event ------------------------------------------------------------------------------
    def check(self, event: Any) -> list[str]:
        """Violations after ``apply(state, event)`` on what the event touched (empty = clean)."""
        out: list[str] = []
        _HANDLERS[type(event)](self, event, out)
        if self.host.changed:
            self.host.finish(out)
        if out:  # the indexes follow the state, so damage that persists is reported again
            log.debug("incremental_violation", kind=type(event).__name__, problems=out[:3])
        return out

    def _pool(self, name: str) -> tuple[PoolState, PoolMirror]:
        pool = self.st.pools[name]
        pm = self.pools[name]
        if len(pool.pages) > pm.n:
            pm.extend(len(pool.pages))
        return pool, pm

    def _sync(self, pool: PoolState, pm: PoolMirror, b: int, touched: list[int],
              out: list[str]) -> None:
        """Re-read space ``b``: diff its membership and flags against the mirror, move the
        membership counts, reservation and row lease; space-level checks; touched pages (added,
        removed, or all on an active flip) go to ``touched`` for ``check_pages``."""
        sp = pool.spaces.get(b)
        m = pm.spaces.get(b)
        if m is None:
            if sp is None:
                return
            m = pm.spaces[b] = SpaceMirror()
            pm.see_committed(b, 0)
        old = m.members
        if sp is None:
            new: list[int] = []
            active, ent, row, c = False, 0, NO_ROW, 0
        else:
            new, active, ent, row, c = sp.members, sp.active, sp.entitlement, sp.row, sp.committed
        n_old, n_new = len(old), len(new)
        flip = m.active != active
        if flip:  # every old member's active count moves; then diff with the new flag
            bump(pm.arefs, old, 1 if active else -1)
            touched.extend(old)
        if n_new >= n_old and (n_old == 0 or new[n_old - 1] == old[-1]):
            k = n_old
        elif n_new < n_old and (n_new == 0 or old[n_new - 1] == new[-1]):
            k = n_new
        else:
            k, lim = 0, min(n_old, n_new)
            while k < lim and old[k] == new[k]:
                k += 1
        if k < n_old:
            gone = old[k:]
            bump(pm.refs, gone, -1)
            toggle(pm.owners, gone, b)
            if active:
                bump(pm.arefs, gone, -1)
            if not flip:
                touched.extend(gone)
            del old[k:]
            m.mset.difference_update(gone)
        if k < n_new:
            added = new[k:]
            pm.extend(max(added) + 1)
            mset = m.mset
            if len(added) > 8 and mset.isdisjoint(added) and len(set(added)) == len(added):
                mset.update(added)  # the loop below would add them all and report nothing
            else:
                for s in added:
                    if s in mset:
                        out.append(f"bundle {b}: page {s} appears twice in one membership")
                    mset.add(s)
            bump(pm.refs, added, 1)
            toggle(pm.owners, added, b)
            if active:
                bump(pm.arefs, added, 1)
            old.extend(added)
            touched.extend(added)
        if sp is not None:
            if sp.bundle != b:
                out.append(f"space key {b} != bundle {sp.bundle}")
            if n_new > pool.logical_pages:
                out.append(f"bundle {b}: {n_new} pages > L={pool.logical_pages}")
            if not sp.protected <= c <= n_new * P:
                out.append(f"bundle {b}: frontiers protected={sp.protected} committed={c} "
                           f"membership={n_new * P} out of order")
            if not 0 <= sp.provisional <= n_new * P:
                out.append(f"bundle {b}: provisional frontier {sp.provisional} outside "
                           f"[0, membership {n_new * P}]")
            if active and ent < n_new + sp.incoming:
                out.append(f"bundle {b}: membership {n_new} + incoming {sp.incoming} > "
                           f"entitlement {ent}")
            if active and row < 0:
                out.append(f"active bundle {b} holds no execution row")
            elif not active and row >= 0:
                out.append(f"inactive bundle {b} occupies row {row} (§14)")
        oc = pm.seen_committed(b)
        lo, hi = min(k, (oc if oc < c else c) // P), min(n_new, -(-(c if c > oc else oc) // P))
        if lo < hi and sp is not None:  # blocks whose need moved (``touched``: page checks)
            columns(pool, sp.i, c, lo, hi, 0 if flip else k, b, out)
        pm.see_committed(b, c)
        contrib = ent - n_new - (sp.incoming if sp is not None else 0) if active else 0
        pm.reserved += contrib - m.contrib
        m.contrib, m.active, m.ent = contrib, active, ent
        pm.see_active(b, active)
        r_new = row if active and row >= 0 else NO_ROW
        if m.row != r_new:
            self._move_row(pool, pm, b, m.row, r_new, out)
            m.row = r_new
        if sp is None:
            del pm.spaces[b]
            pm.forget(b)

    def _move_row(self, pool: PoolState, pm: PoolMirror, b: int, r_old: int, r_new: int,
                  out: list[str]) -> None:
        rows = pm.rows
        if r_old >= 0 and rows.get(r_old) == b:
            del rows[r_old]
        if r_new >= 0:
            o = rows.setdefault(r_new, b)
            if o != b:
                out.append(f"row {r_new} leased to {o} and {b}")
        for r in (r_old, r_new):
            if r >= 0:
                mine = rows.get(r)
                if pool.row_owner.get(r) != mine:
                    out.append(f"execution row {r}: row_owner says {pool.row_owner.get(r)}, "
                               f"spaces say {mine}")
                if (r in pool.free_rows) == (mine is not None):
                    out.append(f"execution row {r}: on the free list "
                               f"{r in pool.free_rows}, leased {mine is not None}")

    def _totals(self, pool: PoolState, pm: PoolMirror, out: list[str]) -> None:
        """O(1) identities of a pool, and the global transfer/copy counts."""
        r = pm.reserved
        if pool.reserved != r:
            out.append(f"{pool.name}: reserved {pool.reserved} != sum of active reservations {r}")
        nf, a = len(pool.free_pages), pm.n_leased()
        if a + nf != pool.capacity or nf < r:
            out.append(f"{pool.name}: allocated {a} + reserved {r} + available {nf - r} != "
                       f"capacity {pool.capacity} (§5.2)")
        nr = len(pm.rows)
        if len(pool.row_owner) != nr or len(pool.free_rows) + nr != pool.rows:
            out.append(f"{pool.name}: execution rows inconsistent: {len(pool.row_owner)} owners, "
                       f"{len(pool.free_rows)} free, {nr} active spaces, C={pool.rows}")
        st = self.st
        if len(st.copy_pins) != self.n_copy:
            out.append(f"copy_pins holds {len(st.copy_pins)} pages, queued copies pin "
                       f"{self.n_copy}")
        if len(st.host_pending) != len(self.host.pending):
            out.append(f"host_pending holds {len(st.host_pending)} transfers, "
                       f"{len(self.host.pending)} reserved and not published or aborted")

    def _bundle(self, bid: int, out: list[str]) -> None:
        b = self.st.bundles.get(bid)
        if b is None:
            return
        pools = self.st.pools
        for p in b.pools:
            if p not in pools or bid not in pools[p].spaces:
                out.append(f"bundle {bid} lists pool {p} without a space there")
        if b.active:
            missing = [p for p, pool in pools.items() if bid not in pool.spaces]
            if missing:
                out.append(f"active bundle {bid} has no space in {missing} (§7.1)")
            if any(not pools[p].spaces[bid].active for p in b.pools
                   if p in pools and bid in pools[p].spaces):
                out.append(f"active bundle {bid} has an inactive space")

    # --- handlers ---------------------------------------------------------------------------------
    def _spaces_event(self, name: str, bundles: list[int], out: list[str],
                      check_bundles: bool = False) -> None:
        pool, pm = self._pool(name)
        touched: list[int] = []
        for b in bundles:
            self._sync(pool, pm, b, touched, out)
        if touched:
            check_pages(pool, pm, list(dict.fromkeys(touched)) if len(bundles) > 1 else touched,
                        self.host if self.host.on else None, out)
        if check_bundles:
            for b in bundles:
                self._bundle(b, out)
        self._totals(pool, pm, out)

    def _slots_event(self, name: str, slots: list[int], out: list[str]) -> None:
        pool, pm = self._pool(name)
        check_pages(pool, pm, slots, self.host if self.host.on else None, out)
        self._totals(pool, pm, out)

    def _commit(self, e: ev.CommitFrontiers, out: list[str]) -> None:
        pool, pm = self._pool(e.pool)
        check_commit(pool, pm, e, out)
        self._totals(pool, pm, out)

    def _pins(self, e: ev.Pin | ev.Unpin, out: list[str]) -> None:
        pool, pm = self._pool(e.pool)
        slots = unpack(e.slots).tolist()
        d = 1 if isinstance(e, ev.Pin) else -1
        copy = pm.copy
        for s in slots:
            n = copy.get(s, 0) + d
            if n:
                copy[s] = n
            else:
                del copy[s]
        self.n_copy = sum(len(p.copy) for p in self.pools.values())
        for s in dict.fromkeys(slots):
            if self.st.copy_pins.get((e.pool, s), 0) != copy.get(s, 0):
                out.append(f"copy_pins[{e.pool}:{s}] = {self.st.copy_pins.get((e.pool, s), 0)} "
                           f"!= queued copies {copy.get(s, 0)}")
        self._slots_event(e.pool, slots, out)

    def _host_transfer(self, e: Any, out: list[str]) -> None:
        slots = self.host.transfer(e, self.pools, out)
        self._slots_event(e.pool, slots, out)

    def _configure(self, e: Any, out: list[str]) -> None:
        out.extend(self.rebuild())


_HANDLERS: dict[type, Callable[[IncrementalChecker, Any, list[str]], None]] = {
    # methods are looked up on each call (not bound here), so a patched method takes effect
    ev.Configure: lambda self, e, out: self._configure(e, out),
    ev.HostConfigure: lambda self, e, out: self._configure(e, out),
    ev.Recovered: lambda self, e, out: None,
    ev.Activate: lambda self, e, out: self._spaces_event(e.pool, [e.bundle], out, True),
    ev.PublishActive: lambda self, e, out: self._bundle(e.bundle, out),
    ev.Finish: lambda self, e, out: self._spaces_event(e.pool, [e.bundle], out, True),
    ev.Release: lambda self, e, out: self._spaces_event(e.pool, [e.bundle], out, True),
    ev.Materialize: lambda self, e, out: self._spaces_event(
        e.pool, list(dict.fromkeys(unpack(e.bundles).tolist())), out),
    ev.CommitFrontiers: lambda self, e, out: self._commit(e, out),
    ev.ProvisionalFrontiers: lambda self, e, out: self._spaces_event(
        e.pool, unpack(e.bundles).tolist(), out),
    ev.Trim: lambda self, e, out: self._spaces_event(e.pool, [e.bundle], out),
    ev.Truncate: lambda self, e, out: self._spaces_event(e.pool, [e.bundle], out),
    ev.Grow: lambda self, e, out: self._spaces_event(
        e.pool, list(dict.fromkeys(unpack(e.bundles).tolist())), out),
    ev.Move: lambda self, e, out: self._spaces_event(e.pool, [e.src, e.dst], out, True),
    ev.Fork: lambda self, e, out: self._spaces_event(e.pool, [e.dst], out, True),
    ev.Share: lambda self, e, out: self._spaces_event(e.pool, [e.src, e.dst], out, True),
    ev.Prefix: lambda self, e, out: self._spaces_event(e.pool, [e.src, e.dst], out, True),
    ev.CopyTail: lambda self, e, out: self._spaces_event(e.pool, [e.dst], out, True),
    ev.HostReserve: lambda self, e, out: self._host_transfer(e, out),
    ev.HostPublish: lambda self, e, out: self._host_transfer(e, out),
    ev.HostAbort: lambda self, e, out: self._host_transfer(e, out),
    ev.HostDrop: lambda self, e, out: self._slots_event(e.pool, unpack(e.slots).tolist(), out),
    ev.DeviceDrop: lambda self, e, out: self._slots_event(e.pool, unpack(e.slots).tolist(), out),
    ev.DeviceRestore: lambda self, e, out: self._slots_event(
        e.pool, unpack(e.slots).tolist(), out),
    ev.Pin: lambda self, e, out: self._pins(e, out),
    ev.Unpin: lambda self, e, out: self._pins(e, out),
    ev.SetMetadata: lambda self, e, out: self._bundle(e.bundle, out),
}
