"""The store's whole logical state, its snapshot encoding and its digest.

``StoreState`` is plain bookkeeping: pools, pages, address spaces, bundles. It holds no
tensors, so replay rebuilds it on any machine. Only ``engine.apply.apply`` mutates it.

The snapshot is a canonical msgspec encoding (every dict emitted in key order), so
``digest()`` — a BLAKE2b of that encoding — is equal for live and replayed states and never
depends on timings or on the order in which dicts were filled.
"""

from __future__ import annotations

import gc
import hashlib
from typing import Any

import msgspec
import numpy as np

from ninfer_kv.engine.address_space import KVAddressSpace, SequenceKVBundle
from ninfer_kv.engine.free_ids import FreeIds
from ninfer_kv.engine.host_arena import ExtentAllocator
from ninfer_kv.engine.msgpack_rows import encode_live_columns
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.errors import IdsExhausted
from ninfer_kv.journal.events import PoolSpec

MAX_BUNDLE = (1 << 31) - 1
"""The last seq id a journal can hand out: batched events pack seq ids as int32."""

ID_GAP = 1 << 16
"""How far past the journal's next seq id a reopened store starts (``Recovered.next_id``,
engine/restart.py). An id handed out in a record a failure lost — the one whose write or fsync
failed (fail-stop), or those a crash cut before they were durable — is then never handed out
again, so an id an engine kept names nothing after a reopen, never another sequence. It
holds because the ids handed out since the last durable record stay within ``ID_GAP``: a
record is made durable once they pass half of it (``durability.settle_ids``), and
``new_ids`` refuses more than that in one step. 2**31 ids allow 32,767 reopens."""


def new_ids(st: StoreState, n: int = 1, base: int | None = None) -> int:
    """The first of the ``n`` seq ids a command is about to hand out (``next_bundle`` on; the
    events' ``apply`` advances it), refused with ``IdsExhausted`` before anything is emitted
    when the last would not fit the journal's int32 fields, or would be more than ``ID_GAP``
    past ``base``, the next id as of the store's last durable record."""
    if st.next_bundle + n - 1 > MAX_BUNDLE:
        raise IdsExhausted(f"seq ids exhausted: the next is {st.next_bundle}, the last a journal "
                           f"can record is {MAX_BUNDLE} (int32 fields); ids are never reused: "
                           "continue in a new journal directory")
    if base is not None and st.next_bundle + n - base > ID_GAP:
        raise IdsExhausted(f"{n} more seq ids would make {st.next_bundle + n - base} handed out "
                           f"since the last durable record, over {ID_GAP}: run a boundary "
                           f"first (a reopen starts {ID_GAP} ids past the journal's next one, "
                           "so no id a lost record handed out is handed out again)")
    return st.next_bundle


