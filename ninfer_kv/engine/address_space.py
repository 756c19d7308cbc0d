"""KVAddressSpace and SequenceKVBundle (spec §6, §7.1).

An address space owns the logical order of its pages; the block table is only the execution
mirror of an active space's device mapping (§6.1). For an active space the reservation is
derived: ``reserved = entitlement - len(members)`` (entitlement counts membership pages,
shared or private, plus the pages still to be materialized).
"""

from __future__ import annotations

NO_ROW = -1


class KVAddressSpace:
    __slots__ = ("bundle", "pool", "members", "committed", "provisional", "protected", "active",
                 "entitlement", "row", "incoming")

    def __init__(self, bundle: int, pool: str, entitlement: int, row: int) -> None:
        self.bundle = bundle
        self.pool = pool
        self.members: list[int] = []   # logical block b -> page slot
        self.committed = 0             # canonical token frontier
        self.provisional = 0           # speculative frontier; never committed coverage
        self.protected = 0             # checkpoint-protected frontier
        self.active = True
        self.entitlement = entitlement  # pages guaranteed (membership + reservation)
        self.row = row                 # execution row, NO_ROW when inactive
        self.incoming = 0              # pages a Move/Fork of this record still hands over

    @property
    def reserved(self) -> int:
        """Entitled pages not yet in the membership and not promised by the source of a
        Move/Fork in flight (``incoming``, non-zero only inside one record)."""
        return self.entitlement - len(self.members) - self.incoming if self.active else 0

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
