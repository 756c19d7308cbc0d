"""One typed pool's logical state: page-group ids, reservations, rows, page slots (spec §5.2).

Invariant kept by ``apply`` and checked by ``check_invariants``::

    allocated + reserved + available == capacity

where ``allocated`` = device leases held by logical pages, ``reserved`` = sum over active
address spaces of (entitlement - membership), ``available`` = the rest. Reservations are page
*counts*, not ids: any free id can satisfy any reservation, so ``free_pages`` (ids without a
lease) holds exactly ``reserved + available`` ids. The command picks the lowest free ids
(locality), and nothing depends on contiguity (§4.2).

Structure of arrays: the per-page fields live in ``pg_*`` (by slot; ``pg_live`` says which
of the ``n_slots`` slots ever used hold a page; the int64 ones are the rows of one matrix,
``pg``, which compiled loops take whole), the per-space ones in ``sp_*`` (by a space's
dense index, recycled when the space is dropped); ``LogicalKVPage`` and ``KVAddressSpace`` are
views over them (engine/pages.py, engine/address_space.py). ``pages[slot]`` makes a page's
view (None for a free slot), ``gens[slot]`` reads a slot's generation; ``host_of`` maps a
slot to its host replica, kept in ``pg_host_*`` (offset -1 = none); ``spaces`` maps bundle
-> space and keeps ``bundle_table`` (the same map as a hash table in one array,
``bundle_index``, for compiled loops: engine/bundle_table.py) in step. Arrays grow by
doubling; their spare tail holds no state.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np

from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.bundle_table import BundleTable
from ninfer_kv.engine.free_ids import FreeIds
from ninfer_kv.engine.pages import PG_ROWS, LogicalKVPage

I64 = np.int64


def _grown(a: np.ndarray, n: int, fill: int) -> np.ndarray:
    """``a`` with at least ``n`` entries along axis 0 (doubling), the new ones ``fill``."""
    cap = max(n, 2 * len(a), 16)
    out = np.full((cap, *a.shape[1:]), fill, dtype=a.dtype)
    out[:len(a)] = a
    return out


class SpaceMap(MutableMapping[int, KVAddressSpace]):
    """bundle -> KVAddressSpace of one pool, iterated in bundle order; every change also
    updates ``PoolState.bundle_index`` and frees a dropped space's array index."""

    __slots__ = ("_p", "_d")

    def __init__(self, p: PoolState) -> None:
        self._p = p
        self._d: dict[int, KVAddressSpace] = {}

    def __getitem__(self, bundle: int) -> KVAddressSpace:
        return self._d[bundle]

    def get(self, bundle: int, default: KVAddressSpace | None = None  # type: ignore[override]
            ) -> KVAddressSpace | None:
        return self._d.get(bundle, default)

    def __contains__(self, bundle: object) -> bool:
        return bundle in self._d

    def __setitem__(self, bundle: int, sp: KVAddressSpace) -> None:
        assert bundle not in self._d and sp.bundle == bundle and sp._p is self._p
        p = self._p
        p.bundle_table.insert(bundle, sp.i)
        p.bundle_index = p.bundle_table.array  # a new array when the table was rebuilt
        p.sp_bundle[sp.i] = bundle
        self._d[bundle] = sp

    def __delitem__(self, bundle: int) -> None:
        sp = self._d.pop(bundle)
        p = self._p
        p.bundle_table.remove(bundle)
        p.sp_bundle[sp.i] = -1
        p.sp_active[sp.i] = False
        p.sp_nmem[sp.i] = 0
        p.sp_row[sp.i] = -1
        p.sp_free.append(sp.i)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._d))

    def __len__(self) -> int:
        return len(self._d)


