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
from ninfer_kv.engine import round_kernels as rk
from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.args import as_int_array, duplicated, same_length
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

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn

I64 = np.dtype(np.int64)


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


def writable(pg: LogicalKVPage, bundle: int, first_column: int) -> bool:
    """§9.4 write permission: ``bundle`` is the page's single writer, no pin holds it (no
    queued copy reads it) and no surviving checkpoint protects a column at or above
    ``first_column``. commit_many checks it for a whole batch in
    ``round_kernels.check_commit``; this is the oracle tests/engine/test_round_kernels.py
    holds the kernel to (truncate checks only the pin: termination.truncate_many says why)."""
    return pg.writer == bundle and pg.pins == 0 and pg.protected <= first_column


def why_not_writable(p: PoolState, bundle: int, block: int) -> str:
    slot = p.spaces[bundle].member(block)
    pg = p.pages[slot]
    if pg is None:
        return f"seq {bundle} pool {p.name} block {block}: slot {slot} holds no page (§9.4)"
    why = ""
    if pg.pins:  # the one cause a caller fixes by waiting: say so (§5.3)
        why = ("; it is pinned by a copy a command queued (a COW tail or a D2H offload "
               "reads it, an H2D restore writes it): the next boundary runs the copy and "
               "unpins it")
    return (f"seq {bundle} pool {p.name} block {block} (page {p.name}:{pg.slot}): writer="
            f"{pg.writer}, refs={pg.refs}, protected={pg.protected}, pins={pg.pins}, epoch="
            f"{pg.epoch}: only the single private writer may write (§9.4){why}")


def batch_arrays(bundles: Sequence[int] | np.ndarray, values: Sequence[int] | np.ndarray,
                 vname: str) -> tuple[np.ndarray, np.ndarray]:
    """(bundles, values) of a batched command as equal-length int64 arrays; the kernels of
    ``map_round`` / ``commit_round`` then resolve them (``refuse_resolve`` words a refusal)."""
    if (type(bundles) is np.ndarray and type(values) is np.ndarray and bundles.dtype is I64
            and values.dtype is I64 and bundles.ndim == values.ndim == 1
            and len(bundles) == len(values)):
        return bundles, values  # what an engine passes: what as_int_array would return
    b = as_int_array("seqs", bundles)
    v = as_int_array(vname, values)
    same_length(seqs=b, **{vname: v})
    return b, v


def refuse_resolve(p: PoolState, b: np.ndarray, code: int, j: int) -> None:
    """Raise the typed error for ``rk.resolve``'s refusal of ``b[j]``: a sequence twice in
    the batch, or one that is not an active sequence of ``p``."""
    dup = duplicated(b)
    if dup:
        raise InvalidArgument(f"seqs: {dup} appear more than once in one batched command")
    lookup(p, int(b[j]), active=True)  # raises the precise error
    raise AssertionError(f"unreachable: resolve refused seq {int(b[j])} (code {code})")


# --- 1. mapping (§8.1) ------------------------------------------------------------------------
def ensure_mapped_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                       tokens: Sequence[int] | np.ndarray) -> int:
    """``ensure_mapped_to_tokens`` for a batch: a lower bound. Returns the pages materialized.
    The batch is checked in one compiled pass (engine/round_kernels.py); only sequences that
    need pages (one in P rounds when decoding) are visited in Python."""
    b, t = batch_arrays(bundles, tokens, "tokens")
    fs, fp = p.free_slots, p.free_pages
    code, j, i, n, g, slot_lo, page_lo, out = rk.map_round(
        b, p.bundle_index, p.sp_active, t, p.sp_nmem, p.sp_entitlement, p.logical_pages,
        fs.bits, fs.lo, fs.n, p.n_slots, fp.bits, fp.lo, fp.n)
    if code in (rk.UNKNOWN, rk.DUPLICATE):
        refuse_resolve(p, b, code, j)
    if code != rk.OK:
        bj, tj, nj = int(b[j]), int(t[j]), (int(t[j]) + P - 1) // P
        if code == rk.FRONTIER:
            raise FrontierError(f"seq {bj} pool {p.name}: tokens={tj} outside [0, L*P="
                                f"{p.logical_pages * P}]")
        raise EntitlementExceeded(
            f"seq {bj} pool {p.name} needs {nj} pages for {tj} tokens, entitlement is "
            f"{int(p.sp_entitlement[i])} (§8.1)")
    if n == 0:
        return 0
    fs.lo, fp.lo = slot_lo, page_lo  # the scans' tighter lower bounds (a hint, not state)
    raw, w = out.tobytes(), 4 * n  # seqs, slots, page groups: as ``pack`` writes them (the
    # engine loads on little-endian machines only: native int32 is the journal's)
    tx._emit(ev.Materialize(p.name, raw[:w], raw[w:2 * w], raw[2 * w:3 * w]))
    tail = out[3 * n:].tolist()  # the g grown sequences, then their first new blocks
    if g == 1:  # one prompt mapped (activation)
        tx._touch(p.name, tail[0], tail[1])
    else:  # publish from each one's first new block on
        tx._touch_many(p.name, tail[:g], tail[g:])
    tx.stats["materialized"] += n
    return n


