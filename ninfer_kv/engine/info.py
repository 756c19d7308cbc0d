"""Read-only answers an engine needs, as documented dataclasses instead of internals:
``checkpoint_info`` (frontier, residency, bytes, metadata of one sequence or checkpoint) and
``metrics`` (counters and occupancy of the whole store), and ``table_violations`` (the
published block tables against the state). Nothing here mutates state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ninfer_kv.engine.device import UNMAPPED
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.errors import StateError, UnknownHandle
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import unpack

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


@dataclass(frozen=True, slots=True)
class PoolResidency:
    """One pool's address space of a sequence or checkpoint."""

    frontier: int       # committed tokens (§8.1)
    pages: int          # logical pages in its membership
    device_pages: int   # pages with a device replica (readable by kernels now)
    host_pages: int     # pages with a valid host replica covering their committed columns (§5.1)
    device_bytes: int   # device_pages * the pool's page-group bytes (all layers and planes)
    host_bytes: int
    sole_device_pages: int = 0
    """Device pages no other sequence or checkpoint references: what releasing it frees
    (§8.3; a page a queued copy pins frees at that boundary). A retention policy evicts
    checkpoints with none last — they free nothing and keep a prefix findable."""
    idle_device_pages: int = 0
    """Device pages no active sequence maps: they free once every checkpoint holding them
    is released (``sole_device_pages`` counts those this one holds alone)."""
    sole_host_pages: int = 0
    """Pages holding a host-arena extent (published or being copied) that no other sequence
    or checkpoint references: what releasing it frees in the host tier."""
    sole_device_pages_now: int = 0
    """Of ``sole_device_pages``, those a release frees at once: no queued copy pins them (a
    COW tail's source, an offload's or a restore's page frees at the boundary that runs the
    copy, §5.3). What a policy making room for an admission now may count on."""
    sole_host_pages_now: int = 0
    """Of ``sole_host_pages``, those no queued copy pins: their extents free at the release."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    id: int
    active: bool                         # an active sequence, not (yet) a checkpoint
    frontier: int                        # committed frontier of the main pool
    pools: dict[str, PoolResidency]
    survives_restart: bool               # a reopen keeps it (restart.py's rule)
    finish_reason: str
    parent: int | None                   # the checkpoint it was continued from
    metadata: Any                        # what set_metadata attached (decoded), or None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StoreMetrics:
    """Counters since open (records, events, page moves) and what is in use now."""

    records: int            # journal records (GPU boundaries that published events)
    events: int
    materialized: int       # pages materialized by ensure_mapped
    cow_copies: int         # partial-tail copies (Fork at a mid-page frontier)
    d2h_pages: int          # pages copied to the host tier
    h2d_pages: int          # pages restored from the host tier
    published: int          # host transfers published (verified, durable)
    active: int             # active sequences
    checkpoints: int        # inactive checkpoints
    pools: dict[str, dict[str, int]]   # capacity, allocated, reserved, available, rows_leased,
    # checkpoint_only: device pages no active sequence maps (what releasing or demoting every
    # checkpoint would free at most: a retention policy's bound before it evicts anything)
    host_capacity: int      # host arena bytes (0: no host tier)
    host_used: int
    journal_seq: int        # last journal record (0 without a journal)
    journal_durable_seq: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checkpoint_info(store: Txn, bundle: int, metadata: bool = True) -> CheckpointInfo:
    st = store.state
    b = st.bundles.get(bundle)
    if b is None:
        raise UnknownHandle(f"{bundle} is neither an active sequence nor a checkpoint")
    page_bytes = {s.name: s.page_bytes for s in st.pool_specs}
    pools: dict[str, PoolResidency] = {}
    for name in b.pools:
        sp = st.pools[name].spaces[bundle]
        p = st.pools[name]
        dev, hst = residency(p, sp.slots)
        sole = sole_pages(p, sp.slots)
        idle = int(np.count_nonzero((p.pg_device[sp.slots] != NO_PAGE)
                                    & (p.pg_active[sp.slots] == 0)))
        hosted = (p.pg_refs[sp.slots] == 1) & (p.pg_host_off[sp.slots] >= 0)
        unpinned = p.pg_pins[sp.slots] == 0
        pools[name] = PoolResidency(sp.committed, len(sp.slots), dev, hst,
                                    dev * page_bytes[name], hst * page_bytes[name], sole, idle,
                                    int(np.count_nonzero(hosted)),
                                    sole_pages(p, sp.slots, now=True),
                                    int(np.count_nonzero(hosted & unpinned)))
    main = pools.get("main") or next(iter(pools.values()), None)
    # restart's rule (engine/restart.py, continuation.unrecoverable_reason): every page has a
    # valid published host replica, and replicas outlive the process only in a file arena
    # (a checkpoint without pages needs none); and the journal holds what established it
    survives = (store._journaled and not b.active  # no journal: no restart keeps it
                and all(r.host_pages == r.pages for r in pools.values())
                and (st.host_persistent == 1 or all(r.pages == 0 for r in pools.values())))
    if survives:  # ... in the journal, too: not while an event it depends on is only in memory
        slots = {name: set(st.pools[name].spaces[bundle].slots.tolist()) for name in b.pools}
        survives = not any(may_establish(e, bundle, slots)
                           for e in (*store._pending, *store._unjournaled))
    return CheckpointInfo(bundle, b.active, main.frontier if main else 0, pools, survives,
                          b.finish_reason, b.parent if b.parent >= 0 else None,
                          decode_metadata(bundle, b.meta) if metadata else None)


def decode_metadata(bundle: int, raw: bytes) -> Any:  # noqa: ANN401
    """The metadata ``set_metadata`` attached to ``bundle`` (None when none). A journal may hold
    a value msgspec encoded but cannot decode (written before set_metadata checked the round
    trip): that is a typed ``StateError`` naming it, not msgspec's own exception."""
    if not raw:
        return None
    try:
        return msgspec.msgpack.decode(raw)
    except (msgspec.MsgspecError, RecursionError, ValueError, TypeError) as exc:
        raise StateError(f"metadata of seq {bundle} ({len(raw)} bytes) does not decode: "
                         f"{type(exc).__name__}: {exc}") from None


