"""LogicalKVPage descriptors (spec §5.1).

A page is identified by ``(pool, slot, generation)``. The device page id is only where its
current device replica lives; identity, content epoch and physical id are independent (§14).
A slot is recycled — and its generation advanced — only when references, replicas and pins are
all zero (§5.3 last paragraph); a handle with an old generation then fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_PAGE = -1


class LogicalKVPage:
    """Mutable descriptor; only ``apply`` changes it."""

    __slots__ = ("slot", "gen", "epoch", "committed", "protected", "refs", "active_refs",
                 "writer", "device", "pins", "host")

    def __init__(self, slot: int, gen: int, device: int, writer: int, active: bool) -> None:
        self.slot = slot
        self.gen = gen
        self.epoch = 0
        self.committed = 0          # committed columns 0..P
        self.protected = 0          # columns covered by a published checkpoint
        self.refs = 1               # address-space references
        self.active_refs = 1 if active else 0
        self.writer = writer        # bundle id of the single writer, or NO_PAGE
        self.device = device        # device page-group lease, or NO_PAGE
        self.pins = 0               # transaction pins
        self.host: tuple[int, int, int, int] | None = None  # (offset, epoch, coverage, checksum)

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