# --- 3. frontiers (§8.1, §8.2) ------------------------------------------------------------------
def commit_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                frontiers: Sequence[int] | np.ndarray) -> None:
    """Advance committed frontiers after the unit succeeded; one event for the batch.

    Checked in one compiled pass (engine/round_kernels.py): every frontier within
    [committed, membership], and §9.4 write permission of every block the new columns land
    in (one block when decoding, several after a prefill)."""
    b, f = batch_arrays(bundles, frontiers, "frontiers")
    if not len(b):
        return
    code, j, blk, i, out = rk.commit_round(b, p.bundle_index, p.sp_active, f, p.sp_committed,
                                           p.sp_nmem, p.sp_members, p.pg, tx.plan.S)
    if code in (rk.UNKNOWN, rk.DUPLICATE):
        refuse_resolve(p, b, code, j)
    if code == rk.CEILING:
        raise FrontierError(f"seq {int(b[j])} pool {p.name}: commit frontier {int(f[j])} above "
                            f"the logical ceiling S={tx.plan.S} (§3.2: page rounding adds no "
                            "tokens)")
    if code == rk.FRONTIER:
        old, limit = int(p.sp_committed[i]), int(p.sp_nmem[i]) * P
        raise FrontierError(
            f"seq {int(b[j])} pool {p.name}: commit frontier {int(f[j])} outside [committed="
            f"{old}, membership={limit}] (use truncate to move back)")
    if code != rk.OK:
        raise WritePermissionError(why_not_writable(p, int(b[j]), blk))
    unwritten = tx._unwritten.get(p.name)
    if unwritten:  # empty in a decode round: a unit ran since its pages were mapped
        refuse_unwritten(p, b, f, unwritten)
    watch = tx.config.checked and tx.config.allocate_planes
    if watch:
        checked.check_commit(tx, p.name, b.tolist(), f.tolist())
    raw, w = out.tobytes(), 4 * len(b)  # seqs, frontiers: as ``pack`` writes them
    tx._emit(ev.CommitFrontiers(p.name, raw[:w], raw[w:]))
    if watch:  # after the event: a commit interrupted before it still finds the writes
        checked.forget_committed(tx, p.name, b.tolist(), f.tolist())


def refuse_unwritten(p: PoolState, b: np.ndarray, f: np.ndarray,
                     unwritten: dict[int, int]) -> None:
    """§8.1: a commit follows the GPU unit that wrote its columns, and a unit writes only
    through a table published at a boundary. ``unwritten`` maps a sequence to the first block
    of its row that changed since the last unit ran (a boundary froze the store, then
    ``unit_complete``; a page mapped, a row leased, a Fork): no unit can have written there.
    Committing such columns would publish whatever the page group held before — another
    request's KV, once it is recycled — as this sequence's (checked stores see it by write
    tracking; this holds whatever ``checked`` is). Visits the batch elements ``unwritten``
    names, not the whole batch."""
    if len(unwritten) <= 8:  # an engine admitting a few requests between unit and commit
        hits = [(int(j), blk) for bundle, blk in unwritten.items()
                for j in np.flatnonzero(b == bundle)]
    else:
        hits = [(j, unwritten[x]) for j, x in enumerate(b.tolist()) if x in unwritten]
    for j, blk in sorted(hits):
        bundle, new = int(b[j]), int(f[j])
        if new > p.spaces[bundle].committed and new > blk * P:
            raise WritePermissionError(
                f"seq {bundle} pool {p.name}: commit to {new} writes block {(new - 1) // P}, "
                f"but its table row changed from block {blk} on since the last boundary "
                "(pages mapped, a row leased, a Fork): no GPU unit can have written there "
                "yet (§8.1: close the boundary, run the unit, then commit)")


def set_provisional_many(tx: Txn, p: PoolState, bundles: Sequence[int] | np.ndarray,
                         frontiers: Sequence[int] | np.ndarray) -> None:
    """Provisional frontiers (MTP / speculative lead, §8.2) within each membership; checked
    in one compiled pass (``round_kernels.provisional_round``), one event for the batch."""
    b, f = batch_arrays(bundles, frontiers, "frontiers")
    if not len(b):
        return
    code, j, i, out = rk.provisional_round(b, p.bundle_index, p.sp_active, f, p.sp_nmem)
    if code in (rk.UNKNOWN, rk.DUPLICATE):
        refuse_resolve(p, b, code, j)
    if code != rk.OK:
        raise FrontierError(f"seq {int(b[j])} pool {p.name}: provisional frontier {int(f[j])} "
                            f"outside [0, membership {int(p.sp_nmem[i]) * P}]")
    raw, w = out.tobytes(), 4 * len(b)  # seqs, frontiers: as ``pack`` writes them
    tx._emit(ev.ProvisionalFrontiers(p.name, raw[:w], raw[w:]))
