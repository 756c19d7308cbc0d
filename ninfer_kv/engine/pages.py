"""LogicalKVPage descriptors (spec §5.1).

A page is identified by ``(pool, slot, generation)``. The device page id is only where its
current device replica lives; identity, content epoch and physical id are independent (§14).
A slot is recycled — and its generation advanced — only when references, replicas and pins are
all zero (§5.3 last paragraph); a handle with an old generation then fails loudly.

Storage: the fields the decode round reads for every sequence (committed and protected
columns, writer, pins, device id) live in the pool's per-slot arrays (``PoolState.pg_*``,
structure of arrays), so ``commit_many`` checks a whole batch with array operations. A
``LogicalKVPage`` is the per-page view the cold paths use: its properties read and write those
arrays; the remaining fields are plain attributes. Each field has exactly one home.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# ``pool`` below is an engine.pool.PoolState; typed loosely because pool.py imports this module
# (the engine's import graph stays acyclic, tests/engine/test_import_graph.py)
PoolState = Any

NO_PAGE = -1


class ArrayField:
    """A view's field stored in its pool's array ``array`` at the view's ``key`` attribute
    (the slot of a page, the index of a space); read as ``conv`` (int or bool)."""

    __slots__ = ("array", "key", "conv")

    def __init__(self, array: str, key: str, conv: type = int) -> None:
        self.array, self.key, self.conv = array, key, conv

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        return self.conv(getattr(obj._p, self.array)[getattr(obj, self.key)])

    def __set__(self, obj: Any, value: Any) -> None:
        getattr(obj._p, self.array)[getattr(obj, self.key)] = value


class LogicalKVPage:
    """Mutable descriptor; only ``apply`` changes it."""

    __slots__ = ("_p", "slot", "gen", "epoch", "refs", "active_refs", "host")

    def __init__(self, pool: PoolState, slot: int, gen: int, device: int, writer: int,
                 active: bool) -> None:
        pool.ensure_slot(slot)
        pool.pg_committed[slot] = 0     # committed columns 0..P
        pool.pg_protected[slot] = 0     # columns covered by a published checkpoint
        pool.pg_writer[slot] = writer   # bundle id of the single writer, or NO_PAGE
        pool.pg_device[slot] = device   # device page-group lease, or NO_PAGE
        pool.pg_pins[slot] = 0          # transaction pins
        self._plain(pool, slot, gen, active)

    @classmethod
    def adopt(cls, pool: PoolState, slot: int, gen: int, active: bool) -> LogicalKVPage:
        """The view of a new page whose array fields the caller already set (a batch of
        pages written with one array assignment per field, apply's Materialize)."""
        page = cls.__new__(cls)
        page._plain(pool, slot, gen, active)
        return page

    def _plain(self, pool: PoolState, slot: int, gen: int, active: bool) -> None:
        self._p = pool
        self.slot = slot
        self.gen = gen
        self.epoch = 0
        self.refs = 1               # address-space references
        self.active_refs = 1 if active else 0
        self.host: tuple[int, int, int, int] | None = None  # (offset, epoch, coverage, checksum)

    committed = ArrayField("pg_committed", "slot")
    protected = ArrayField("pg_protected", "slot")
    writer = ArrayField("pg_writer", "slot")
    device = ArrayField("pg_device", "slot")
    pins = ArrayField("pg_pins", "slot")

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
