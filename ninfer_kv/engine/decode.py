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
from ninfer_kv.engine.args import (
    as_int_array,
    as_ints,
    duplicated,
    no_duplicates,
    same_length,
)
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import LogicalKVPage
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.errors import (
    EntitlementExceeded,
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
    pg = p.pages[p.spaces[bundle].member(block)]
    assert pg is not None
    return (f"seq {bundle} pool {p.name} block {block} (page {p.name}:{pg.slot}): writer="
            f"{pg.writer}, refs={pg.refs}, protected={pg.protected}, pins={pg.pins}, epoch="
            f"{pg.epoch}: only the single private writer may write (§9.4)")


def resolve_active(p: PoolState, bundles: np.ndarray) -> np.ndarray:
    """The space indices (``PoolState.sp_*``) of a batch of active sequences of ``p``; refuses
    (typed, naming the value) an unknown or inactive sequence. Array operations only, unless
    something is refused."""
    bi = p.bundle_index
    n = len(bi)
    inside = (bundles >= 0) & (bundles < n)
    idx = np.where(inside, bi[np.where(inside, bundles, 0)], -1)
    ok = idx >= 0
    ok[ok] = p.sp_active[idx[ok]]
    if not ok.all():
        lookup(p, int(bundles[np.argmin(ok)]), active=True)  # raises the precise error
        raise AssertionError("unreachable: lookup accepted a refused sequence")
    return idx


def batch_arrays(p: PoolState, bundles: Sequence[int] | np.ndarray, values: Sequence[int]
                 | np.ndarray, vname: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bundles, values, space indices) of a batched command over active sequences, no
    sequence twice."""
    b = as_int_array("seqs", bundles)
    v = as_int_array(vname, values)
    same_length(seqs=b, **{vname: v})
    dup = duplicated(b)
    if dup:
        raise InvalidArgument(f"seqs: {dup} appear more than once in one batched command")
    return b, v, resolve_active(p, b)


# --- 1. mapping (§8.1) ------------------------------------------------------------------------
def ensure_mapped_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                       tokens: Sequence[int] | np.ndarray) -> int:
    """``ensure_mapped_to_tokens`` for a batch: a lower bound. Returns the pages materialized.
    The batch is checked with array operations; only sequences that need pages (one in P
    rounds when decoding) are visited one by one."""
    b, t, idx = batch_arrays(p, bundles, tokens, "tokens")
    needed = (t + (P - 1)) // P
    have = p.sp_nmem[idx]
    grow = (needed > have) | (t < 0)
    if not grow.any():
        return 0
    need_b: list[int] = []
    need_n: list[int] = []
    limit = p.logical_pages
    for j in np.flatnonzero(grow).tolist():
        bj, tj, nj, hj = int(b[j]), int(t[j]), int(needed[j]), int(have[j])
        if tj < 0 or nj > limit:
            raise FrontierError(f"seq {bj} pool {p.name}: tokens={tj} outside [0, L*P="
                                f"{limit * P}]")
        ent = int(p.sp_entitlement[idx[j]])
        if nj > ent:
            raise EntitlementExceeded(
                f"seq {bj} pool {p.name} needs {nj} pages for {tj} tokens, entitlement is "
                f"{ent} (§8.1)")
        need_b.extend([bj] * (nj - hj))
        need_n.append(hj)
    slots = p.pick_slots(len(need_b))
    pages = p.pick_pages(len(need_b))
    tx._emit(ev.Materialize(p.name, pack(need_b), pack(slots), pack(pages)))
    prev = None
    i = 0
    for bj in need_b:
        if bj != prev:
            tx._touch(p.name, bj, need_n[i])  # publish from the first new block on
            i += 1
            prev = bj
    tx.stats["materialized"] += len(need_b)
    return len(need_b)


# --- 3. frontiers (§8.1, §8.2) ------------------------------------------------------------------
def commit_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                frontiers: Sequence[int] | np.ndarray) -> None:
    """Advance committed frontiers after the unit succeeded; one event for the batch.

    Checked with array operations: every frontier within [committed, membership], and §9.4
    write permission of the block the new columns land in when they stay in one block (the
    decode case); a sequence whose columns span several blocks (a prefill) is checked block
    by block."""
    b, f, idx = batch_arrays(p, bundles, frontiers, "frontiers")
    if not len(b):
        return
    old = p.sp_committed[idx]
    limit = p.sp_nmem[idx] * P
    bad = (f < old) | (f > limit)
    if bad.any():
        j = int(np.argmax(bad))
        raise FrontierError(
            f"seq {int(b[j])} pool {p.name}: commit frontier {int(f[j])} outside [committed="
            f"{int(old[j])}, membership={int(limit[j])}] (use truncate to move back)")
    lo = old // P
    span = (f + (P - 1)) // P - lo          # blocks the new columns land in
    one = span == 1
    if one.any():
        slot = p.sp_members[idx[one], lo[one]]
        ok = ((p.pg_writer[slot] == b[one]) & (p.pg_pins[slot] == 0)
              & (p.pg_protected[slot] <= old[one] - lo[one] * P))
        if not ok.all():
            j = int(np.flatnonzero(one)[np.argmin(ok)])
            raise WritePermissionError(why_not_writable(p, int(b[j]), int(lo[j])))
    for j in np.flatnonzero(span > 1).tolist():
        sp = p.spaces[int(b[j])]
        first_blk, oj = int(lo[j]), int(old[j])
        for blk in range(first_blk, first_blk + int(span[j])):
            first = oj - blk * P if blk == first_blk else 0  # first column written here
            if not writable(p.pages[sp.member(blk)], int(b[j]), first):  # type: ignore[arg-type]
                raise WritePermissionError(why_not_writable(p, int(b[j]), blk))
    if tx.config.checked and tx.config.allocate_planes:
        checked.check_commit(tx, p.name, b.tolist(), f.tolist())
    tx._emit(ev.CommitFrontiers(p.name, pack(b), pack(f)))


def set_provisional_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                         frontiers: Sequence[int] | np.ndarray) -> None:
    """Provisional frontiers (MTP / speculative lead, §8.2) within each membership."""
    bl, fl = batch(bundles, "seqs", frontiers, "frontiers")
    for b, f in zip(bl, fl, strict=True):
        sp = lookup(p, b, active=True)
        if not 0 <= f <= sp.nmem * P:
            raise FrontierError(f"seq {b} pool {p.name}: provisional frontier {f} outside "
                                f"[0, membership {sp.nmem * P}]")
    if bl:
        tx._emit(ev.ProvisionalFrontiers(p.name, pack(bl), pack(fl)))