_BY_DST = (ev.Share, ev.Prefix, ev.Move, ev.Fork, ev.CopyTail)
_BY_BUNDLE = (ev.Finish, ev.Activate)
NEUTRAL = frozenset((ev.Configure, ev.HostConfigure, ev.PublishActive, ev.SetMetadata,
                     ev.Release, ev.Materialize, ev.CommitFrontiers, ev.ProvisionalFrontiers,
                     ev.Trim, ev.Truncate, ev.Grow, ev.HostReserve, ev.HostAbort, ev.HostDrop,
                     ev.DeviceDrop, ev.DeviceRestore, ev.Pin, ev.Unpin))
"""Events that cannot make an inactive checkpoint survive a restart: they touch only active
sequences, or take replicas or references away (a pin, a drop, a release)."""


def may_establish(e: Any, bundle: int, slots: dict[str, set[int]]) -> bool:  # noqa: ANN401
    """Whether event ``e`` may be what makes checkpoint ``bundle`` (whose page slots, by pool,
    are ``slots``) survive a restart: its retained Finish, the Share/Prefix/Move/Fork that
    created it, or a HostPublish of one of its pages. An event type not classified here counts
    as one (a test classifies every type)."""
    t = type(e)
    if t is ev.HostPublish:
        return not slots.get(e.pool, set()).isdisjoint(unpack(e.slots).tolist())
    if t in _BY_DST:
        return e.dst == bundle
    if t in _BY_BUNDLE:
        return e.bundle == bundle
    if t is ev.Recovered:
        return bundle in unpack(e.kept).tolist()
    return t not in NEUTRAL


def residency(p: PoolState, slots: np.ndarray) -> tuple[int, int]:
    """(device pages, pages with a valid host replica covering their committed columns —
    ``host.replica_valid``, §5.1) among ``slots`` of pool ``p``; array reads, no page views."""
    dev = int(np.count_nonzero(p.pg_device[slots] != NO_PAGE))
    hst = int(np.count_nonzero((p.pg_host_off[slots] >= 0)
                               & (p.pg_host_epoch[slots] == p.pg_epoch[slots])
                               & (p.pg_host_cov[slots] >= p.pg_committed[slots])))
    return dev, hst


def sole_pages(p: PoolState, slots: np.ndarray, now: bool = False) -> int:
    """Device pages among ``slots`` that one address space alone references (refs == 1);
    ``now``: and no queued copy pins (a pinned one frees at the next boundary, §5.3)."""
    mask = (p.pg_device[slots] != NO_PAGE) & (p.pg_refs[slots] == 1)
    if now:
        mask &= p.pg_pins[slots] == 0
    return int(np.count_nonzero(mask))


