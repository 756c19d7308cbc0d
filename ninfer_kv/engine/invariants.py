"""Every §14 invariant that the logical state can show, checked from scratch.

``violations(state)`` recomputes counts independently of the incremental bookkeeping in
``apply`` and returns a list of human-readable violations (empty when clean). Tests call it
after every step; replay can call it after every event.
"""

from __future__ import annotations

from collections import Counter

from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.state import StoreState


def violations(st: StoreState) -> list[str]:
    out: list[str] = []
    for name, pool in st.pools.items():
        out.extend(f"{name}: {v}" for v in _pool_violations(st, name))
        del pool
    out.extend(_host_violations(st))
    for bid, b in st.bundles.items():
        for pname in b.pools:
            if bid not in st.pools[pname].spaces:
                out.append(f"bundle {bid} lists pool {pname} without a space there")
        if b.active:
            missing = [p for p in st.pools if bid not in st.pools[p].spaces]
            if missing:
                out.append(f"active bundle {bid} has no space in {missing} (§7.1)")
            if any(sp is not None and not sp.active
                   for sp in (st.pools[p].spaces.get(bid) for p in b.pools)):
                out.append(f"active bundle {bid} has an inactive space")
    return out


def _pool_violations(st: StoreState, name: str) -> list[str]:
    pool = st.pools[name]
    out: list[str] = []
    live = [pg for pg in pool.pages if pg is not None]
    leases = [pg.device for pg in live if pg.device != NO_PAGE]
    allocated = len(leases)
    dup = [d for d, c in Counter(leases).items() if c > 1]
    if dup:
        out.append(f"device pages {dup[:5]} leased by more than one logical page (§14)")
    if set(leases) & set(pool.free_pages):
        out.append("a leased device page is also on the free list")
    if any(not 0 <= d < pool.capacity for d in leases):
        out.append("device page id out of range")
    reserved = 0
    refs: Counter[int] = Counter()
    active_refs: Counter[int] = Counter()
    rows: dict[int, int] = {}
    for b, sp in pool.spaces.items():
        if sp.bundle != b:
            out.append(f"space key {b} != bundle {sp.bundle}")
        for s in sp.members:
            refs[s] += 1
            if sp.active:
                active_refs[s] += 1
        if len(set(sp.members)) != sp.nmem:
            out.append(f"bundle {b}: a page appears twice in one membership")
        if sp.nmem > pool.logical_pages:
            out.append(f"bundle {b}: {sp.nmem} pages > L={pool.logical_pages}")
        if not sp.protected <= sp.committed <= sp.nmem * P:
            out.append(f"bundle {b}: frontiers protected={sp.protected} committed={sp.committed} "
                       f"membership={sp.nmem * P} out of order")
        if not 0 <= sp.provisional <= sp.nmem * P:
            out.append(f"bundle {b}: provisional frontier {sp.provisional} outside "
                       f"[0, membership {sp.nmem * P}]")
        if sp.active:
            if sp.entitlement < sp.nmem + sp.incoming:
                out.append(f"bundle {b}: membership {sp.nmem} + incoming "
                           f"{sp.incoming} > entitlement {sp.entitlement}")
            reserved += sp.entitlement - sp.nmem - sp.incoming
            if sp.row < 0:
                out.append(f"active bundle {b} holds no execution row")
            elif sp.row in rows:
                out.append(f"row {sp.row} leased to {rows[sp.row]} and {b}")
            else:
                rows[sp.row] = b
        elif sp.row >= 0:
            out.append(f"inactive bundle {b} occupies row {sp.row} (§14)")
        for i, s in enumerate(sp.members):
            pg = pool.pages[s] if s < len(pool.pages) else None
            if pg is None:
                out.append(f"bundle {b}: block {i} -> dead slot {s}")
                continue
            need = min(P, max(0, sp.committed - i * P))
            if pg.committed < need:
                out.append(f"bundle {b}: block {i} page {s} committed {pg.committed} < {need}")
            if pg.device == NO_PAGE and sp.active:
                out.append(f"active bundle {b}: block {i} has no device replica")
    if reserved != pool.reserved:
        out.append(f"reserved {pool.reserved} != sum of active reservations {reserved}")
    available = len(pool.free_pages) - reserved
    if available < 0 or allocated + reserved + available != pool.capacity:
        out.append(f"allocated {allocated} + reserved {reserved} + available {available} "
                   f"!= capacity {pool.capacity} (§5.2)")
    if rows != pool.row_owner or len(pool.free_rows) + len(rows) != pool.rows or \
            set(pool.free_rows) & set(rows):
        out.append(f"execution rows inconsistent: owners {pool.row_owner} vs spaces {rows}")
    for pg in live:
        if pg.refs != refs[pg.slot]:
            out.append(f"page {pg.slot} refs {pg.refs} != memberships {refs[pg.slot]}")
        if pg.active_refs != active_refs[pg.slot]:
            out.append(f"page {pg.slot} active_refs {pg.active_refs} != {active_refs[pg.slot]}")
        if not 0 <= pg.protected <= pg.committed <= P:
            out.append(f"page {pg.slot} columns protected={pg.protected} committed="
                       f"{pg.committed} out of range")
        if pg.writer != NO_PAGE:
            sp = pool.spaces.get(pg.writer)
            if sp is None or not sp.active or pg.slot not in sp.members:
                out.append(f"page {pg.slot} writer {pg.writer} is not an active member")
            if pg.refs > 1:
                out.append(f"page {pg.slot} is shared ({pg.refs} refs) but has writer "
                           f"{pg.writer} (§9.4)")
        if pg.refs == 0 and pg.pins == 0 and pg.host is None:
            out.append(f"page {pg.slot} has no reference, pin or replica but is not recycled")
    for s in pool.free_slots:
        if s >= len(pool.pages) or pool.pages[s] is not None:
            out.append(f"free slot {s} is live")
    return out


