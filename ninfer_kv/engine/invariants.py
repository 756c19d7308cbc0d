"""Every §14 invariant that the logical state can show, checked from scratch.

``violations(state)`` recomputes counts independently of the incremental bookkeeping in
``apply`` and returns a list of human-readable violations (empty when clean). Tests call it
after every step; replay calls it at the end (and after every event with ``--verify-every``).

It reads the pools' arrays (``PoolState.pg_*``, ``sp_*``) with array operations: a check
costs a few array passes per pool plus one small step per address space, and a message is
built only for what is wrong.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from ninfer_kv.engine import invariant_kernels as ik
from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import StoreState, decode_state

I64 = np.int64


def violations(st: StoreState) -> list[str]:
    out: list[str] = []
    for name in st.pools:
        out.extend(f"{name}: {v}" for v in _pool_violations(st, name))
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


def load_snapshot(data: bytes) -> StoreState:
    """A snapshot's state, judged before any record is applied to it: one that breaks §14
    (well-formed, on the log's CRC chain, and wrong: a bug, or written elsewhere) is refused
    like one that does not decode (``ValueError``). Open, compact and replay load snapshots
    through this, so recovery falls back to an older snapshot or the log — the log, not a
    snapshot derived from it, is the record of what was acknowledged."""
    st = decode_state(data)
    broken = violations(st)
    if broken:
        raise ValueError(f"its state breaks §14: {'; '.join(broken[:3])}")
    return st


def _leases(pool: PoolState, live: np.ndarray, out: list[str]) -> int:
    """Device leases: one logical page each, in range, not free. Returns how many."""
    dev = pool.pg_device[live]
    leases = dev[dev != NO_PAGE]
    ids, counts = np.unique(leases, return_counts=True)
    if (counts > 1).any():
        out.append(f"device pages {ids[counts > 1][:5].tolist()} leased by more than one "
                   "logical page (§14)")
    inside = leases[(leases >= 0) & (leases < pool.capacity)]
    if len(inside) != len(leases):
        out.append("device page id out of range")
    bits = pool.free_pages.bits
    if bits[inside[inside < len(bits)]].any():
        out.append("a leased device page is also on the free list")
    return len(leases)


def _table_violations(pool: PoolState, spaces: list[tuple[int, KVAddressSpace]]) -> list[str]:
    """The compiled loops find a sequence's space through ``bundle_index``, the bundle table's
    array (engine/bundle_table.py): it must map exactly the pool's spaces, each to its own
    index — an entry missing refuses a live sequence, a stale one reads another's arrays."""
    t = pool.bundle_table
    out = t.check()
    if pool.bundle_index is not t.array:
        out.append("bundle_index is not the bundle table's array")
    got, want = t.items(), {b: sp.i for b, sp in spaces}
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()))[:4]
        out.append(f"the bundle table maps {len(got)} seqs, the pool has {len(want)} spaces; "
                   f"(seq, space index) pairs in one only: {diff}")
    return out


def _pool_violations(st: StoreState, name: str) -> list[str]:
    pool = st.pools[name]
    out: list[str] = []
    n = pool.n_slots
    alive_at = pool.pg_live[:n]
    live = np.flatnonzero(alive_at)
    allocated = _leases(pool, live, out)
    spaces = [(b, pool.spaces[b]) for b in pool.spaces]  # in bundle order
    bundles = np.array([b for b, _ in spaces], I64)
    idx = np.array([sp.i for _, sp in spaces], I64)
    refs, active_refs, twice, keys, problems = ik.scan_memberships(
        bundles, idx, pool.sp_members, pool.sp_nmem, pool.sp_committed, pool.sp_active, n,
        pool.pg_live, pool.pg_committed, pool.pg_device, NO_PAGE)
    size = len(refs)
    blocks = _block_messages(pool, bundles, idx, problems)
    reserved = 0
    rows: dict[int, int] = {}
    for k, (b, sp) in enumerate(spaces):
        if sp.bundle != b:
            out.append(f"space key {b} != bundle {sp.bundle}")
        if twice[k]:
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
        out.extend(blocks.get(k, ()))
    if reserved != pool.reserved:
        out.append(f"reserved {pool.reserved} != sum of active reservations {reserved}")
    available = len(pool.free_pages) - reserved
    if available < 0 or allocated + reserved + available != pool.capacity:
        out.append(f"allocated {allocated} + reserved {reserved} + available {available} "
                   f"!= capacity {pool.capacity} (§5.2)")
    if rows != pool.row_owner or len(pool.free_rows) + len(rows) != pool.rows or \
            set(pool.free_rows) & set(rows):
        out.append(f"execution rows inconsistent: owners {pool.row_owner} vs spaces {rows}")
    out.extend(_table_violations(pool, spaces))
    _pages(pool, live, refs, active_refs, keys, size, out)
    free = np.flatnonzero(pool.free_slots.bits)
    inside = free[free < n]
    for s in sorted([*free[free >= n].tolist(), *inside[alive_at[inside]].tolist()]):
        out.append(f"free slot {s} is live")
    return out


