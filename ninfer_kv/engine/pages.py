"""LogicalKVPage descriptors (spec §5.1).

A page is identified by ``(pool, slot, generation)``. The device page id is only where its
current device replica lives; identity, content epoch and physical id are independent (§14).
A slot is recycled — and its generation advanced — only when references, replicas and pins are
all zero (§5.3 last paragraph); a handle with an old generation then fails loudly.

Storage: every field lives in the pool's per-slot arrays (``PoolState.pg_*``, structure of
arrays; the host replica in ``pg_host_*``, read through ``PoolState.host_of``), so the decode
round, Materialize and the release of a membership work on whole batches of slots. A
``LogicalKVPage`` is the per-page view the cold paths use; ``PoolState.pages[slot]`` makes one
on demand (None for a free slot). Each field has exactly one home.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ``pool`` below is an engine.pool.PoolState; typed loosely because pool.py imports this module
# (the engine's import graph stays acyclic, tests/engine/test_import_graph.py)
PoolState = Any

NO_PAGE = -1

PG_ROWS = ("GEN", "EPOCH", "COMMITTED", "PROTECTED", "REFS", "ACTIVE", "WRITER", "DEVICE",
           "PINS", "HOST_OFF", "HOST_EPOCH", "HOST_COV", "HOST_CRC")
"""The rows of a pool's per-slot int64 matrix ``PoolState.pg`` (``pg[PG_WRITER, slot]`` is
page ``slot``'s writer; ``PoolState.pg_writer`` is that row): compiled loops take the one
matrix instead of an array per field."""
(PG_GEN, PG_EPOCH, PG_COMMITTED, PG_PROTECTED, PG_REFS, PG_ACTIVE, PG_WRITER, PG_DEVICE,
 PG_PINS, PG_HOST_OFF, PG_HOST_EPOCH, PG_HOST_COV, PG_HOST_CRC) = range(len(PG_ROWS))


class ArrayField:
    """A view's field stored in its pool's array ``array`` at the view's ``key`` attribute
    (the slot of a page), read as a Python int."""

    __slots__ = ("array", "key")

    def __init__(self, array: str, key: str) -> None:
        self.array, self.key = array, key

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj._p, self.array).item(getattr(obj, self.key))

    def __set__(self, obj: Any, value: Any) -> None:
        getattr(obj._p, self.array)[getattr(obj, self.key)] = value


class HostField:
    """A page's host replica ``(offset, epoch, coverage, checksum)`` or None, through its
    pool's ``host_of`` (``pool.HostMap`` over the ``pg_host_*`` arrays)."""

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        return obj._p.host_of.get(obj.slot)

    def __set__(self, obj: Any, value: tuple[int, int, int, int] | None) -> None:
        if value is None:
            obj._p.host_of.pop(obj.slot, None)
        else:
            obj._p.host_of[obj.slot] = value


class LogicalKVPage:
    """The view of one live slot of a pool (``PoolState.pages[slot]``); every field lives in
    the pool's per-slot arrays (``pg_*``), so a view is two references and any
    number of views of one slot agree. Only ``apply`` changes the fields."""

    __slots__ = ("_p", "slot")

    def __init__(self, pool: PoolState, slot: int) -> None:
        self._p = pool
        self.slot = slot

    gen = ArrayField("pg_gen", "slot")              # generation of the slot (§5.3)
    epoch = ArrayField("pg_epoch", "slot")          # content epoch: bumped when columns may change
    committed = ArrayField("pg_committed", "slot")  # committed columns 0..P
    protected = ArrayField("pg_protected", "slot")  # columns covered by a published checkpoint
    refs = ArrayField("pg_refs", "slot")            # address-space references
    active_refs = ArrayField("pg_active", "slot")   # ... of active address spaces
    writer = ArrayField("pg_writer", "slot")        # bundle id of the single writer, or NO_PAGE
    device = ArrayField("pg_device", "slot")        # device page-group lease, or NO_PAGE
    pins = ArrayField("pg_pins", "slot")            # transaction pins
    host = HostField()

    def as_tuple(self) -> tuple[int, ...]:
        h = self.host or (NO_PAGE, 0, 0, 0)
        return (self.slot, self.gen, self.epoch, self.committed, self.protected, self.refs,
                self.active_refs, self.writer, self.device, self.pins, *h)


@dataclass(frozen=True, slots=True)
class PageHandle:
    """A caller-held reference to a logical page; checked against the slot's generation."""

    pool: str
    slot: int
    gen: int

    def __str__(self) -> str:
        return f"{self.pool}:{self.slot}@{self.gen}"