class PageTable:
    """``PoolState.pages``: slot -> ``LogicalKVPage`` view, or None for a free slot; ``len`` is
    the number of slots ever used. Read-only: ``apply`` changes pages through the arrays."""

    __slots__ = ("_p",)

    def __init__(self, p: PoolState) -> None:
        self._p = p

    def __len__(self) -> int:
        return self._p.n_slots

    def __getitem__(self, slot: int) -> LogicalKVPage | None:
        p = self._p
        if not 0 <= slot < p.n_slots:
            raise IndexError(f"slot {slot} of {p.name}: {p.n_slots} slots")
        return LogicalKVPage(p, slot) if p.pg_live[slot] else None

    def __iter__(self) -> Iterator[LogicalKVPage | None]:
        p = self._p
        return (LogicalKVPage(p, s) if live else None
                for s, live in enumerate(p.pg_live[:p.n_slots].tolist()))


class GenTable:
    """``PoolState.gens``: slot -> generation (as int), for live and free slots."""

    __slots__ = ("_p",)

    def __init__(self, p: PoolState) -> None:
        self._p = p

    def __len__(self) -> int:
        return self._p.n_slots

    def __getitem__(self, slot: int) -> int:
        p = self._p
        if not 0 <= slot < p.n_slots:
            raise IndexError(f"slot {slot} of {p.name}: {p.n_slots} slots")
        return int(p.pg_gen[slot])

    def __iter__(self) -> Iterator[int]:
        return iter(self._p.pg_gen[:self._p.n_slots].tolist())


class HostMap(MutableMapping[int, tuple[int, int, int, int]]):
    """``PoolState.host_of``: slot -> host replica ``(offset, epoch, coverage, checksum)`` of
    its page (§5.1), stored in ``pg_host_off`` / ``_epoch`` / ``_cov`` / ``_crc``; a slot
    without one holds offset -1 and zeros. Iterated in slot order; ``len`` is kept as a
    count (``if pool.host_of:`` is O(1) on the hot paths)."""

    __slots__ = ("_p", "_n")

    def __init__(self, p: PoolState) -> None:
        self._p = p
        self._n = 0

    def _has(self, slot: object) -> bool:
        off = self._p.pg_host_off
        return isinstance(slot, int | np.integer) and 0 <= slot < len(off) and off[slot] >= 0

    def __contains__(self, slot: object) -> bool:
        return self._has(slot)

    def get(self, slot: int, default: Any = None) -> Any:  # type: ignore[override]
        if not self._has(slot):
            return default
        p = self._p
        return (int(p.pg_host_off[slot]), int(p.pg_host_epoch[slot]), int(p.pg_host_cov[slot]),
                int(p.pg_host_crc[slot]))

    def __getitem__(self, slot: int) -> tuple[int, int, int, int]:
        if not self._has(slot):
            raise KeyError(slot)
        return self.get(slot)  # type: ignore[no-any-return]

    def __setitem__(self, slot: int, replica: tuple[int, int, int, int]) -> None:
        p = self._p
        off, epoch, cov, crc = replica
        assert off >= 0, f"{p.name} slot {slot}: a host replica at offset {off}"
        if slot >= len(p.pg_host_off):
            p.ensure_slot(slot)
        if p.pg_host_off[slot] < 0:
            self._n += 1
        p.pg_host_off[slot], p.pg_host_epoch[slot] = off, epoch
        p.pg_host_cov[slot], p.pg_host_crc[slot] = cov, crc

    def __delitem__(self, slot: int) -> None:
        if not self._has(slot):
            raise KeyError(slot)
        p = self._p
        p.pg_host_off[slot] = NO_HOST
        p.pg_host_epoch[slot] = p.pg_host_cov[slot] = p.pg_host_crc[slot] = 0
        self._n -= 1

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._p.pg_host_off >= 0).tolist())

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def recount(self) -> None:
        """Count the replicas again after the arrays were written wholesale (a snapshot)."""
        self._n = int((self._p.pg_host_off >= 0).sum())


NO_HOST = -1
"""``pg_host_off`` of a slot whose page has no host replica."""