def _block_messages(pool: PoolState, bundles: np.ndarray, idx: np.ndarray,
                    problems: np.ndarray) -> dict[int, list[str]]:
    """``scan_memberships``' block problems as messages, by space position: each block of a
    membership is a live page holding the committed columns of its block, and in an active
    space one with a device replica."""
    out: dict[int, list[str]] = {}
    for k, i, kind, need in problems.tolist():
        b = int(bundles[k])
        s = int(pool.sp_members[idx[k], i])
        msgs = out.setdefault(k, [])
        if kind == ik.DEAD:
            msgs.append(f"bundle {b}: block {i} -> dead slot {s}")
        elif kind == ik.SHORT:
            msgs.append(f"bundle {b}: block {i} page {s} committed "
                        f"{int(pool.pg_committed[s])} < {need}")
        else:
            msgs.append(f"active bundle {b}: block {i} has no device replica")
    return out


def _pages(pool: PoolState, live: np.ndarray, refs: np.ndarray, active_refs: np.ndarray,
           active_keys: np.ndarray, size: int, out: list[str]) -> None:
    """Each live page: references and active references equal the memberships that hold
    it, columns in range, its writer an active member and the page private (§9.4), a page
    something holds has a replica on some tier (§5.1), and a page nothing holds is recycled."""
    pr, pa = pool.pg_refs[live], pool.pg_active[live]
    prot, comm, w = pool.pg_protected[live], pool.pg_committed[live], pool.pg_writer[live]
    for s in live[pr != refs[live]].tolist():
        out.append(f"page {s} refs {int(pool.pg_refs[s])} != memberships {int(refs[s])}")
    for s in live[pa != active_refs[live]].tolist():
        out.append(f"page {s} active_refs {int(pool.pg_active[s])} != {int(active_refs[s])}")
    for s in live[(prot < 0) | (prot > comm) | (comm > P)].tolist():
        out.append(f"page {s} columns protected={int(pool.pg_protected[s])} committed="
                   f"{int(pool.pg_committed[s])} out of range")
    has = w != NO_PAGE
    stray = has & ~np.isin(w * size + live, active_keys)
    for s in live[stray].tolist():
        out.append(f"page {s} writer {int(pool.pg_writer[s])} is not an active member")
    for s in live[has & (pr > 1)].tolist():
        out.append(f"page {s} is shared ({int(pool.pg_refs[s])} refs) but has writer "
                   f"{int(pool.pg_writer[s])} (§9.4)")
    pins, none = pool.pg_pins[live], (pool.pg_host_off[live] < 0)
    for s in live[(pr == 0) & (pins == 0) & none].tolist():
        out.append(f"page {s} has no reference, pin or replica but is not recycled")
    for s in live[((pr > 0) | (pins > 0)) & none & (pool.pg_device[live] == NO_PAGE)].tolist():
        out.append(f"page {s} is held but has neither a device nor a host replica (lost, §5.1)")


def _expected_pins(st: StoreState, name: str, pending: Counter[tuple[str, int]]) -> np.ndarray:
    """Per slot of pool ``name``: queued device copies + pending host transfers."""
    pool = st.pools[name]
    exp = np.zeros(max(pool.n_slots, 1), I64)
    for src in (st.copy_pins, pending):
        for (p, s), k in src.items():
            if p == name and 0 <= s < len(exp):
                exp[s] += k
    return exp


def _host_violations(st: StoreState) -> list[str]:
    """Host arena: extents tile the arena; every live extent is one page's published replica
    or part of an unpublished destination (nothing leaked); pins == pending transfers + pins
    of queued device copies."""
    pending: Counter[tuple[str, int]] = Counter()
    out: list[str] = [] if st.host is None else list(st.host.violations())
    owned: dict[int, str] = {}
    for first, (pool, slots, offsets) in st.host_pending.items():
        if offsets[0] != first:
            out.append(f"host transfer keyed {first} starts at {offsets[0]}")
        size = next(s.page_bytes for s in st.pool_specs if s.name == pool)
        for slot, off in zip(slots, offsets, strict=True):
            owned[off] = f"pending {pool}:{slot}"
            pending[(pool, slot)] += 1
            if st.host is not None and st.host.live.get(off) != -(-size // 64) * 64:
                out.append(f"page {pool}:{slot} pending destination at {off} is not a live "
                           f"extent of {size} B")
    for name, pool in st.pools.items():
        live = np.flatnonzero(pool.pg_live[:pool.n_slots])
        exp = _expected_pins(st, name, pending)
        got = pool.pg_pins[live]
        for s in live[got != exp[live]].tolist():
            what = "queued copies" if st.host is None else "pending transfers and queued copies"
            out.append(f"page {name}:{s} pins {int(pool.pg_pins[s])} != {what} {int(exp[s])}")
        if st.host is None:
            continue
        size = next(s.page_bytes for s in st.pool_specs if s.name == name)
        for s in sorted(pool.host_of):
            if not (s < pool.n_slots and pool.pg_live[s]):
                out.append(f"free slot {name}:{s} still records a host replica")
                continue
            off = pool.host_of[s][0]
            if off in owned:
                out.append(f"host extent {off} owned twice ({owned[off]}, {name}:{s})")
            owned[off] = f"{name}:{s}"
            if st.host.live.get(off) != -(-size // 64) * 64:
                out.append(f"page {name}:{s} host replica at {off} is not a live extent of "
                           f"{size} B")
    if st.host is not None:
        leaked = set(st.host.live) - set(owned)
        if leaked:
            out.append(f"host extents {sorted(leaked)[:5]} leaked (no page, no pending "
                       "transfer)")
    return out
