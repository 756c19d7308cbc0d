"""One decode round, in the order an engine calls it (spec §8.1, §8.2, §8.4, §9.4):

1. ``ensure_mapped_many(pool, seqs, tokens)`` — before launch: materialize the pages each
   sequence needs for ``tokens`` (within its entitlement), one ``Materialize`` event;
2. ``boundary()`` — ``StoreCore._publish_record`` (engine/core.py): the queued events become
   one journal record, then device copies run and only the table entries that changed are
   published (``DeviceState.write_table``); tables and frontiers freeze until the unit is
   complete;
3. ``commit_many(pool, seqs, frontiers)`` — after the unit succeeded: advance committed
   frontiers, one ``CommitFrontiers`` event, after checking write permission (§9.4) of every
   block the new columns land in.

Each function validates the whole batch and raises a typed ``KVStoreError`` before emitting
anything (then the state is unchanged); ``apply`` (through ``Txn._emit``) is the only mutator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ninfer_kv.engine import checked
from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.args import as_ints, no_duplicates, same_length
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import LogicalKVPage
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.errors import (
    EntitlementExceeded,
    FrontierError,
    InactiveSpace,
    UnknownHandle,
    WritePermissionError,
)
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import pack

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


def lookup(p: PoolState, bundle: int, *, active: bool = False) -> KVAddressSpace:
    """The address space of ``bundle`` in ``p``; with ``active`` it must be an active
    sequence's (not an inactive checkpoint's)."""
    sp = p.spaces.get(bundle)
    if sp is None:
        raise UnknownHandle(f"seq {bundle} has no address space in pool {p.name}")
    if active and not sp.active:
        raise InactiveSpace(f"seq {bundle} in pool {p.name} is an inactive checkpoint; "
                            "only an active address space can map or commit")
    return sp


def batch(bundles: Sequence[int] | np.ndarray, bname: str, values: Sequence[int] | np.ndarray,
          vname: str) -> tuple[list[int], list[int]]:
    """Normalized batched arguments: plain ints, equal lengths, no duplicate sequence."""
    bl, vl = as_ints(bname, bundles), as_ints(vname, values)
    same_length(**{bname: bl, vname: vl})
    no_duplicates(bname, bl)
    return bl, vl


def writable(pg: LogicalKVPage, bundle: int, first_column: int) -> bool:
    """§9.4 write permission, the one rule commit and truncate share: ``bundle`` is the
    page's single writer, no pin holds it (no queued copy reads it) and no surviving
    checkpoint protects a column at or above ``first_column``."""
    return pg.writer == bundle and pg.pins == 0 and pg.protected <= first_column


def why_not_writable(p: PoolState, bundle: int, block: int) -> str:
    pg = p.pages[p.spaces[bundle].members[block]]
    assert pg is not None
    return (f"seq {bundle} pool {p.name} block {block} (page {p.name}:{pg.slot}): writer="
            f"{pg.writer}, refs={pg.refs}, protected={pg.protected}, pins={pg.pins}, epoch="
            f"{pg.epoch}: only the single private writer may write (§9.4)")


# --- 1. mapping (§8.1) ------------------------------------------------------------------------
def ensure_mapped_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                       tokens: Sequence[int] | np.ndarray) -> int:
    """``ensure_mapped_to_tokens`` for a batch: a lower bound. Returns the pages materialized."""
    spaces = p.spaces
    need_b: list[int] = []
    need_n: list[int] = []
    bl, tl = batch(bundles, "seqs", tokens, "tokens")
    limit = p.logical_pages
    for b, t in zip(bl, tl, strict=True):
        sp = spaces.get(b)
        if sp is None or not sp.active:
            lookup(p, b, active=True)  # raises the precise error
        needed = (t + P - 1) // P
        have = len(sp.members)  # type: ignore[union-attr]
        if needed <= have and t >= 0:
            continue
        if t < 0 or needed > limit:
            raise FrontierError(f"seq {b} pool {p.name}: tokens={t} outside [0, L*P="
                                f"{limit * P}]")
        if needed > sp.entitlement:  # type: ignore[union-attr]
            raise EntitlementExceeded(
                f"seq {b} pool {p.name} needs {needed} pages for {t} tokens, entitlement is "
                f"{sp.entitlement} (§8.1)")  # type: ignore[union-attr]
        need_b.extend([b] * (needed - have))
        need_n.append(have)
    if not need_b:
        return 0
    slots = p.pick_slots(len(need_b))
    pages = p.pick_pages(len(need_b))
    tx._emit(ev.Materialize(p.name, pack(need_b), pack(slots), pack(pages)))
    prev = None
    i = 0
    for b in need_b:
        if b != prev:
            tx._touch(p.name, b, need_n[i])  # publish from the first new block on
            i += 1
            prev = b
    tx.stats["materialized"] += len(need_b)
    return len(need_b)


# --- 3. frontiers (§8.1, §8.2) ------------------------------------------------------------------
def commit_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                frontiers: Sequence[int] | np.ndarray) -> None:
    """Advance committed frontiers after the unit succeeded; one event for the batch."""
    spaces, pages = p.spaces, p.pages
    bl, fl = batch(bundles, "seqs", frontiers, "frontiers")
    if not bl:
        return
    for b, f in zip(bl, fl, strict=True):
        sp = spaces.get(b)
        if sp is None or not sp.active:
            lookup(p, b, active=True)
        members = sp.members  # type: ignore[union-attr]
        old = sp.committed  # type: ignore[union-attr]
        if f < old or f > len(members) * P:
            raise FrontierError(
                f"seq {b} pool {p.name}: commit frontier {f} outside [committed={old}, "
                f"membership={len(members) * P}] (use truncate to move back)")
        # write permission (§9.4) of every block the new columns land in; a decode step
        # touches one block, so that case is checked without a loop
        lo, hi = old // P, (f + P - 1) // P
        if hi - lo == 1:
            if not writable(pages[members[lo]], b, old - lo * P):  # type: ignore[arg-type]
                raise WritePermissionError(why_not_writable(p, b, lo))
        else:
            for blk in range(lo, hi):
                first = old - blk * P if blk == lo else 0  # first column written here
                if not writable(pages[members[blk]], b, first):  # type: ignore[arg-type]
                    raise WritePermissionError(why_not_writable(p, b, blk))
    if tx.config.checked and tx.config.allocate_planes:
        checked.check_commit(tx, p.name, bl, fl)
    tx._emit(ev.CommitFrontiers(p.name, pack(bl), pack(fl)))


def set_provisional_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                         frontiers: Sequence[int] | np.ndarray) -> None:
    """Provisional frontiers (MTP / speculative lead, §8.2) within each membership."""
    bl, fl = batch(bundles, "seqs", frontiers, "frontiers")
    for b, f in zip(bl, fl, strict=True):
        sp = lookup(p, b, active=True)
        if not 0 <= f <= len(sp.members) * P:
            raise FrontierError(f"seq {b} pool {p.name}: provisional frontier {f} outside "
                                f"[0, membership {len(sp.members) * P}]")
    if bl:
        tx._emit(ev.ProvisionalFrontiers(p.name, pack(bl), pack(fl)))
