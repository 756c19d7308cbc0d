"""``apply``'s host-tier and copy-pin handlers (spec §5.3): host replicas of pages, their
device drops and restores, and the pins that keep a page alive while a queued copy reads it.
Each checks the whole event before it changes anything (a damaged journal's event is refused
unchanged)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from ninfer_kv.engine.host_arena import ExtentAllocator
from ninfer_kv.engine.page_life import I64, collect, collectable
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import StoreState
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import unpack, unpack_i64, unpack_u32


def _live(pool: PoolState, slots: list[int], what: str) -> None:
    n = len(pool.pg_live)
    bad = [s for s in slots if not (0 <= s < n and pool.pg_live[s])]
    assert not bad, f"{what} of {pool.name}: slots {bad[:4]} are not live pages"


def host_configure(st: StoreState, e: ev.HostConfigure) -> None:
    st.host = ExtentAllocator(e.capacity)
    st.host_persistent = e.persistent


def _page_bytes(st: StoreState, pool: str) -> int:
    return next(s.page_bytes for s in st.pool_specs if s.name == pool)


def host_reserve(st: StoreState, e: ev.HostReserve) -> None:
    pool = st.pools[e.pool]
    slots = unpack(e.slots).tolist()
    offsets = unpack_i64(e.offsets).tolist()
    assert st.host is not None and slots and len(slots) == len(offsets), \
        f"HostReserve of {e.pool}: {len(slots)} slots, {len(offsets)} offsets"
    assert offsets[0] not in st.host_pending, f"HostReserve at {offsets[0]}: one is pending"
    _live(pool, slots, "HostReserve")
    size = _page_bytes(st, e.pool)
    done: list[int] = []
    try:
        for off in offsets:
            st.host.allocate(off, size)
            done.append(off)
    except (KeyError, AssertionError) as exc:
        for old in reversed(done):  # undone whole: carving then freeing restores the extent
            st.host.free(old)
        if isinstance(exc, KeyError):  # the arena's lookup: name the event and the offset
            raise AssertionError(f"HostReserve of {e.pool}: offset {off} does not start a "
                                 "free host extent (§5.3)") from None
        raise
    for slot in slots:
        pool.pg_pins[slot] += 1
    st.host_pending[offsets[0]] = (e.pool, tuple(slots), tuple(offsets))


def _pending(st: StoreState, offset: int, pool: str, what: str
             ) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """The transfer pending at ``offset`` (pool, slots, offsets), which the event must name
    as its HostReserve did: an event's fields say what it does (``dump`` shows them)."""
    got = st.host_pending.get(offset)
    assert got is not None, f"{what} at {offset}: no transfer is pending there"
    assert got[0] == pool, f"{what} at {offset}: names pool {pool!r}, its HostReserve {got[0]!r}"
    return got


def host_publish(st: StoreState, e: ev.HostPublish) -> None:
    """The pending transfer at ``e.offset`` becomes its pages' host replicas (an older
    replica's extent is freed). Everything is checked before anything changes: the fields'
    lengths, every slot a live page, every new offset and every replaced one a live extent
    (only a damaged journal or snapshot breaks these)."""
    pool_name, slots, offsets = _pending(st, e.offset, e.pool, "HostPublish")
    named = unpack(e.slots).tolist()
    assert named == list(slots), f"HostPublish at {e.offset}: names slots {named[:4]}, its " \
        f"HostReserve {list(slots)[:4]} (the fields follow the reserved slots' order)"
    n = {len(unpack(e.epochs)), len(unpack(e.coverage)), len(unpack_u32(e.checksums))}
    assert n == {len(slots)}, f"HostPublish at {e.offset}: {len(slots)} slots, fields of {n}"
    pool = st.pools[pool_name]
    _live(pool, list(slots), "HostPublish")
    live = st.host.live  # type: ignore[union-attr]
    old = [h[0] for h in map(pool.host_of.get, slots) if h is not None]
    bad = [o for o in (*offsets, *old) if o not in live]
    assert not bad and len({*offsets, *old}) == len(offsets) + len(old), \
        f"HostPublish at {e.offset}: extents {bad[:4]} are not allocated, or one is named twice"
    collectable(st, pool, np.asarray(slots, I64), "HostPublish of")
    del st.host_pending[e.offset]
    for slot, off, ep, cov, crc in zip(slots, offsets, unpack(e.epochs).tolist(),
                                       unpack(e.coverage).tolist(),
                                       unpack_u32(e.checksums).tolist(), strict=True):
        was = pool.host_of.get(slot)
        if was is not None:  # a newer replica replaces the old one
            st.host.free(was[0])  # type: ignore[union-attr]
        pool.host_of[slot] = (off, ep, cov, crc)
        pool.pg_pins[slot] -= 1
    collect(st, pool, np.asarray(slots, I64))


