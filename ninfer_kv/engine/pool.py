"""One typed pool's logical state: page-group ids, reservations, rows, page slots (spec §5.2).

Invariant kept by ``apply`` and checked by ``check_invariants``::

    allocated + reserved + available == capacity

where ``allocated`` = device leases held by logical pages, ``reserved`` = sum over active
address spaces of (entitlement - membership), ``available`` = the rest. Reservations are page
*counts*, not ids: any free id can satisfy any reservation, so ``free_pages`` (ids without a
lease) holds exactly ``reserved + available`` ids. The command picks the lowest free ids
(locality), and nothing depends on contiguity (§4.2).
"""

from __future__ import annotations

from sortedcontainers import SortedList

from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.pages import LogicalKVPage


class PoolState:
    __slots__ = ("name", "capacity", "rows", "logical_pages", "free_pages", "reserved",
                 "free_rows", "row_owner", "pages", "gens", "free_slots", "spaces")

    def __init__(self, name: str, capacity: int, rows: int, logical_pages: int) -> None:
        self.name = name
        self.capacity = capacity
        self.rows = rows                        # C: block-table rows
        self.logical_pages = logical_pages      # L: columns of a block-table row
        self.free_pages = SortedList(range(capacity))
        self.reserved = 0
        self.free_rows = SortedList(range(rows))
        self.row_owner: dict[int, int] = {}     # row -> bundle
        self.pages: list[LogicalKVPage | None] = []  # by slot
        self.gens: list[int] = []               # generation of each slot
        self.free_slots = SortedList()
        self.spaces: dict[int, KVAddressSpace] = {}  # bundle -> space

    @property
    def allocated(self) -> int:
        return self.capacity - len(self.free_pages)

    @property
    def available(self) -> int:
        return len(self.free_pages) - self.reserved

    def pick_slots(self, n: int) -> list[int]:
        """The n slots a command will use: lowest free ones, then fresh ones."""
        out = list(self.free_slots[:n])
        nxt = len(self.pages)
        while len(out) < n:
            out.append(nxt)
            nxt += 1
        return out

    def pick_pages(self, n: int) -> list[int]:
        return list(self.free_pages[:n])
