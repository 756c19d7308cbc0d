"""Host tier commands and effects (spec §3.3, §5.3): offload (D2H), device-replica drop,
restore (H2D), checksums, and what recovery keeps.

Publication order of a replacement replica (§5.3), as this module runs it::

    offload():        plan extents for the whole recipe -> HostReserve (pins pages)    [record n]
    boundary effects: D2H copy, coalesced into runs -> zero uncommitted columns ->
                      CRC-32C per page -> verify epoch and coverage -> flush the arena
    then:             HostPublish (+ DeviceDrop if asked) -> journal.sync()           [record n+1]

A crash between the two records leaves an unpublished destination, which recovery aborts.
Host pages are packed in logical order, every plane of the pool back to back (H rows of
P*X*itemsize bytes each), with no device ids and no table holes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import structlog
import torch
from crc32c import crc32c

from ninfer_kv.engine.drop_rules import along_with, merged, only_along
from ninfer_kv.engine.layout import PlaneOrder
from ninfer_kv.engine.pages import NO_PAGE, LogicalKVPage
from ninfer_kv.engine.state import StoreState
from ninfer_kv.errors import HostArenaError, UnknownHandle
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack, pack_i64, pack_u32

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Transfer:
    """A D2H copy queued for the next boundary; ``drop``: slots whose device replica is to be
    dropped once the copy publishes, if ``may_drop`` still allows it then — each with the
    checkpoints that may lose it along (``drop_device``'s ``shared_with``; None: any)."""

    pool: str
    slots: list[int]
    offsets: list[int]
    drop: dict[int, frozenset[int] | None]


def replica_valid(page: LogicalKVPage, columns: int) -> bool:
    """§5.1: valid for the first ``columns`` columns iff epoch matches and coverage >= n."""
    return page.host is not None and page.host[1] == page.epoch and page.host[2] >= columns


def _page_bytes(st: StoreState, pool: str) -> int:
    return next(s.page_bytes for s in st.pool_specs if s.name == pool)


def can_drop_device(pg: LogicalKVPage) -> bool:
    """The one rule for dropping a device replica (``drop_device`` and offload's drop flag):
    the page has a device replica, no active address space maps it (its table row would point
    at a freed page group, §14), no pin holds it (a queued copy reads it, §5.3), and a valid
    host replica covers its committed columns (§5.1) — so no committed byte is lost."""
    return (pg.device != NO_PAGE and pg.active_refs == 0 and pg.pins == 0
            and replica_valid(pg, pg.committed))


def _checkpoint(store: Txn, checkpoint: int) -> list[str]:
    b = store.state.bundles.get(checkpoint)
    if b is None or b.active:
        raise UnknownHandle(f"{checkpoint} is not an inactive checkpoint")
    return list(b.pools)


def _select(store: Txn, checkpoint: int, keep: Callable[[LogicalKVPage], bool],
            active: bool = False) -> list[tuple[str, list[int]]]:
    """(pool, slots) of an inactive checkpoint's pages that ``keep`` accepts (``active``:
    of an active sequence's too)."""
    st = store.state
    out = []
    b = st.bundles.get(checkpoint)
    pools = list(b.pools) if active and b is not None else _checkpoint(store, checkpoint)
    for pool in pools:
        p = st.pools[pool]
        slots = [s for s in p.spaces[checkpoint].members
                 if (pg := p.pages[s]) is not None and keep(pg)]
        if slots:
            out.append((pool, slots))
    return out


def transfer_queued(st: StoreState, pool: str, pg: LogicalKVPage) -> bool:
    """A D2H copy of this page is reserved and not yet published (its pins beyond those of
    queued device copies are HostReserve's)."""
    return pg.pins > st.copy_pins.get((pool, pg.slot), 0)


def offload(store: Txn, checkpoint: int, drop_device: bool = False) -> int:
    """Queue D2H copies of every page of an inactive checkpoint that lacks a valid host
    replica. Plans every extent of the recipe before emitting anything. Returns the number
    of pages queued (0: already fully offloaded)."""
    st = store.state
    _checkpoint(store, checkpoint)
    if st.host is None or store.arena is None:
        raise HostArenaError("the store was opened without a host arena (host_bytes=0)")
    # a page a queued restore/COW pins is copied too (the D2H runs after those copies); a
    # page whose D2H is already queued is not queued twice
    recipe = [(pool, [s for s in slots if not transfer_queued(st, pool, st.pools[pool].pages[s])])
              for pool, slots in _select(store, checkpoint, lambda pg: pg.device != NO_PAGE
                                         and not replica_valid(pg, pg.committed))]
    recipe = [(pool, slots) for pool, slots in recipe if slots]
    sizes = [_page_bytes(st, pool) for pool, slots in recipe for _ in slots]
    offsets = st.host.plan([], sizes)
    if offsets is None:
        raise HostArenaError(f"host arena cannot place {len(sizes)} pages ({sum(sizes)} B) for "
                             f"checkpoint {checkpoint}: free {st.host.free_bytes} B of "
                             f"{st.host.capacity} B, largest extent too small or fragmented")
    events: list[ev.DeviceDrop | ev.HostReserve] = []
    if drop_device:  # what is already offloaded drops now; the rest when its copy publishes
        events.extend(ev.DeviceDrop(pool, pack(slots))
                      for pool, slots in _select(store, checkpoint, can_drop_device))
    i = 0
    transfers: list[Transfer] = []
    for pool, slots in recipe:
        offs = offsets[i:i + len(slots)]
        i += len(slots)
        events.append(ev.HostReserve(pool, pack(slots), pack_i64(offs)))
        transfers.append(Transfer(pool, slots, offs, {}))
    store._emit(*events)
    store._transfers.extend(transfers)  # after the events, as every command's queues
    if drop_device:  # every queued copy of its pages, this one's or an earlier offload's
        _drop_when_published(store, checkpoint)
    return len(sizes)


def may_drop(st: StoreState, pool: str, slot: int, along: frozenset[int] | None,
             members: dict[tuple[int, str], set[int]]) -> bool:
    """``can_drop_device``, and ``only_along``."""
    pg = st.pools[pool].pages[slot]
    return pg is not None and can_drop_device(pg) and only_along(st, pool, slot, along,
                                                                  members)


def _drop_when_published(store: Txn, checkpoint: int,
                         along: frozenset[int] | None = None) -> int:
    """Schedule the device replicas of ``checkpoint``'s pages that a queued copy pins: those
    whose D2H copy is queued drop when that copy publishes, and every other pinned one (a
    restore or COW source, e.g. a sequence swapped out again in the interval ``swap_in``
    restored it) when the boundary unpins it — each by ``may_drop`` then, with ``along``
    (``drop_device``'s). Returns the pages newly scheduled behind a D2H copy: the unpin
    drops are a best effort, never counted as progress (a retention loop that counted them,
    or a page scheduled twice, would never reach the boundary)."""
    st = store.state
    cache: dict[tuple[int, str], set[int]] = {}
    members = {pool: {s for s in st.pools[pool].spaces[checkpoint].members
                      if only_along(st, pool, s, along, cache)}  # shared now: not scheduled
               for pool in st.bundles[checkpoint].pools}
    scheduled = 0
    for tr in store._transfers:
        for s in tr.slots:
            if s in members.get(tr.pool, ()):
                known = s in tr.drop
                scheduled += not known
                tr.drop[s] = merged(tr.drop.get(s), along, known)
    for pool, slots in _select(store, checkpoint, lambda pg: pg.device != NO_PAGE
                               and pg.pins > 0 and pg.active_refs == 0):
        pages = st.pools[pool].pages
        for s in slots:
            if s in members[pool] and not transfer_queued(st, pool, pages[s]):  # type: ignore[arg-type]
                d = store._unpin_drops
                d[pool, s] = merged(d.get((pool, s)), along, (pool, s) in d)
    return scheduled


def drops_after_unpin(store: Txn, drops: dict[tuple[str, int], frozenset[int] | None]
                      ) -> list[ev.DeviceDrop]:
    """DeviceDrop events for pages ``_drop_when_published`` scheduled at the boundary's
    Unpin, by ``may_drop`` evaluated now (a page an active fork maps meanwhile, whose replica
    went stale, or that another checkpoint came to share, is kept)."""
    by_pool: dict[str, set[int]] = {}
    members: dict[tuple[int, str], set[int]] = {}
    for (pool, s), along in drops.items():
        if may_drop(store.state, pool, s, along, members):
            by_pool.setdefault(pool, set()).add(s)
    return [ev.DeviceDrop(pool, pack(sorted(slots))) for pool, slots in by_pool.items()]


def drop_device(store: Txn, checkpoint: int, shared_with: Iterable[int] | None = None
                ) -> int:
    """Drop the device replicas of a checkpoint's pages that ``can_drop_device`` allows; their
    page groups return to the pool. A page whose D2H copy is still queued (offload before this
    boundary) drops when that copy publishes, by the same rule then. ``shared_with``: only
    the pages no inactive checkpoint outside it holds too (empty: those ``checkpoint``
    holds alone) — a retention policy demoting one victim leaves the prefix it shares with
    others, e.g. a system prompt, on the device for them. Returns the pages dropped now plus
    those scheduled."""
    _checkpoint(store, checkpoint)
    along = None if shared_with is None else along_with(store, checkpoint, shared_with)
    st, members = store.state, {}
    sel = [(pool, kept) for pool, slots in _select(store, checkpoint, can_drop_device)
           if (kept := [s for s in slots if may_drop(st, pool, s, along, members)])]
    store._emit(*(ev.DeviceDrop(pool, pack(slots)) for pool, slots in sel))
    return sum(len(slots) for _, slots in sel) + _drop_when_published(store, checkpoint, along)


def drop_host(store: Txn, bundle: int) -> int:
    """Drop the host replicas of a checkpoint's — or an active sequence's — pages that still
    have a device replica (frees host arena extents; the pages stay device-resident). Returns
    pages dropped. A page another inactive checkpoint also holds keeps its replica: that
    checkpoint's restart survival rests on it (§5.3), and dropping it would take the survival
    from a checkpoint the caller did not name. Nor is a pinned page's, which a queued copy
    may read. An active sequence's replicas come from a Move of an offloaded checkpoint
    (``swap_in``): they are a cache for a later offload, not durability."""
    b = store.state.bundles.get(bundle)
    if b is None:
        raise UnknownHandle(f"{bundle} is neither an active sequence nor a checkpoint")
    others = 0 if b.active else 1  # the inactive holders a page may have: the target itself
    sel = _select(store, bundle, lambda pg: pg.host is not None and pg.device != NO_PAGE
                  and pg.pins == 0 and pg.refs - pg.active_refs <= others, active=True)
    store._emit(*(ev.HostDrop(pool, pack(slots)) for pool, slots in sel))
    return sum(len(slots) for _, slots in sel)


# --- effects at the boundary ------------------------------------------------------------------
def zero_uncommitted(host_page: np.ndarray, planes: list[torch.Tensor], order: PlaneOrder,
                     committed: int) -> None:
    """Bytes past the committed columns are not part of the replica: make them zero."""
    off = 0
    for t in planes:
        h = t.shape[1] if order is PlaneOrder.PAGE_MAJOR else t.shape[0]
        rows, xb = t.shape[2], t.shape[3] * t.element_size()
        n = h * rows * xb
        region = host_page[off:off + n].reshape(h, rows, xb)
        region[:, committed:, :] = 0
        off += n


def page_checksum(host_page: np.ndarray) -> int:
    return crc32c(host_page)


def runs(ids: list[int]) -> int:
    """Number of runs of adjacent ids (what a coalescing DMA would issue)."""
    return sum(1 for i, x in enumerate(ids) if i == 0 or x != ids[i - 1] + 1)


def extent_runs(offsets: list[int], page_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of ``offsets`` whose host pages lie back to back in the
    arena: each is one ``[n, page_bytes]`` view, one pack or unpack call."""
    out, start = [], 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + page_bytes:
            out.append((start, i))
            start = i
    return out


def copy_out(store: Txn, tr: Transfer) -> tuple[list[int], list[int], list[int]]:
    """Run one queued D2H copy into the arena, coalesced into runs of host-contiguous
    offsets (one pack per run), zero each page's uncommitted columns and checksum it.
    Returns (epochs, coverages, CRC-32Cs) per page, as its HostPublish carries them. A TP
    follower runs the same copy of its own shard (``dist.follower``)."""
    from ninfer_kv.kernels.copy import pack_pages

    st = store.state
    arena = store.arena
    assert arena is not None
    p = st.pools[tr.pool]
    pb = _page_bytes(st, tr.pool)
    planes = store.device.planes(tr.pool)
    order = store.device.pools[tr.pool].geometry.order
    pages = [p.pages[s] for s in tr.slots]
    dev_ids = [pg.device for pg in pages]  # type: ignore[union-attr]
    for start, end in extent_runs(tr.offsets, pb):
        dst = arena.pages(tr.offsets[start], end - start, pb)
        if planes:
            pack_pages(planes, order, dev_ids[start:end], dst)
        else:  # a store without KV planes holds no bytes: its replicas are zeros, never
            dst.zero_()  # what the arena held before (a CRC of that made runs differ)
    store.stats["d2h_pages"] += len(dev_ids)
    store.stats["d2h_runs"] += runs(dev_ids)
    if planes and planes[0].is_cuda:
        torch.cuda.current_stream().synchronize()  # the copy must complete before publish
    epochs, cov, crcs = [], [], []
    for pg, off in zip(pages, tr.offsets, strict=True):
        assert pg is not None and pg.pins > 0, "source must stay pinned during the copy"
        host = arena.data[off:off + pb].numpy()
        zero_uncommitted(host, planes, order, pg.committed)
        epochs.append(pg.epoch)
        cov.append(pg.committed)
        crcs.append(page_checksum(host))
    return epochs, cov, crcs


def run_transfers(store: Txn, transfers: list[Transfer]) -> list[ev.HostPublish]:
    """Run queued D2H copies; return the publish events (verified) to journal next. The
    caller applies them, then asks :func:`drops_after_publish` which replicas to drop."""
    out: list[ev.HostPublish] = []
    assert store.arena is not None
    for tr in transfers:
        epochs, cov, crcs = copy_out(store, tr)
        out.append(ev.HostPublish(tr.pool, tr.offsets[0], pack(tr.slots), pack(epochs),
                                  pack(cov), pack_u32(crcs)))
    store.arena.flush()
    return out


def drops_after_publish(store: Txn, transfers: list[Transfer]) -> list[ev.DeviceDrop]:
    """DeviceDrop events for the transfers' ``drop`` slots, by ``may_drop`` evaluated now
    (after the publish was applied): a page an active fork maps meanwhile, or that another
    checkpoint came to share (outside its ``along``), is kept."""
    out = []
    members: dict[tuple[int, str], set[int]] = {}
    for tr in transfers:
        slots = sorted(s for s, along in tr.drop.items()
                       if may_drop(store.state, tr.pool, s, along, members))
        if slots:
            out.append(ev.DeviceDrop(tr.pool, pack(slots)))
    return out


def restore_pages(store: Txn, restores: list[ev.DeviceRestore]) -> None:
    """H2D for DeviceRestore events: unpack host pages into their new device page groups —
    one ``unpack_pages`` (one kernel call per plane) per run of pages whose host replicas
    lie back to back in the arena: a checkpoint offloaded in one transfer is one run, where
    a call per page made a 64-page swap-in 64 calls per plane. An event's device pages are
    distinct and its host pages only read, so the runs are independent."""
    from ninfer_kv.kernels.copy import unpack_pages

    st = store.state
    arena = store.arena
    for r in restores:
        planes = store.device.planes(r.pool)
        if not planes or arena is None:
            continue
        pb = _page_bytes(st, r.pool)
        order = store.device.pools[r.pool].geometry.order
        p = st.pools[r.pool]
        devs = ev.unpack(r.pages).tolist()
        offsets = []
        for slot in ev.unpack(r.slots).tolist():
            pg = p.pages[slot]
            assert pg is not None and pg.host is not None
            offsets.append(pg.host[0])
        for start, end in extent_runs(offsets, pb):
            unpack_pages(planes, order, arena.pages(offsets[start], end - start, pb),
                         devs[start:end])
        store.stats["h2d_pages"] += len(devs)


def verify_checkpoint(store: Txn, bundle: int) -> str | None:
    """Recompute every host page's CRC from the arena; None when all match."""
    st = store.state
    arena = store.arena
    pools = st.bundles[bundle].pools
    if not any(st.pools[p].spaces[bundle].nmem for p in pools):
        return None  # no page, nothing to verify: its metadata is in the journal
    if arena is None:
        return "no host arena"
    if arena.path is None:
        # the bytes died with the process; a fresh buffer may even reuse the old memory, so
        # matching CRCs would prove nothing (§5.3: only a persistent host tier survives)
        return "the host arena is in memory: its replicas did not survive the restart"
    for pool in st.bundles[bundle].pools:
        p = st.pools[pool]
        pb = _page_bytes(st, pool)
        for i, slot in enumerate(p.spaces[bundle].members):
            pg = p.pages[slot]
            assert pg is not None and pg.host is not None
            got = page_checksum(arena.data[pg.host[0]:pg.host[0] + pb].numpy())
            if got != pg.host[3]:
                return (f"pool {pool} block {i} (page {pool}:{slot}): host checksum "
                        f"{got:#010x} != published {pg.host[3]:#010x}")
    return None
