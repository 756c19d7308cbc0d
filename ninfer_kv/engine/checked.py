"""Checked mode (``StoreConfig(checked=True)``): the kernel wrappers ask, on the host, whether
every position they are about to write belongs to its writer (spec §9.4, §12.4).

The caller guarantees of §12.4 become checks: a written position must lie in a leased table
row's membership, at or above that sequence's committed frontier (committed tokens are
canonical and never rewritten in place — truncate first), in a page whose single writer is
that sequence, that no pin holds and that no surviving checkpoint protects at that column.
It walks every written position in Python, so it is for tests, the demo and debugging.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ninfer_kv.engine.layout import P
from ninfer_kv.errors import InvalidArgument, WritePermissionError

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


class WriteGuard:
    """The guard of one (pool, layer) view. Every position it lets through is recorded in
    ``store._written[(pool, seq, layer)]`` so that a checked ``commit`` can require every
    committed token to have been written in every layer (``check_commit``)."""

    __slots__ = ("_store", "_pool", "_layer")

    def __init__(self, store: Txn, pool: str, layer: int) -> None:
        self._store = store
        self._pool = pool
        self._layer = layer

    def __call__(self, table_rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Check every write and record it as written (a caller that writes by itself)."""
        self.check(table_rows, positions)()

    def check(self, table_rows: torch.Tensor, positions: torch.Tensor) -> Callable[[], None]:
        """Check every write; returns what records them, for a kernel wrapper to call once
        its kernel ran (a write that failed before it — a bad conversion, an interrupt — is
        no write: recording it first let a checked commit accept tokens never written)."""
        p = self._store.state.pools[self._pool]
        rows = table_rows.tolist()
        pos = positions.tolist()
        if len(rows) != len(pos):
            raise InvalidArgument(f"checked write: {len(rows)} table_rows, {len(pos)} positions")
        for r, x in zip(rows, pos, strict=True):
            b = p.row_owner.get(r)
            if b is None:
                raise WritePermissionError(f"checked write: pool {p.name} table row {r} is not "
                                           "leased to an active sequence (§7.2)")
            sp = p.spaces[b]
            if x < sp.committed:
                raise WritePermissionError(
                    f"checked write: seq {b} pool {p.name} position {x} is below its committed "
                    f"frontier {sp.committed}; committed tokens are not rewritten (§8.1)")
            blk = x // P
            if blk >= sp.nmem:
                raise WritePermissionError(
                    f"checked write: seq {b} pool {p.name} position {x} is not mapped "
                    f"(membership {sp.nmem * P} tokens; ensure_mapped first, §8.1)")
            if b in self._store._touched.get(self._pool, ()):
                raise WritePermissionError(
                    f"checked write: seq {b} pool {p.name}: its table row has changes not yet "
                    "published; a kernel would write through the old entries (boundary first, "
                    "§8.4)")
            pg = p.pages[sp.member(blk)]
            assert pg is not None
            published = int(self._store.device.pools[self._pool].block_tables[r, blk])
            if published != pg.device:
                raise WritePermissionError(
                    f"checked write: seq {b} pool {p.name} position {x}: the published table "
                    f"maps page group {published}, its page {p.name}:{pg.slot} lives in "
                    f"{pg.device} (§12.4)")
            if pg.writer != b or pg.pins or pg.protected > x % P:
                raise WritePermissionError(
                    f"checked write: seq {b} pool {p.name} position {x} lands in page "
                    f"{p.name}:{pg.slot} (writer={pg.writer}, pins={pg.pins}, protected="
                    f"{pg.protected}): only its single unpinned writer may write (§9.4)")
        owners = [p.row_owner[r] for r in rows]

        def record() -> None:  # every write was allowed, and ran
            written = self._store._written
            for b, x in zip(owners, pos, strict=True):
                written.setdefault((self._pool, b, self._layer), set()).add(x)
        return record


def check_commit(store: Txn, pool: str, bundles: list[int], frontiers: list[int]) -> None:
    """Checked mode: a commit may only cover tokens its sequence wrote, in every layer of the
    pool, through a guarded view (``commit`` otherwise trusts the caller, §8.1). Forgets what
    the commit covers."""
    p = store.state.pools[pool]
    layers = store.device.pools[pool].geometry.layers
    written = store._written
    for b, f in zip(bundles, frontiers, strict=True):
        old = p.spaces[b].committed
        for layer in range(layers):
            have = written.get((pool, b, layer), set())
            missing = [x for x in range(old, f) if x not in have]
            if missing:
                raise WritePermissionError(
                    f"checked commit: seq {b} pool {pool} commits [{old}, {f}) but layer "
                    f"{layer} never wrote {len(missing)} of those tokens (first: {missing[0]}); "
                    "append_kv every layer before commit (§8.1)")


def forget_committed(store: Txn, pool: str, bundles: list[int], frontiers: list[int]) -> None:
    """Writes below a committed frontier are settled: no later commit asks about them."""
    written = store._written
    for b, f in zip(bundles, frontiers, strict=True):
        for layer in range(store.device.pools[pool].geometry.layers):
            have = written.get((pool, b, layer))
            if have:
                have.difference_update([x for x in have if x < f])


def forget(store: Txn, pool: str, bundle: int, frontier: int = 0) -> None:
    """Writes at or above ``frontier`` no longer count (truncate, trim, finish)."""
    for key in [k for k in store._written if k[0] == pool and k[1] == bundle]:
        if frontier:
            store._written[key].difference_update(
                [x for x in store._written[key] if x >= frontier])
        else:
            del store._written[key]
