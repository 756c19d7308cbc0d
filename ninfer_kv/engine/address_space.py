"""KVAddressSpace and SequenceKVBundle (spec §6, §7.1).

An address space owns the logical order of its pages; the block table is only the execution
mirror of an active space's device mapping (§6.1). For an active space the reservation is
derived: ``reserved = entitlement - len(members)`` (entitlement counts membership pages,
shared or private, plus the pages still to be materialized).

Storage: a space has a dense index ``i`` into its pool's per-space arrays (``PoolState.sp_*``),
which hold the fields the decode round reads for every sequence — membership (slot ids, one
row of ``sp_members`` with ``sp_nmem`` valid entries), committed and provisional frontiers,
entitlement, active flag, execution row — so a batch of C sequences is validated and applied
with array operations, and a boundary publishes its block-table rows in one compiled pass.
The object is the view the cold paths use; the other fields are plain attributes. ``PoolState.spaces``
(bundle -> space) and ``PoolState.bundle_table`` (the same map as a hash table for compiled
loops) are one structure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

# ``p`` below is an engine.pool.PoolState; typed loosely because pool.py imports this module
# (the engine's import graph stays acyclic, tests/engine/test_import_graph.py)
PoolState = Any

NO_ROW = -1


class KVAddressSpace:
    __slots__ = ("_p", "i", "bundle", "pool", "incoming")

    def __init__(self, p: PoolState, bundle: int, entitlement: int, row: int,
                 budget: int = 0, incoming: int = 0) -> None:
        self._p = p
        self.i = i = p.alloc_space()
        self.bundle = bundle
        self.pool = p.name
        p.sp_nmem[i] = 0               # membership: logical block b -> page slot
        p.sp_committed[i] = 0          # canonical token frontier
        p.sp_protected[i] = 0          # checkpoint-protected frontier
        p.sp_budget[i] = budget        # its bundle's budget (Activate's; grow reads it)
        p.sp_entitlement[i] = entitlement  # pages guaranteed (membership + reservation)
        p.sp_active[i] = True
        p.sp_provisional[i] = 0        # speculative frontier; never committed coverage
        p.sp_row[i] = row              # execution row, NO_ROW when inactive
        self.incoming = incoming       # pages a Move/Fork of this record still hands over

    # --- array-backed fields --------------------------------------------------------------
    @property
    def members(self) -> list[int]:
        """A copy of the membership (slot ids by logical block); change it by assignment,
        ``append_member`` or ``trim_members`` (apply only)."""
        return self._p.sp_members[self.i, :self._p.sp_nmem[self.i]].tolist()

    @members.setter
    def members(self, slots: Iterable[int]) -> None:
        if not isinstance(slots, np.ndarray):
            slots = list(slots)
        p = self._p
        p.ensure_members(len(slots))
        p.sp_members[self.i, :len(slots)] = slots
        p.sp_nmem[self.i] = len(slots)

    @property
    def slots(self) -> np.ndarray:
        """The membership as an int32 array view of the pool's ``sp_members`` row, without
        the copy (read only: change it through ``members`` / ``append_member``)."""
        v = self._p.sp_members[self.i, :self._p.sp_nmem[self.i]]
        v.flags.writeable = False
        return v

    @property
    def nmem(self) -> int:
        """``len(members)`` without the copy."""
        return self._p.sp_nmem.item(self.i)

    def member(self, block: int) -> int:
        """``members[block]`` without the copy (``0 <= block < nmem``)."""
        assert 0 <= block < self._p.sp_nmem[self.i], (self.bundle, block)
        return int(self._p.sp_members[self.i, block])

    def append_member(self, slot: int) -> None:
        p, n = self._p, int(self._p.sp_nmem[self.i])
        p.ensure_members(n + 1)
        p.sp_members[self.i, n] = slot
        p.sp_nmem[self.i] = n + 1

    def trim_members(self, keep: int) -> list[int]:
        """Cut the membership to its first ``keep`` blocks; returns the slots cut off."""
        p, n = self._p, int(self._p.sp_nmem[self.i])
        dropped = p.sp_members[self.i, keep:n].tolist()
        p.sp_nmem[self.i] = min(n, keep)
        return dropped

    # The array-backed fields, written out: the apply handlers read them on every event, and a
    # plain property reading ``.item`` (a Python int or bool) costs half of a generic descriptor.
    @property
    def committed(self) -> int:
        return self._p.sp_committed.item(self.i)

    @committed.setter
    def committed(self, value: int) -> None:
        self._p.sp_committed[self.i] = value

    @property
    def protected(self) -> int:
        return self._p.sp_protected.item(self.i)

    @protected.setter
    def protected(self, value: int) -> None:
        self._p.sp_protected[self.i] = value

    @property
    def budget(self) -> int:
        return self._p.sp_budget.item(self.i)

    @budget.setter
    def budget(self, value: int) -> None:
        self._p.sp_budget[self.i] = value

    @property
    def entitlement(self) -> int:
        return self._p.sp_entitlement.item(self.i)

    @entitlement.setter
    def entitlement(self, value: int) -> None:
        self._p.sp_entitlement[self.i] = value

    @property
    def active(self) -> bool:
        return self._p.sp_active.item(self.i)

    @active.setter
    def active(self, value: bool) -> None:
        self._p.sp_active[self.i] = value

    @property
    def row(self) -> int:
        return self._p.sp_row.item(self.i)

    @row.setter
    def row(self, value: int) -> None:
        self._p.sp_row[self.i] = value

    @property
    def provisional(self) -> int:
        return self._p.sp_provisional.item(self.i)

    @provisional.setter
    def provisional(self, value: int) -> None:
        self._p.sp_provisional[self.i] = value

    @property
    def reserved(self) -> int:
        """Entitled pages not yet in the membership and not promised by the source of a
        Move/Fork in flight (``incoming``, non-zero only inside one record)."""
        p, i = self._p, self.i
        if not p.sp_active.item(i):
            return 0
        return p.sp_entitlement.item(i) - p.sp_nmem.item(i) - self.incoming

    def as_tuple(self) -> tuple:
        return (self.bundle, self.committed, self.provisional, self.protected, self.active,
                self.entitlement, self.row, tuple(self.members), self.incoming)


class SequenceKVBundle:
    """Main space + the selected backend space, activated and finished together (§7.1)."""

    __slots__ = ("id", "active", "pools", "finish_reason", "parent", "budget", "meta")

    def __init__(self, bundle_id: int, pools: tuple[str, ...]) -> None:
        self.id = bundle_id
        self.active = False       # published Active (§7.3 last step)
        self.pools = pools        # pools that still hold a space of this bundle
        self.finish_reason = ""
        self.parent = -1          # checkpoint it was continued from, if any
        self.budget = 0           # prompt + output budget in tokens
        self.meta = b""           # the engine's metadata (msgpack bytes, SetMetadata)

    def as_tuple(self) -> tuple:
        t = (self.id, self.active, self.pools, self.finish_reason, self.parent, self.budget)
        return (*t, self.meta) if self.meta else t  # no metadata: the digest of schema <= 1.4