def host_abort(st: StoreState, e: ev.HostAbort) -> None:
    """The pending transfer at ``e.offset`` is given up: its extents are freed and its pages
    unpinned. Its pages are live (the transfer pins them) — checked before anything changes."""
    pool_name, slots, offsets = _pending(st, e.offset, e.pool, "HostAbort")
    pool = st.pools[pool_name]
    _live(pool, list(slots), "HostAbort")
    bad = [o for o in offsets if o not in st.host.live]  # type: ignore[union-attr]
    old = [h[0] for h in map(pool.host_of.get, slots) if h is not None]
    assert not bad and len({*offsets, *old}) == len(offsets) + len(old), \
        f"HostAbort at {e.offset}: extents {bad[:4]} are not allocated, or one is named twice"
    collectable(st, pool, np.asarray(slots, I64), "HostAbort of")
    del st.host_pending[e.offset]
    for slot, off in zip(slots, offsets, strict=True):
        st.host.free(off)  # type: ignore[union-attr]
        pool.pg_pins[slot] -= 1
    collect(st, pool, np.asarray(slots, I64))


def host_drop(st: StoreState, e: ev.HostDrop) -> None:
    pool = st.pools[e.pool]
    slots = unpack(e.slots)
    sl = slots.tolist()
    _live(pool, sl, "HostDrop")
    assert len(set(sl)) == len(sl) and all(s in pool.host_of for s in sl), \
        f"HostDrop of {e.pool}: slots {sl[:4]} repeat or hold no host replica"
    assert all(pool.pg_device[s] != NO_PAGE for s in sl), \
        f"HostDrop of {e.pool}: slots {sl[:4]} include a Host-only page, which would be lost " \
        "(§5.1: drop_host keeps a replica)"
    collectable(st, pool, slots.astype(I64), "HostDrop of")
    for slot in sl:
        st.host.free(int(pool.pg_host_off[slot]))  # type: ignore[union-attr]
        del pool.host_of[slot]
    collect(st, pool, slots.astype(I64))


def device_drop(st: StoreState, e: ev.DeviceDrop) -> None:
    pool = st.pools[e.pool]
    sl = unpack(e.slots).tolist()
    _live(pool, sl, "DeviceDrop")
    assert len(set(sl)) == len(sl) and all(
        pool.pg_device[s] != NO_PAGE and s in pool.host_of for s in sl), \
        f"DeviceDrop of {e.pool}: slots {sl[:4]} repeat, or one is not on both tiers"
    pool.free_pages.give(pool.pg_device[sl])  # refused whole if a page group is free already
    pool.pg_device[sl] = NO_PAGE


def device_restore(st: StoreState, e: ev.DeviceRestore) -> None:
    pool = st.pools[e.pool]
    sl, devs = unpack(e.slots).tolist(), unpack(e.pages).tolist()
    assert len(sl) == len(devs), f"DeviceRestore of {e.pool}: {len(sl)} slots, {len(devs)} pages"
    _live(pool, sl, "DeviceRestore")
    assert len(set(sl)) == len(sl) and all(pool.pg_device[s] == NO_PAGE for s in sl), \
        f"DeviceRestore of {e.pool}: slots {sl[:4]} repeat, or one is on the device"
    assert len(set(devs)) == len(devs) and all(d in pool.free_pages for d in devs), \
        f"DeviceRestore of {e.pool}: page groups {devs[:4]} repeat or are not free"
    pool.free_pages.take(devs)
    pool.pg_device[sl] = devs


def pin(st: StoreState, e: ev.Pin) -> None:
    pool = st.pools[e.pool]
    sl = unpack(e.slots).tolist()
    _live(pool, sl, "Pin")  # every slot a live page: its pin count is its page's
    pins = pool.pg_pins
    for slot in sl:
        pins[slot] += 1
        key = (e.pool, slot)
        st.copy_pins[key] = st.copy_pins.get(key, 0) + 1


def unpin(st: StoreState, e: ev.Unpin) -> None:
    pool = st.pools[e.pool]
    slots = unpack(e.slots)
    counts = Counter(slots.tolist())  # a boundary unpins one source tail once per Fork
    over = [s for s, k in counts.items() if st.copy_pins.get((e.pool, s), 0) < k]
    assert not over, f"Unpin of {e.pool}: slots {over[:4]} unpinned more often than pinned"
    dead = [s for s in counts if pool.pages[s] is None]  # IndexError past the slots
    assert not dead, f"Unpin of {e.pool}: slots {dead[:4]} hold no page"
    collectable(st, pool, np.fromiter(counts, I64, len(counts)), "Unpin of")
    pins = pool.pg_pins
    for slot, k in counts.items():
        key = (e.pool, slot)
        n = st.copy_pins[key] - k
        if n:
            st.copy_pins[key] = n
        else:
            del st.copy_pins[key]
        pins[slot] -= k
    collect(st, pool, np.fromiter(counts, I64, len(counts)))