class StoreState:
    __slots__ = ("pools", "bundles", "next_bundle", "plan", "pool_specs", "seq", "host",
                 "host_pending", "copy_pins", "host_persistent")

    def __init__(self) -> None:
        self.pools: dict[str, PoolState] = {}
        self.bundles: dict[int, SequenceKVBundle] = {}
        self.next_bundle = 1
        self.plan: dict[str, Any] = {}
        self.pool_specs: list[PoolSpec] = []
        self.seq = 0  # last journal record applied
        self.host: ExtentAllocator | None = None  # host arena extents (None = no host tier)
        # unpublished destinations: first offset -> (pool, slots, offsets)
        self.host_pending: dict[int, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
        # pins held by queued device copies (Pin/Unpin): (pool, slot) -> count
        self.copy_pins: dict[tuple[str, int], int] = {}
        self.host_persistent = -1  # HostConfigure.persistent: 1 file, 0 memory, -1 unknown

    @property
    def configured(self) -> bool:
        return bool(self.pools)


# --- snapshot ----------------------------------------------------------------------------------
class _PoolSnap(msgspec.Struct, array_like=True, gc=False):
    name: str
    reserved: int
    free_pages: list[int]
    free_rows: list[int]
    gens: list[int]
    pages: list[list[int]]           # LogicalKVPage.as_tuple for live slots
    spaces: list[tuple[Any, ...]]    # KVAddressSpace.as_tuple, by bundle


class _StateSnap(msgspec.Struct, array_like=True, gc=False):
    seq: int
    next_bundle: int
    plan: dict[str, Any]
    pool_specs: list[PoolSpec]
    pools: list[_PoolSnap]
    bundles: list[tuple[Any, ...]]
    host_capacity: int = -1
    host_free: list[tuple[int, int]] = []
    host_live: list[tuple[int, int]] = []
    host_pending: list[tuple[int, str, list[int], list[int]]] = []
    copy_pins: list[tuple[str, int, int]] = []
    host_persistent: int = -1


def _canonical(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _canonical(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list | tuple):
        return [_canonical(x) for x in obj]
    return obj


def page_table(p: PoolState) -> np.ndarray:
    """``LogicalKVPage.as_tuple()`` of every live page of ``p`` in slot order, as the rows of
    one int64 array built from the pool's arrays (a snapshot and the digest cost a few array
    passes, not one view per page)."""
    live = np.flatnonzero(p.pg_live[:p.n_slots])
    out = np.empty((len(live), 1 + p.pg.shape[0]), np.int64)
    out[:, 0] = live
    out[:, 1:] = p.pg[:, live].T  # the fields in PG_FIELDS order: as_tuple's after the slot
    return out


def page_tuples(p: PoolState) -> list[list[int]]:
    """``page_table`` as lists (what a decoded snapshot holds)."""
    paused = gc.isenabled()
    gc.disable()  # tens of thousands of small lists: no collection passes while they are made
    try:
        return page_table(p).tolist()
    finally:
        if paused:
            gc.enable()


def to_snapshot(st: StoreState, *, with_seq: bool = True, raw: bool = False) -> _StateSnap:
    """The snapshot of ``st``. ``raw``: each pool's pages as their msgpack already
    (``msgspec.Raw`` of ``encode_live_columns``: the same bytes, for encoding only)."""
    pools = []
    for name in sorted(st.pools):
        p = st.pools[name]
        pools.append(_PoolSnap(
            name, p.reserved, list(p.free_pages), list(p.free_rows), list(p.gens),
            msgspec.Raw(memoryview(encode_live_columns(p.pg, p.pg_live, p.n_slots)))  # type: ignore[arg-type]
            if raw else page_tuples(p),
            [p.spaces[b].as_tuple() for b in sorted(p.spaces)]))
    bundles = [st.bundles[b].as_tuple() for b in sorted(st.bundles)]
    snap = _StateSnap(st.seq if with_seq else 0, st.next_bundle, _canonical(st.plan),
                      list(st.pool_specs), pools, bundles)
    snap.copy_pins = [(p, s, n) for (p, s), n in sorted(st.copy_pins.items())]
    if st.host is not None:
        snap.host_capacity = st.host.capacity
        snap.host_free = list(st.host.by_off.items())
        snap.host_live = list(st.host.live.items())
        snap.host_pending = [(o, p, list(s), list(f))
                             for o, (p, s, f) in sorted(st.host_pending.items())]
        snap.host_persistent = st.host_persistent
    return snap


def encode_state(st: StoreState) -> bytes:
    return msgspec.msgpack.encode(to_snapshot(st, raw=True))


def digest(st: StoreState) -> str:
    """Stable hash of the logical state (not of the journal position)."""
    return hashlib.blake2b(msgspec.msgpack.encode(to_snapshot(st, with_seq=False, raw=True)),
                           digest_size=16).hexdigest()


def _check_ranges(ps: _PoolSnap, spec: PoolSpec, n: int, pages: np.ndarray,
                  next_bundle: int) -> None:
    """A snapshot's ids index the pool's arrays, and the compiled loops that later read them
    do not bounds-check: every page slot and membership slot below the slot count, every page
    group, row and membership length within the pool, or ``ValueError`` (the snapshot is then
    unusable, as one that does not decode). Whether the state keeps §14 is the recovery's
    check (``violations``); this one only keeps a wrong snapshot from writing astray."""
    def bad(what: str) -> ValueError:
        return ValueError(f"snapshot pool {ps.name}: {what} (slots {n}, capacity "
                          f"{spec.capacity}, rows {spec.rows}, L {spec.logical_pages})")
    if len(pages):
        slots, devs = pages[:, 0], pages[:, 8]
        if slots.min() < 0 or slots.max() >= n or len(np.unique(slots)) != len(slots):
            raise bad("a page slot out of range or listed twice")
        if devs.min() < NO_PAGE or devs.max() >= spec.capacity:
            raise bad("a page group out of range")
        none = pages[:, 10] == NO_PAGE  # no host replica: offset -1, the rest zeros
        if pages[:, 10].min() < NO_PAGE or pages[none, 11:].any():
            raise bad("a host replica field out of range")
    for t in ps.spaces:
        members, row = t[7], t[6]
        ints = (*t[:4], *t[5:7], *t[8:9], *members)  # the space tuple is loosely typed: a
        if (len(t) not in (8, 9) or type(t[4]) is not bool  # float would be truncated below
                or any(type(x) is not int for x in ints)):
            raise bad(f"space {list(t)[:7]}: a field of the wrong type or count")
        if not 0 <= t[0] < next_bundle:  # ids are handed out in order (a negative one is none)
            raise bad(f"seq {t[0]} out of range of the ids handed out [0, {next_bundle})")
        if len(members) > spec.logical_pages or any(not 0 <= m < n for m in members):
            raise bad(f"seq {t[0]}: membership {list(members)[:8]} out of range")
        if not -1 <= row < spec.rows:
            raise bad(f"seq {t[0]}: row {row} out of range")


def decode_state(data: bytes) -> StoreState:
    snap = msgspec.msgpack.decode(data, type=_StateSnap)
    if not 0 < snap.next_bundle <= MAX_BUNDLE + 1:
        raise ValueError(f"snapshot: next seq id {snap.next_bundle} outside [1, "
                         f"{MAX_BUNDLE + 1}] (ids are int32 in the journal)")
    st = StoreState()
    st.seq, st.next_bundle, st.plan = snap.seq, snap.next_bundle, snap.plan
    st.pool_specs = list(snap.pool_specs)
    specs = {s.name: s for s in snap.pool_specs}
    for ps in snap.pools:
        spec = specs[ps.name]
        p = PoolState(ps.name, spec.capacity, spec.rows, spec.logical_pages)
        p.reserved = ps.reserved
        p.free_pages = FreeIds(spec.capacity, ps.free_pages)
        p.free_rows = FreeIds(spec.rows, ps.free_rows)
        n = len(ps.gens)
        if n:
            p.ensure_slot(n - 1)
        p.n_slots = n
        p.pg_gen[:n] = ps.gens
        rows = np.array(ps.pages, np.int64).reshape(-1, 14)  # page_tuples, back to arrays
        _check_ranges(ps, spec, n, rows, snap.next_bundle)
        if len(rows):
            slots = rows[:, 0]
            p.ensure_slot(int(slots.max()))
            p.pg_live[slots] = True
            p.pg[:, slots] = rows[:, 1:].T  # page_table's columns after the slot
            p.host_of.recount()
        p.free_slots = FreeIds(len(p.pg_live), np.flatnonzero(~p.pg_live[:n]))
        for t in ps.spaces:
            sp = KVAddressSpace(p, t[0], t[5], t[6])
            sp.committed, sp.provisional, sp.protected, sp.active = t[1], t[2], t[3], t[4]
            sp.members = list(t[7])
            sp.incoming = t[8] if len(t) > 8 else 0
            p.spaces[sp.bundle] = sp
            if sp.row >= 0:
                p.row_owner[sp.row] = sp.bundle
        st.pools[ps.name] = p
    if snap.host_capacity >= 0:
        st.host = ExtentAllocator.restore(snap.host_capacity, snap.host_free, snap.host_live)
        st.host_pending = {o: (p, tuple(s), tuple(f)) for o, p, s, f in snap.host_pending}
        stray = [o for _, _, _, offs in snap.host_pending for o in offs if o not in st.host.live]
        if stray:  # a pending transfer's extents are allocated (HostReserve carved them)
            raise ValueError(f"snapshot: pending host transfer extents {stray[:4]} out of range "
                             "of the allocated ones")
        st.host_persistent = snap.host_persistent
    for name, slots in [*((p, [s]) for p, s, _ in snap.copy_pins),
                        *((p, s) for _, p, s, _ in snap.host_pending)]:
        if name not in st.pools or any(not 0 <= x < st.pools[name].n_slots for x in slots):
            raise ValueError(f"snapshot: a pinned or pending slot {list(slots)[:8]} of pool "
                             f"{name!r} is out of range")
    st.copy_pins = {(p, s): n for p, s, n in snap.copy_pins}
    for t in snap.bundles:
        if any(type(t[k]) is not int for k in (0, 4, 5)) or type(t[1]) is not bool:
            raise ValueError(f"snapshot: bundle {list(t)[:6]}: a field of the wrong type")
        if not 0 <= t[0] < snap.next_bundle:
            raise ValueError(f"snapshot: seq {t[0]} out of range of the ids handed out [0, "
                             f"{snap.next_bundle})")
        b = SequenceKVBundle(t[0], tuple(t[2]))
        b.active, b.finish_reason, b.parent, b.budget = t[1], t[3], t[4], t[5]
        if not 0 <= b.budget < (1 << 63):
            raise ValueError(f"snapshot: bundle {b.id} budget {b.budget} outside int64")
        b.meta = bytes(t[6]) if len(t) > 6 else b""
        st.bundles[b.id] = b
        for name in b.pools:  # Activate gave each space its bundle's budget (grow reads it)
            sp = st.pools[name].spaces.get(b.id) if name in st.pools else None
            if sp is not None:
                sp.budget = b.budget
    return st
