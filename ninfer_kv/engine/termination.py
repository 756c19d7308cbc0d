"""Ending what a sequence holds (spec §8.2, §8.3): trim trailing pages, move the committed
frontier back (truncate), finish (retain a checkpoint or release everything) and release a
checkpoint. Commands over a ``Txn``: validate everything, then emit (``apply`` mutates)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ninfer_kv.engine import checked
from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.args import as_bool, as_ints, duplicated, finish_reason, same_length
from ninfer_kv.engine.decode import lookup, why_not_writable
from ninfer_kv.engine.layout import P, ceil_div
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.errors import (
    FrontierError,
    InactiveSpace,
    InvalidArgument,
    UnknownHandle,
    WritePermissionError,
)
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


def check_private(p: PoolState, sp: KVAddressSpace, start: int) -> None:
    """Blocks ``start..`` of ``sp`` may be trimmed: live, one reference, no pin."""
    tail = sp.slots[start:]
    bad = ~p.pg_live[tail] | (p.pg_refs[tail] != 1) | (p.pg_pins[tail] != 0)
    if bad.any():
        raise WritePermissionError(why_not_writable(p, sp.bundle, start + int(bad.argmax())))


def trim(tx: Txn, p: PoolState, sp: KVAddressSpace) -> int:
    """Unmap the pages of active space ``sp`` above ceil(max(committed, provisional) / P)
    (§8.2); returns how many. Their leases go back to the space's reservation."""
    keep = ceil_div(max(sp.committed, sp.provisional), P)
    if keep >= sp.nmem:
        return 0
    check_private(p, sp, keep)
    n = sp.nmem - keep
    tx._emit(ev.Trim(sp.bundle, p.name, keep))
    tx._touch(p.name, sp.bundle, keep)
    checked.forget(tx, p.name, sp.bundle, keep * P)  # a page mapped again is unwritten
    return n


def truncate_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                  frontiers: Sequence[int] | np.ndarray) -> None:
    """Move the committed frontier of each active space back to its ``frontier`` (not below
    the protected frontier), then trim — every space or none: all are checked before any
    event (a caller undoing a batched forward never leaves its rows apart). The tail page
    keeps its first ``frontier % P`` columns and the writer rewrites the rest: it must be
    writable at that column (§9.4) — a page whose copy (D2H, COW) is still queued is pinned
    and refused, as commit refuses it; the pages dropped above must be private (``check_private``)."""
    b, fs = as_ints("seqs", bundles), as_ints("frontiers", frontiers)
    same_length(seqs=b, frontiers=fs)
    if len(set(b)) != len(b):
        raise InvalidArgument(f"seqs: {duplicated(np.array(b, dtype=object))} appear more than once in one "
                              "batched command")
    spaces = [lookup(p, x, active=True) for x in b]
    events: list[Any] = []
    trims: list[tuple[int, int]] = []
    for sp, frontier in zip(spaces, fs, strict=True):
        bundle = sp.bundle
        if not sp.protected <= frontier <= sp.committed:
            raise FrontierError(f"seq {bundle} pool {p.name}: truncate to {frontier} outside "
                                f"[protected={sp.protected}, committed={sp.committed}]")
        if frontier % P and frontier < sp.committed:
            # §9.4 on the tail page it rewrites: no pin (a queued D2H or COW copy reads it).
            # No other holder's coverage needs a check: a page shared with a checkpoint or
            # another sequence lies below the protected frontier, refused above. So the page
            # is this sequence's alone — its writer, or one a Move handed over whole with no
            # writer (§9.1), which Truncate's apply makes its writer (and asserts one ref).
            if p.pages[sp.members[frontier // P]].pins:  # type: ignore[union-attr]
                raise WritePermissionError(why_not_writable(p, bundle, frontier // P))
        keep = ceil_div(max(frontier, min(sp.provisional, frontier)), P)
        check_private(p, sp, keep)
        events.append(ev.Truncate(bundle, p.name, frontier))
        if keep < sp.nmem:
            events.append(ev.Trim(bundle, p.name, keep))
            trims.append((bundle, keep))
    tx._emit(*events)
    for bundle, keep in trims:  # after the events (as every command): unmapped at the boundary
        tx._touch(p.name, bundle, keep)
    for sp, frontier in zip(spaces, fs, strict=True):
        checked.forget(tx, p.name, sp.bundle, frontier)  # the tail must be written again


def finish(tx: Txn, bundle: int, retain: bool, reason: str) -> int | None:
    """Leave execution: every pool's space of active sequence ``bundle`` is trimmed to its
    committed frontier, then becomes an immutable checkpoint (``retain``; returns its id)
    or is released (§8.3)."""
    as_bool("finish: retain", retain)
    finish_reason(reason)  # journaled: refused now, not at the boundary
    b = tx.state.bundles.get(bundle)
    if b is None or not b.active:
        raise InactiveSpace(f"seq {bundle} is not an active sequence")
    events: list[Any] = []
    rows = []
    for pool in b.pools:
        sp = tx.state.pools[pool].spaces[bundle]
        rows.append((pool, sp.row))
        keep = ceil_div(sp.committed, P)
        if keep < sp.nmem:
            check_private(tx.state.pools[pool], sp, keep)
            if sp.provisional > sp.committed:  # the speculative lead ends with the trim
                events.append(ev.ProvisionalFrontiers(pool, pack([bundle]),
                                                      pack([sp.committed])))
            events.append(ev.Trim(bundle, pool, keep))
        events.append(ev.Finish(bundle, pool, retain, reason))
    pools = b.pools            # a finish that does not retain empties them
    tx._emit(*events)
    for pool, row in rows:
        tx._free_row(pool, row)
    for pool in pools:
        checked.forget(tx, pool, bundle)
    return bundle if retain else None


def release(tx: Txn, checkpoint: int) -> None:
    """Drop an inactive checkpoint's references; leases free with their last reference
    (§8.3). A page a queued copy still reads stays pinned until the boundary ran the copy."""
    b = tx.state.bundles.get(checkpoint)
    if b is None or b.active:
        raise UnknownHandle(f"{checkpoint} is not an inactive checkpoint")
    tx._emit(*(ev.Release(checkpoint, pool) for pool in b.pools))
