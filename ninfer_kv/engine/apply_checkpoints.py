"""``apply``'s handlers for the events that end a sequence and make, continue or release an
inactive checkpoint (spec §7.3, §9): Finish, Release, Move, Fork, CopyTail, Share, Prefix.

Like every handler they are pure bookkeeping and only ``apply`` (engine/apply.py) calls them;
their asserts guard the replay of a foreign or damaged journal, and each refuses before it
changes anything. The page half (memberships read, references dropped, pages collected) is
engine/page_life.py.
"""

from __future__ import annotations

import struct

import numpy as np

from ninfer_kv.engine import apply_kernels as ak
from ninfer_kv.engine.address_space import NO_ROW, KVAddressSpace, SequenceKVBundle
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.page_life import (
    I64,
    drop_membership,
    members_of,
    new_members,
    retain_membership,
    unref,
)
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import MAX_BUNDLE, StoreState
from ninfer_kv.journal import events as ev


def _bundle(st: StoreState, bundle: int, what: str) -> SequenceKVBundle:
    """The bundle of a space an event names, looked up before the handler changes anything
    (a space without its bundle is a damaged state, §7.1)."""
    b = st.bundles.get(bundle)
    assert b is not None, f"{what}: seq {bundle} has a space but no bundle (§7.1)"
    return b


def finish(st: StoreState, e: ev.Finish) -> None:
    pool = st.pools[e.pool]
    sp = pool.spaces[e.bundle]
    bundle = _bundle(st, e.bundle, "Finish")
    assert pool.row_owner.get(sp.row) == e.bundle and sp.row not in pool.free_rows, \
        f"Finish of seq {e.bundle}: its row {sp.row} is not leased to it"
    if e.retain:  # each refuses a damaged membership before any change
        retain_membership(pool, sp, e.bundle, "Finish")  # protected only grows
    else:
        drop_membership(st, pool, sp, e.bundle, True, "Finish")
    pool.reserved -= sp.reserved          # unmaterialized entitlement -> global capacity
    del pool.row_owner[sp.row]
    pool.free_rows.add(sp.row)
    sp.row = NO_ROW
    sp.active = False
    sp.entitlement = 0
    bundle.active = False
    bundle.finish_reason = e.reason
    if e.retain:
        sp.protected = sp.committed
        sp.provisional = 0
    else:
        _drop_space(st, pool, e.bundle)


def _drop_space(st: StoreState, pool: PoolState, bundle: int) -> None:
    del pool.spaces[bundle]
    b = st.bundles[bundle]
    b.pools = tuple(p for p in b.pools if p != pool.name)
    if not b.pools:
        del st.bundles[bundle]


def release(st: StoreState, e: ev.Release) -> None:
    pool = st.pools[e.pool]
    assert not pool.spaces[e.bundle].active, f"Release of seq {e.bundle}: it is active (Finish)"
    _bundle(st, e.bundle, "Release")
    drop_membership(st, pool, pool.spaces[e.bundle], e.bundle, False, "Release")
    _drop_space(st, pool, e.bundle)


def move(st: StoreState, e: ev.Move) -> None:
    """§9.1: the destination takes the source's pages up to the frontier; no copy, identity
    kept. The source is private (every page has one reference) and does not survive, so no
    protected coverage remains; pages past the frontier are released."""
    pool = st.pools[e.pool]
    src, dst = pool.spaces[e.src], pool.spaces[e.dst]
    assert not src.active and 0 <= e.frontier <= src.committed and dst.nmem == 0 \
        and e.src != e.dst, f"Move of {e.src} to {e.dst} at {e.frontier}: not an inactive " \
        "source's committed prefix into another, empty destination"
    _bundle(st, e.src, "Move")
    _bundle(st, e.dst, "Move")
    keep = (e.frontier + P - 1) // P
    members = members_of(pool, src, "Move")
    kept = members[:keep]
    unref(st, pool, members[keep:], e.src, False)  # the pages past the frontier
    dst.members = kept
    pool.pg_active[kept] += 1
    pool.pg_protected[kept] = 0
    cols = np.minimum(P, e.frontier - P * np.arange(keep, dtype=I64))
    cut = kept[pool.pg_committed[kept] > cols]
    pool.pg_committed[cut] = cols[pool.pg_committed[kept] > cols]
    pool.pg_epoch[cut] += 1              # the canonical content of those columns may change
    pool.pg_writer[kept[cols < P]] = e.dst  # the single writer appends in the unprotected suffix
    src.members = []
    dst.committed = dst.provisional = e.frontier
    dst.protected = 0
    pool.reserved -= dst.nmem - dst.incoming
    dst.incoming = 0
    _drop_space(st, pool, e.src)
    st.bundles[e.dst].parent = e.src