PG_FIELDS = (("pg_gen", 0), ("pg_epoch", 0), ("pg_committed", 0), ("pg_protected", 0),
             ("pg_refs", 0), ("pg_active", 0), ("pg_writer", -1), ("pg_device", -1),
             ("pg_pins", 0), ("pg_host_off", NO_HOST), ("pg_host_epoch", 0), ("pg_host_cov", 0),
             ("pg_host_crc", 0))
"""The per-slot int64 fields, in the order of the rows of ``PoolState.pg`` (``pages.PG_GEN``
...), and the value of a slot that never held a page."""
assert [f for f, _ in PG_FIELDS] == ["pg_" + n.lower() for n in PG_ROWS]


_PG_NAMES = frozenset(f for f, _ in PG_FIELDS)


def _pg_matrix(n: int, old: np.ndarray | None = None) -> np.ndarray:
    """``PoolState.pg`` with ``n`` slots: ``old``'s columns, then never-used ones."""
    pg = np.empty((len(PG_FIELDS), n), I64)
    have = 0 if old is None else old.shape[1]
    if have:
        pg[:, :have] = old
    for k, (_, fill) in enumerate(PG_FIELDS):
        pg[k, have:] = fill
    return pg


class PoolState:
    __slots__ = ("name", "capacity", "rows", "logical_pages", "free_pages", "reserved",
                 "free_rows", "row_owner", "pages", "gens", "free_slots", "spaces", "n_slots",
                 "pg_live", "host_of", "pg", *(f for f, _ in PG_FIELDS),
                 "sp_members", "sp_nmem", "sp_committed", "sp_protected", "sp_entitlement",
                 "sp_active", "sp_bundle", "sp_budget", "sp_row", "sp_provisional", "sp_free",
                 "bundle_table", "bundle_index")

    def __init__(self, name: str, capacity: int, rows: int, logical_pages: int) -> None:
        self.name = name
        self.capacity = capacity
        self.rows = rows                        # C: block-table rows
        self.logical_pages = logical_pages      # L: columns of a block-table row
        self.free_pages = FreeIds(capacity, range(capacity))
        self.reserved = 0
        self.free_rows = FreeIds(rows, range(rows))
        self.row_owner: dict[int, int] = {}     # row -> bundle
        self.free_slots = FreeIds(max(16, capacity))
        # per slot (LogicalKVPage's fields)
        self.n_slots = 0                        # slots ever used; pages[0:n_slots]
        n = max(16, capacity)
        self._set_pg(_pg_matrix(n))
        self.pg_live = np.zeros(n, np.bool_)
        self.host_of = HostMap(self)            # slot -> host replica (pg_host_*)
        self.pages = PageTable(self)
        self.gens = GenTable(self)
        # per space index (KVAddressSpace's array-backed fields)
        m = max(16, 2 * rows)
        self.sp_members = np.full((m, min(logical_pages, 16)), -1, np.int32)
        self.sp_nmem = np.zeros(m, I64)
        self.sp_committed = np.zeros(m, I64)
        self.sp_protected = np.zeros(m, I64)
        self.sp_entitlement = np.zeros(m, I64)
        self.sp_active = np.zeros(m, np.bool_)
        self.sp_bundle = np.full(m, -1, I64)    # space index -> bundle (-1: free index)
        self.sp_budget = np.zeros(m, I64)       # its bundle's prompt + output budget
        self.sp_row = np.full(m, -1, I64)       # its execution row (-1: none, §7.2)
        self.sp_provisional = np.zeros(m, I64)  # speculative frontier (§8.2)
        self.sp_free: list[int] = list(range(m - 1, -1, -1))  # stack: lowest index on top
        self.bundle_table = BundleTable()  # bundle -> space index, for compiled loops
        self.bundle_index = self.bundle_table.array  # what they take (engine/bundle_table.py)
        self.spaces = SpaceMap(self)            # bundle -> space

    @property
    def allocated(self) -> int:
        return self.capacity - len(self.free_pages)

    @property
    def available(self) -> int:
        return len(self.free_pages) - self.reserved

    def pick_slots(self, n: int) -> list[int]:
        """The n slots a command will use: lowest free ones, then fresh ones."""
        if n == 1:  # a COW tail's slot: no array
            got = self.free_slots.lowest(1)
            return got or [self.n_slots]
        return self.pick_slot_array(n).tolist()

    def pick_slot_array(self, n: int) -> np.ndarray:
        """``pick_slots`` as an int64 array."""
        out = self.free_slots.lowest_array(n)
        if len(out) < n:
            out = np.concatenate([out, np.arange(self.n_slots, self.n_slots + n - len(out))])
        return out

    def pick_pages(self, n: int) -> list[int]:
        return self.free_pages.lowest(n)

    # --- array capacity (no state: only room for it) ------------------------------------------
    def ensure_slot(self, slot: int) -> None:
        if slot >= len(self.pg_live):
            self.pg_live = _grown(self.pg_live, slot + 1, 0)
            self._set_pg(_pg_matrix(len(self.pg_live), self.pg))
            self.free_slots.grow(len(self.pg_live))

    def __getstate__(self) -> dict[str, Any]:
        """A copy or pickle holds ``pg`` once and binds its rows again (``__setstate__``):
        copied one by one, each ``pg_*`` view would become an array apart from the matrix."""
        return {k: getattr(self, k) for k in self.__slots__ if k not in _PG_NAMES}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._set_pg(self.pg)

    def _set_pg(self, pg: np.ndarray) -> None:
        """``pg`` becomes the per-slot matrix; each ``pg_*`` attribute is a view of its row
        (the only place they are bound: a field and its row are one array)."""
        self.pg = pg
        for k, (name, _) in enumerate(PG_FIELDS):
            setattr(self, name, pg[k])

    def init_pages(self, slots: np.ndarray | list[int], devices: np.ndarray | list[int],
                   writers: np.ndarray | list[int] | int, active: bool) -> None:
        """Fresh pages in ``slots`` (apply only: the free lists are the caller's): one
        reference, nothing committed or protected, no pin, no host replica; generations are
        kept (a slot's generation advances when it is freed)."""
        slots = np.asarray(slots, I64)
        if not len(slots):
            return
        top = int(slots.max())
        self.ensure_slot(top)
        assert not (self.host_of and any(s in self.host_of for s in slots.tolist())), \
            f"{self.name}: a new page's slot still records a host replica"
        self.n_slots = max(self.n_slots, top + 1)
        self.pg_live[slots] = True
        self.pg_epoch[slots] = 0
        self.pg_committed[slots] = 0
        self.pg_protected[slots] = 0
        self.pg_refs[slots] = 1
        self.pg_active[slots] = 1 if active else 0
        self.pg_writer[slots] = writers
        self.pg_device[slots] = devices
        self.pg_pins[slots] = 0

    def ensure_members(self, n: int) -> None:
        """Room for ``n`` membership entries per space."""
        have = self.sp_members.shape[1]
        if n > have:
            cols = max(n, min(2 * have, self.logical_pages))
            grown = np.full((len(self.sp_members), cols), -1, np.int32)
            grown[:, :have] = self.sp_members
            self.sp_members = grown

    def alloc_space(self) -> int:
        """A free space index (lowest first); the arrays grow when none is left."""
        if not self.sp_free:
            old = len(self.sp_nmem)
            self.sp_members = _grown(self.sp_members, old + 1, -1)
            new = len(self.sp_members)
            for name, fill in (("sp_nmem", 0), ("sp_committed", 0), ("sp_protected", 0),
                               ("sp_entitlement", 0), ("sp_active", 0), ("sp_bundle", -1),
                               ("sp_budget", 0), ("sp_row", -1), ("sp_provisional", 0)):
                setattr(self, name, _grown(getattr(self, name), new, fill))
            self.sp_free = list(range(new - 1, old - 1, -1))
        return self.sp_free.pop()
