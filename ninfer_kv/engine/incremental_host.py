"""Host-tier half of the incremental §14 verifier (see ``engine.incremental``).

``HostMirror`` keeps its own record of who owns each live host extent — a pending transfer
(from the HostReserve event itself) or one page's published replica (from the page) — its own
running total of live bytes, and its own copy of the unpublished transfers. After an event it
checks, for every offset whose owner changed:

* an owned extent is owned once; a page's replica is a live extent of the pool's packed
  (64-B aligned) page size; an unowned offset is not live (no leak);
* the extents tile the arena around the offset: the offsets' extents merge into runs of
  adjacent extents, and inside each run the extents (free or live) tile it exactly, the one
  before ends at its start and one starts at its end (or it ends at the capacity); the free
  extents of the run are in the size index;

and the O(n_free) identity ``free bytes + own live bytes == capacity`` and the O(1)
``len(live) == owned extents``. HostReserve checks the state recorded the transfer under its
first offset (§5.3: reserve destination -> copy -> verify -> publish -> release).
"""

from __future__ import annotations

from typing import Any, Protocol

from sortedcontainers import SortedDict

from ninfer_kv.engine.host_arena import ExtentAllocator
from ninfer_kv.engine.state import StoreState
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import unpack, unpack_i64


class PoolMirror(Protocol):
    """What this module reads of incremental_index.PoolMirror (no import back to it)."""

    pend: dict[int, int]  # slot -> pending host transfers

Owner = tuple[str, int, bool]
"""(pool, slot, pending): a pending transfer's destination or a published replica."""