def fork(st: StoreState, e: ev.Fork) -> None:
    """§9.2: the full pages before the frontier gain an immutable reference."""
    pool = st.pools[e.pool]
    src, dst = pool.spaces[e.src], pool.spaces[e.dst]
    _bundle(st, e.dst, "Fork")
    code = ak.fork_pages(src.i, dst.i, e.full_pages, pool.sp_active, pool.sp_committed,
                         pool.sp_provisional, pool.sp_protected, pool.sp_members, pool.sp_nmem,
                         pool.pg_live, pool.pg_refs, pool.pg_active)
    assert code != ak.FORK_ACTIVE_SOURCE, f"Fork of {e.src}: not an inactive checkpoint " \
        "(fork_live shares a live sequence's prefix first, §9.2)"
    assert code != ak.FORK_BAD_TARGET, \
        f"Fork of {e.src} into {e.dst}: a destination with pages, or past the committed frontier"
    assert code != ak.FORK_BAD_COUNT, \
        f"Fork of {e.src}: {e.full_pages} pages outside [0, its membership {src.nmem}]"
    assert code != ak.FORK_DEAD_PAGE, f"Fork of {e.src}: a dead page in its membership, a " \
        "slot outside the pool, a repeat, or a length past its row (§14)"
    pool.reserved -= e.full_pages - dst.incoming
    dst.incoming = 0
    st.bundles[e.dst].parent = e.src


def share(st: StoreState, e: ev.Share) -> None:
    """A running sequence's first ``full_pages`` pages become an inactive checkpoint's too:
    shared, so immutable (no writer, every column protected, §9.4); the sequence keeps its
    pages and appends above them, and may not truncate below them (its protected frontier)."""
    pool = st.pools[e.pool]
    src = pool.spaces[e.src]
    assert src.active and 0 <= e.full_pages * P <= src.committed, \
        f"Share of {e.src} in {e.pool}: {e.full_pages} pages"
    shared = members_of(pool, src, "Share")[:e.full_pages]
    _new_checkpoint(st, pool, e.dst, shared, "shared", f"Share of {e.src}")
    pool.pg_writer[shared] = NO_PAGE
    pool.pg_protected[shared] = P
    src.protected = max(src.protected, e.full_pages * P)


def prefix(st: StoreState, e: ev.Prefix) -> None:
    """An inactive checkpoint's first ``full_pages`` pages become a new inactive checkpoint's
    too. They are immutable already (no writer; full pages, every column committed)."""
    pool = st.pools[e.pool]
    src = pool.spaces[e.src]
    assert not src.active and 0 <= e.full_pages * P <= src.committed, \
        f"Prefix of {e.src} in {e.pool}: {e.full_pages} pages of an inactive checkpoint"
    _new_checkpoint(st, pool, e.dst, members_of(pool, src, "Prefix")[:e.full_pages], "prefix",
                    f"Prefix of {e.src}")


def _new_checkpoint(st: StoreState, pool: PoolState, dst_id: int, shared: np.ndarray,
                    reason: str, what: str) -> None:
    """Inactive checkpoint ``dst_id`` holds ``shared`` (whole pages) in ``pool``: a new bundle,
    or the one an earlier event of the same command made in another pool."""
    assert 0 <= dst_id <= min(st.next_bundle, MAX_BUNDLE), \
        f"{what} into {dst_id}: ids are handed out in order (the next is {st.next_bundle}), " \
        f"up to {MAX_BUNDLE} (int32 fields)"
    assert dst_id not in pool.spaces, f"{what} into {dst_id}: it has a space in {pool.name}"
    b = st.bundles.get(dst_id)
    assert b is None or (not b.active and b.finish_reason == reason), \
        f"{what} into {dst_id}: an existing bundle that is not this {reason} checkpoint"
    np.add.at(pool.pg_refs, shared, 1)
    dst = pool.spaces[dst_id] = KVAddressSpace(pool, dst_id, 0, NO_ROW)
    dst.active = False
    dst.members = shared
    dst.committed = dst.protected = len(shared) * P
    if b is None:
        b = st.bundles[dst_id] = SequenceKVBundle(dst_id, (pool.name,))
        b.finish_reason = reason  # no parent: nothing was continued (a prefix of its source,
        # which retention evicts leaves-first before its parents)
        b.budget = len(shared) * P
    else:
        b.pools = (*b.pools, pool.name)
    dst.budget = b.budget  # every space holds its bundle's budget, as Activate sets it
    if dst_id >= st.next_bundle:
        st.next_bundle = dst_id + 1


def copy_tail(st: StoreState, e: ev.CopyTail) -> None:
    """§9.3: a private destination page holding the source tail's first ``columns`` columns."""
    assert 0 < e.columns < P, f"CopyTail of {e.dst}: {e.columns} columns (a partial tail)"
    pool = st.pools[e.pool]
    dst = pool.spaces.get(e.dst)
    assert dst is not None and dst.active, f"CopyTail into {e.dst}: not an active space"
    s = e.src_slot  # the copy the boundary runs reads it: the event says what it reads
    assert 0 <= s < len(pool.pg_live) and pool.pg_live[s] and pool.pg_pins[s] > 0 \
        and pool.pg_device[s] == e.src_page and pool.pg_committed[s] >= e.columns, \
        f"CopyTail into {e.dst}: source slot {s} is not a live, pinned page on device page " \
        f"{e.src_page} holding {e.columns} committed columns (§9.3; the record pins it first)"
    new_members(pool, _int32(e.dst, "dst"), _int32(e.slot, "slot"), _int32(e.page, "page"),
                "CopyTail")
    pool.pg_committed[e.slot] = e.columns
    dst.committed = dst.provisional = (dst.nmem - 1) * P + e.columns


_I32 = struct.Struct("<i")


def _int32(v: int, what: str) -> bytes:
    """One event field packed as ``events.pack`` packs an array's (an int32, refused outside)."""
    assert -(1 << 31) <= v < (1 << 31), f"{what}={v} does not fit the journal's int32"
    return _I32.pack(v)