def reclaimable(store: Txn, bundles: Collection[int], now: bool = False) -> dict[int, int]:
    """Per bundle of ``bundles``: its device pages that only bundles of ``bundles`` reference
    — what releasing all of them frees of it (``now``: at once, none a queued copy pins).
    One pass over their memberships per pool."""
    st = store.state
    bundles = list(dict.fromkeys(bundles))
    for b in bundles:
        if b not in st.bundles:
            raise UnknownHandle(f"{b} is neither an active sequence nor a checkpoint")
    out = dict.fromkeys(bundles, 0)
    for p in st.pools.values():
        mine = [(b, p.spaces[b].slots) for b in bundles if b in p.spaces]
        if not mine:
            continue
        counts = np.bincount(np.concatenate([sl for _, sl in mine]), minlength=p.n_slots)
        for b, sl in mine:
            out[b] += int(np.count_nonzero((p.pg_device[sl] != NO_PAGE)
                                           & (counts[sl] == p.pg_refs[sl])
                                           & ((p.pg_pins[sl] == 0) | (not now))))
    return out


def sole_device_pages(store: Txn, bundle: int, now: bool = False) -> int:
    st = store.state
    b = st.bundles.get(bundle)
    if b is None:
        raise UnknownHandle(f"{bundle} is neither an active sequence nor a checkpoint")
    return sum(sole_pages(st.pools[pool], st.pools[pool].spaces[bundle].slots, now)
               for pool in b.pools)


def checkpoint_only_pages(p: PoolState) -> int:
    """Device pages of ``p`` held only by inactive checkpoints (no active membership)."""
    live = p.pg_live[:p.n_slots]
    return int((live & (p.pg_active[:p.n_slots] == 0) & (p.pg_device[:p.n_slots] != NO_PAGE)).sum())


def occupancy(store: Txn) -> dict[str, dict[str, int]]:
    """Per pool: capacity, allocated, reserved, available, rows leased and checkpoint-only
    pages (what a cache's eviction policy reads; ``metrics`` without the store-wide counts,
    which walk every bundle)."""
    return {n: {"capacity": p.capacity, "allocated": p.allocated, "reserved": p.reserved,
                "available": p.available, "rows_leased": len(p.row_owner),
                "checkpoint_only": checkpoint_only_pages(p)}
            for n, p in store.state.pools.items()}


def metrics(store: Txn) -> StoreMetrics:
    st, s = store.state, store.stats
    active = sum(1 for b in st.bundles.values() if b.active)
    pools = occupancy(store)
    j = store.journal
    return StoreMetrics(s["records"], s["events"], s["materialized"], s["cow_copies"],
                        s["d2h_pages"], s["h2d_pages"], s["published"], active,
                        len(st.bundles) - active, pools,
                        st.host.capacity if st.host is not None else 0,
                        st.host.live_bytes if st.host is not None else 0,
                        j.last_seq if j is not None else 0,
                        j.durable_seq if j is not None else 0)


def table_violations(store: Txn) -> list[str]:
    """The published block tables against the state (§13, §7.2): each active sequence's row
    maps its membership's page groups and nothing after them; a row nobody holds maps
    nothing. Skipped while a boundary is owed (tables lag the state until it runs)."""
    out: list[str] = []
    if store._frozen or store._touched or store._freed_rows:
        return out
    for name, pd in store.device.pools.items():
        tables = pd.block_tables.cpu()
        pool = store.state.pools[name]
        for sp in pool.spaces.values():
            if sp.active:
                want = [pool.pages[s].device for s in sp.members]  # type: ignore[union-attr]
                want += [UNMAPPED] * (pool.logical_pages - len(want))
                got = tables[sp.row].tolist()
                if got != want:
                    out.append(f"{name}: row {sp.row} of seq {sp.bundle} publishes {got}, "
                               f"membership maps {want}")
        for r in pool.free_rows:  # §7.2: a row nobody holds maps nothing
            if pd.published[r] or bool((tables[r] != UNMAPPED).any()):
                out.append(f"{name}: row {r} is leased to no sequence, yet publishes "
                           f"{tables[r].tolist()} (published to {int(pd.published[r])})")
    return out