def _align(n: int) -> int:
    return -(-n // 64) * 64


def _floor(d: SortedDict, x: int) -> tuple[int, int] | None:
    i = d.bisect_right(x) - 1
    return d.peekitem(i) if i >= 0 else None


def _containing(host: ExtentAllocator, off: int) -> tuple[int, int] | None:
    """(start, end) of the extent (live or free) that holds ``off``; None in a gap."""
    z = host.live.get(off)
    if z is None:
        z = host.by_off.get(off)
    if z is not None:
        return off, off + z
    best = max((t for t in (_floor(host.live, off), _floor(host.by_off, off)) if t is not None),
               default=None)  # a freed extent coalesced into its free predecessor
    return (best[0], best[0] + best[1]) if best is not None and best[0] + best[1] > off else None


def spans(host: ExtentAllocator, offsets: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Merge the extents holding ``offsets`` into maximal runs [lo, hi) of adjacent extents
    (one run for a transfer's consecutive extents); also the offsets that lie in a gap."""
    runs: list[list[int]] = []
    gaps: list[int] = []
    for off in sorted(set(offsets)):
        if runs and off < runs[-1][1]:
            continue  # inside the run already found
        ext = _containing(host, off)
        if ext is None:
            gaps.append(off)
        elif runs and ext[0] <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], ext[1])
        else:
            runs.append([ext[0], ext[1]])
    return [(lo, hi) for lo, hi in runs], gaps


def tiles(host: ExtentAllocator, lo: int, hi: int) -> bool:
    """Do the extents starting in [lo, hi) tile it exactly, the one before end at ``lo`` and
    one start at ``hi`` (or ``hi`` is the capacity)? The full check's walk, on one run."""
    live, free = host.live, host.by_off
    starts = sorted([(s, live[s]) for s in live.irange(lo, hi - 1)]
                    + [(s, free[s]) for s in free.irange(lo, hi - 1)])
    pos = lo
    for s, z in starts:
        if s != pos:
            return False
        pos = s + z
    prev = max((t for t in (_floor(live, lo - 1), _floor(free, lo - 1)) if t is not None),
               default=None)
    return pos == hi and ((prev[0] + prev[1]) if prev else 0) == lo and (
        hi == host.capacity or hi in live or hi in free)


class HostMirror:
    """The checker's own host-extent ownership, live bytes and pending transfers."""

    def __init__(self, st: StoreState) -> None:
        self.st = st
        self.on = False
        self.owned: dict[int, Owner] = {}
        self.live = 0
        self.pending: dict[int, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
        self.replica: dict[str, dict[int, int]] = {}   # pool -> slot -> offset
        self.size: dict[str, int] = {}
        self.changed: list[int] = []

    def rebuild(self, pools: dict[str, PoolMirror]) -> None:
        st = self.st
        self.on = st.host is not None
        self.size = {s.name: _align(s.page_bytes) for s in st.pool_specs}
        self.owned, self.live, self.changed = {}, 0, []
        self.replica = {name: {} for name in st.pools}
        self.pending = dict(st.host_pending)
        for pool, slots, offsets in st.host_pending.values():
            pend = pools[pool].pend
            for s, off in zip(slots, offsets, strict=True):
                pend[s] = pend.get(s, 0) + 1
                self._claim(off, (pool, s, True), None)
        for name, pool in st.pools.items():
            for pg in pool.pages:
                if pg is not None and pg.host is not None:
                    self.replica[name][pg.slot] = pg.host[0]
                    self._claim(pg.host[0], (name, pg.slot, False), None)
        self.changed = []

    # --- ownership ------------------------------------------------------------------------------
    def _claim(self, off: int, who: Owner, out: list[str] | None) -> None:
        o = self.owned.setdefault(off, who)
        if o != who:
            if out is not None:
                out.append(f"host extent {off} owned twice ({o[0]}:{o[1]}"
                           f"{' pending' if o[2] else ''}, {who[0]}:{who[1]})")
            return
        self.live += self.size[who[0]]
        self.changed.append(off)

    def _release(self, off: int, who: Owner) -> None:
        if self.owned.get(off) == who:
            del self.owned[off]
            self.live -= self.size[who[0]]
        self.changed.append(off)

    def sync_page(self, pool: str, s: int, h: tuple[int, ...] | None, out: list[str]) -> None:
        """Move the replica ownership of page ``pool:s`` to what the page now holds: its host
        replica ``h`` (None: none, or a dead slot)."""
        new = h[0] if h is not None else -1
        rep = self.replica[pool]
        old = rep.get(s, -1)
        if new != old:
            if old >= 0:
                self._release(old, (pool, s, False))
                del rep[s]
            if new >= 0:
                self._claim(new, (pool, s, False), out)
                rep[s] = new

    def transfer(self, e: Any, pools: dict[str, PoolMirror], out: list[str]) -> list[int]:
        """HostReserve / HostPublish / HostAbort: the pending side; returns the slots whose
        pins and replicas the caller checks next."""
        if isinstance(e, ev.HostReserve):
            slots = unpack(e.slots).tolist()
            offsets = unpack_i64(e.offsets).tolist()
            pend = pools[e.pool].pend
            for s, off in zip(slots, offsets, strict=True):
                pend[s] = pend.get(s, 0) + 1
                self._claim(off, (e.pool, s, True), out)
            want = (e.pool, tuple(slots), tuple(offsets))
            self.pending[offsets[0]] = want
            if self.st.host_pending.get(offsets[0]) != want:
                out.append(f"host transfer {offsets[0]} recorded as "
                           f"{self.st.host_pending.get(offsets[0])}, reserved {want}")
            return slots
        entry = self.pending.pop(e.offset, None)
        if entry is None:  # apply raised already: the state has no such transfer either
            return []
        pool, slots, offsets = entry
        pend = pools[pool].pend
        for s, off in zip(slots, offsets, strict=True):
            n = pend.get(s, 0) - 1
            if n > 0:
                pend[s] = n
            else:
                pend.pop(s, None)
            self._release(off, (pool, s, True))
        return list(slots)

    # --- checks ---------------------------------------------------------------------------------
    def finish(self, out: list[str]) -> None:
        """Checks on every offset whose owner changed in this event, then the arena totals."""
        host = self.st.host
        changed, self.changed = self.changed, []
        if host is None:
            return
        live = host.live
        for off in dict.fromkeys(changed):
            o = self.owned.get(off)
            if o is None:
                if off in live:
                    out.append(f"host extent {off} leaked (no page, no pending transfer)")
            elif live.get(off) != self.size[o[0]]:
                what = "pending destination" if o[2] else "host replica"
                out.append(f"page {o[0]}:{o[1]} {what} at {off} is not a live extent of "
                           f"{self.size[o[0]]} B")
        runs, gaps = spans(host, changed)
        for lo, hi in runs:
            if not tiles(host, lo, hi):
                gaps.append(lo)
            elif len(host.by_size) != len(host.by_off) or any(
                    (host.by_off[x], x) not in host.by_size for x in host.by_off.irange(lo, hi - 1)):
                out.append(f"host arena: size index out of step with offset index in [{lo}, {hi})")
        if gaps:
            out.append(f"host arena: gap or overlap around offsets {gaps[:5]}")
        free = sum(host.by_off.values())
        if free + self.live != host.capacity:
            out.append(f"host arena: free {free} + live {self.live} != capacity {host.capacity}")
        if len(live) != len(self.owned):
            out.append(f"host arena: {len(live)} live extents, {len(self.owned)} owned")