def _host_violations(st: StoreState) -> list[str]:
    """Host arena: extents tile the arena; every live extent is one page's published replica
    or part of an unpublished destination (nothing leaked); pins == pending transfers + pins
    of queued device copies."""
    pins: Counter[tuple[str, int]] = Counter(st.copy_pins)
    if st.host is None:
        return [f"page {p}:{s} pins {pg.pins} != queued copies {pins[(p, s)]}"
                for p, pool in st.pools.items() for pg in pool.pages if pg is not None
                for s in (pg.slot,) if pg.pins != pins[(p, s)]]
    out = list(st.host.violations())
    owned: dict[int, str] = {}
    for first, (pool, slots, offsets) in st.host_pending.items():
        if offsets[0] != first:
            out.append(f"host transfer keyed {first} starts at {offsets[0]}")
        size = next(s.page_bytes for s in st.pool_specs if s.name == pool)
        for slot, off in zip(slots, offsets, strict=True):
            owned[off] = f"pending {pool}:{slot}"
            pins[(pool, slot)] += 1
            if st.host.live.get(off) != -(-size // 64) * 64:
                out.append(f"page {pool}:{slot} pending destination at {off} is not a live "
                           f"extent of {size} B")
    for name, pool in st.pools.items():
        size = next(s.page_bytes for s in st.pool_specs if s.name == name)
        for pg in pool.pages:
            if pg is None:
                continue
            if pg.pins != pins[(name, pg.slot)]:
                out.append(f"page {name}:{pg.slot} pins {pg.pins} != pending transfers and "
                           f"queued copies {pins[(name, pg.slot)]}")
            if pg.host is not None:
                off = pg.host[0]
                if off in owned:
                    out.append(f"host extent {off} owned twice ({owned[off]}, {name}:{pg.slot})")
                owned[off] = f"{name}:{pg.slot}"
                if st.host.live.get(off) != -(-size // 64) * 64:
                    out.append(f"page {name}:{pg.slot} host replica at {off} is not a live "
                               f"extent of {size} B")
    leaked = set(st.host.live) - set(owned)
    if leaked:
        out.append(f"host extents {sorted(leaked)[:5]} leaked (no page, no pending transfer)")
    return out
