"""``apply(state, event)``: the only code that mutates a ``StoreState``.

It is pure bookkeeping and never chooses: every page id, slot and row is in the event. The
commands in ``store.py`` validate everything before they emit, so an event that reaches here is
valid; the asserts below guard the replay of a foreign or damaged journal, not normal use.
Replay (``ninfer_kv.replay``) calls this function unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ninfer_kv.engine import apply_host as ah
from ninfer_kv.engine import apply_kernels as ak
from ninfer_kv.engine.address_space import NO_ROW, KVAddressSpace, SequenceKVBundle
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.page_life import I64, members_of, unref
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import StoreState
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import unpack


def apply(st: StoreState, event: Any) -> None:
    _HANDLERS[type(event)](st, event)


def apply_all(st: StoreState, events: list[Any]) -> None:
    h = _HANDLERS
    for e in events:
        h[type(e)](st, e)


# --- handlers -----------------------------------------------------------------------------------
def _configure(st: StoreState, e: ev.Configure) -> None:
    assert not st.pools, "journal configured twice"
    st.plan = dict(e.plan)
    st.pool_specs = list(e.pools)
    for spec in e.pools:
        st.pools[spec.name] = PoolState(spec.name, spec.capacity, spec.rows, spec.logical_pages)


def _activate(st: StoreState, e: ev.Activate) -> None:
    pool = st.pools[e.pool]
    assert 0 <= e.bundle <= st.next_bundle, \
        f"Activate of seq {e.bundle}: ids are handed out in order (the next is {st.next_bundle})"
    assert e.bundle not in pool.spaces, f"Activate of seq {e.bundle}: it has a space in {e.pool}"
    assert e.row in pool.free_rows and 0 <= e.held <= e.entitlement <= pool.logical_pages \
        and 0 <= e.budget < (1 << 63), \
        f"Activate of seq {e.bundle}: row {e.row} not free, held {e.held} / entitlement " \
        f"{e.entitlement} outside [0, L={pool.logical_pages}], or budget {e.budget} outside " \
        "int64"
    sp = pool.spaces[e.bundle] = KVAddressSpace(pool, e.bundle, e.entitlement, e.row)
    sp.incoming = e.held  # a Move/Fork in this record brings these pages: not reserved
    sp.budget = e.budget  # the bundle's, per space too: kv_lease_growth reads it as an array
    pool.reserved += e.entitlement - e.held
    pool.free_rows.remove(e.row)
    pool.row_owner[e.row] = e.bundle
    b = st.bundles.get(e.bundle)
    if b is None:
        b = st.bundles[e.bundle] = SequenceKVBundle(e.bundle, (e.pool,))
    else:
        b.pools = (*b.pools, e.pool)
    b.budget = e.budget
    if e.bundle >= st.next_bundle:
        st.next_bundle = e.bundle + 1


def _publish(st: StoreState, e: ev.PublishActive) -> None:
    b = st.bundles[e.bundle]
    ok = not b.active
    for name in b.pools:
        ok = ok and st.pools[name].spaces[e.bundle].active
    assert ok, f"PublishActive of {e.bundle}: not a sequence being activated"
    b.active = True


def _materialize(st: StoreState, e: ev.Materialize) -> None:
    new_members(st.pools[e.pool], e.bundles, e.slots, e.pages, "Materialize")


def new_members(pool: PoolState, bundles: bytes, slots: bytes, pages: bytes, what: str) -> None:
    """``bundles[i]`` gains a new private page in slot ``slots[i]`` leasing ``pages[i]`` (the
    packed int32 fields of a Materialize, or one CopyTail's): one compiled call
    (``apply_kernels.materialize``), or two when the arrays must grow first; nothing changes
    on a refusal."""
    assert not (pool.host_of and any(s in pool.host_of for s in unpack(slots).tolist())), \
        f"{pool.name}: a new page's slot still records a host replica"
    fs, fp = pool.free_slots, pool.free_pages
    for _ in range(2):
        code, j, x, y, z = ak.materialize(
            bundles, slots, pages, pool.n_slots, pool.logical_pages, pool.bundle_index,
            pool.sp_active, pool.sp_nmem, pool.sp_members, fs.bits, fp.bits, pool.pg_live,
            pool.pg_epoch, pool.pg_committed, pool.pg_protected, pool.pg_refs, pool.pg_active,
            pool.pg_writer, pool.pg_device, pool.pg_pins)
        if code != ak.NO_ROOM:
            break
        pool.ensure_members(x)
        pool.ensure_slot(y - 1)
    if code == ak.OK:
        fs.n -= x
        fp.n -= y
        pool.n_slots = z
        pool.reserved -= len(bundles) // 4
        return
    name = pool.name
    assert code != ak.LENGTHS, (f"{what} of {name}: {len(bundles)}, {len(slots)} and "
                                f"{len(pages)} bytes of seqs, slots and page groups "
                                "(int32 each)")
    b, sl, devs = unpack(bundles), unpack(slots), unpack(pages)
    assert code != ak.NO_SPACE, f"{what} for seq {int(b[j])}, which has no space in {name}"
    assert code != ak.INACTIVE, f"{what} of {name}: into an inactive checkpoint"
    assert code != ak.NO_GROUP, f"{what} of {name}: a new page without a page group (§8.1)"
    assert code != ak.BAD_LENGTH, f"{what} for seq {int(b[j])}: a membership of negative length"
    assert code != ak.TOO_WIDE, \
        f"{what} of {name}: a membership of {x} pages, past L={pool.logical_pages} (§14)"
    raise AssertionError(
        f"{what} of {name}: new page {j} in slot {int(sl[j])} with page group "
        f"{int(devs[j])}: the slot is neither free (and dead) nor the next unused one "
        f"({pool.n_slots} + pages before it), or the page group is not free (§5.2)")


def _commit(st: StoreState, e: ev.CommitFrontiers) -> None:
    """Applied in event order by one compiled loop on the packed fields
    (engine/apply_kernels.py): pages from the old frontier's block to the new one get their
    committed columns."""
    pool = st.pools[e.pool]
    bad = ak.apply_commit_raw(e.bundles, e.frontiers, pool.bundle_index, pool.sp_committed,
                              pool.sp_nmem, pool.sp_members, pool.pg_committed, pool.sp_active,
                              pool.pg_live, pool.pg_writer)
    if bad == -1:
        return
    assert bad != ak.COMMIT_LENGTHS, \
        f"CommitFrontiers of {e.pool}: {len(e.bundles)} bytes of seqs, {len(e.frontiers)} of " \
        "frontiers (int32 each)"
    b, f = unpack(e.bundles), unpack(e.frontiers)
    raise AssertionError(
        f"commit of seq {int(b[bad])} to {int(f[bad])}: no active space in {e.pool}, a "
        "frontier below its committed one (§8.1: a commit only advances; Truncate lowers) or "
        "past its membership, or a block to write that is no live page it writes (§9.4)")


def _provisional(st: StoreState, e: ev.ProvisionalFrontiers) -> None:
    """One compiled pass on the packed fields (``apply_kernels.apply_provisional``)."""
    pool = st.pools[e.pool]
    bad = ak.apply_provisional(e.bundles, e.frontiers, pool.bundle_index, pool.sp_active,
                               pool.sp_nmem, pool.sp_provisional)
    if bad == -1:
        return
    assert bad != ak.COMMIT_LENGTHS, \
        f"ProvisionalFrontiers of {e.pool}: {len(e.bundles)} bytes of seqs, " \
        f"{len(e.frontiers)} of frontiers (int32 each)"
    b, f = unpack(e.bundles), unpack(e.frontiers)
    raise AssertionError(
        f"ProvisionalFrontiers of {e.pool}: seq {int(b[bad])} to {int(f[bad])}: no active "
        "space, or a frontier outside [0, its membership] (§8.2)")


def _truncate(st: StoreState, e: ev.Truncate) -> None:
    pool = st.pools[e.pool]
    sp = pool.spaces[e.bundle]
    f = e.frontier
    assert sp.active and sp.protected <= f <= sp.committed, \
        f"Truncate of seq {e.bundle} to {f}: outside [protected {sp.protected}, committed " \
        f"{sp.committed}] of an active space (§8.2)"
    first, end = f // P, (sp.committed + P - 1) // P  # blocks from f's to the frontier's
    cut = members_of(pool, sp, "Truncate")[first:end]
    assert len(cut) == end - first, f"Truncate of seq {e.bundle}: a membership of " \
        f"{sp.nmem} pages, short of its committed frontier {sp.committed} (§14)"
    cols = (f - P * np.arange(first, end, dtype=I64)).clip(0)  # columns each page keeps
    lower = pool.pg_committed[cut] > cols
    pool.pg_committed[cut[lower]] = cols[lower]
    pool.pg_epoch[cut[lower]] += 1  # the canonical content of these columns may now change
    sp.committed = f
    sp.provisional = min(sp.provisional, f)


def _trim(st: StoreState, e: ev.Trim) -> None:
    pool = st.pools[e.pool]
    sp = pool.spaces[e.bundle]
    assert e.keep >= 0 and e.keep * P >= sp.committed, \
        f"Trim of seq {e.bundle} to {e.keep} pages: below its committed frontier {sp.committed}"
    dropped = members_of(pool, sp, "Trim")[e.keep:]
    unref(st, pool, dropped, e.bundle, sp.active)  # refuses a lost reference first
    sp.trim_members(e.keep)
    if sp.active:
        pool.reserved += len(dropped)  # back to the same reservation, not to global capacity


def _grow(st: StoreState, e: ev.Grow) -> None:
    """Entitlements grow by ``pages`` (§6.2): one compiled pass on the packed fields."""
    pool = st.pools[e.pool]
    code, j, added = ak.apply_grow(e.bundles, e.pages, pool.bundle_index, pool.sp_active,
                                   pool.sp_entitlement, pool.logical_pages)
    assert code != ak.COMMIT_LENGTHS, (f"Grow of {e.pool}: {len(e.bundles)} bytes of seqs, "
                                       f"{len(e.pages)} of page counts (int32 each)")
    assert code == ak.OK, (f"Grow of {e.pool}: seq {int(unpack(e.bundles)[j])} (element {j}) "
                           "has no active space, is listed twice, grows by negative pages, "
                           "or past L")
    pool.reserved += added


def _bundle(st: StoreState, bundle: int, what: str) -> SequenceKVBundle:
    """The bundle of a space an event names, looked up before the handler changes anything
    (a space without its bundle is a damaged state, §7.1)."""
    b = st.bundles.get(bundle)
    assert b is not None, f"{what}: seq {bundle} has a space but no bundle (§7.1)"
    return b


def _finish(st: StoreState, e: ev.Finish) -> None:
    pool = st.pools[e.pool]
    sp = pool.spaces[e.bundle]
    bundle = _bundle(st, e.bundle, "Finish")
    assert pool.row_owner.get(sp.row) == e.bundle and sp.row not in pool.free_rows, \
        f"Finish of seq {e.bundle}: its row {sp.row} is not leased to it"
    slots = members_of(pool, sp, "Finish")
    if e.retain:  # members_of refused a damaged membership before any change
        ak.retain_pages(slots, e.bundle, sp.committed, pool.pg_active, pool.pg_writer,
                        pool.pg_protected)  # protected only grows
    else:
        unref(st, pool, slots, e.bundle, True)
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


def _release(st: StoreState, e: ev.Release) -> None:
    pool = st.pools[e.pool]
    assert not pool.spaces[e.bundle].active, f"Release of seq {e.bundle}: it is active (Finish)"
    _bundle(st, e.bundle, "Release")
    unref(st, pool, members_of(pool, pool.spaces[e.bundle], "Release"), e.bundle, False)
    _drop_space(st, pool, e.bundle)


def _move(st: StoreState, e: ev.Move) -> None:
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


def _fork(st: StoreState, e: ev.Fork) -> None:
    """§9.2: the full pages before the frontier gain an immutable reference."""
    pool = st.pools[e.pool]
    src, dst = pool.spaces[e.src], pool.spaces[e.dst]
    _bundle(st, e.dst, "Fork")
    code = ak.fork_pages(src.i, dst.i, e.full_pages, pool.sp_active, pool.sp_committed,
                         pool.sp_members, pool.sp_nmem, pool.pg_live, pool.pg_refs,
                         pool.pg_active)
    assert code != ak.FORK_ACTIVE_SOURCE, f"Fork of {e.src}: not an inactive checkpoint " \
        "(fork_live shares a live sequence's prefix first, §9.2)"
    assert code != ak.FORK_BAD_TARGET, \
        f"Fork of {e.src} into {e.dst}: a destination with pages, or past the committed frontier"
    assert code != ak.FORK_BAD_COUNT, \
        f"Fork of {e.src}: {e.full_pages} pages outside [0, its membership {src.nmem}]"
    assert code != ak.FORK_DEAD_PAGE, f"Fork of {e.src}: a dead page in its membership, a " \
        "slot outside the pool, a repeat, or a length past its row (§14)"
    dst.provisional = e.full_pages * P  # committed too (fork_pages)
    dst.protected = e.full_pages * P  # the shared immutable prefix stays protected
    pool.reserved -= e.full_pages - dst.incoming
    dst.incoming = 0
    st.bundles[e.dst].parent = e.src


def _share(st: StoreState, e: ev.Share) -> None:
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


def _prefix(st: StoreState, e: ev.Prefix) -> None:
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
    assert 0 <= dst_id <= st.next_bundle, \
        f"{what} into {dst_id}: ids are handed out in order (the next is {st.next_bundle})"
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


def _copy_tail(st: StoreState, e: ev.CopyTail) -> None:
    """§9.3: a private destination page holding the source tail's first ``columns`` columns."""
    assert 0 < e.columns < P, f"CopyTail of {e.dst}: {e.columns} columns (a partial tail)"
    pool = st.pools[e.pool]
    dst = pool.spaces.get(e.dst)
    assert dst is not None and dst.active, f"CopyTail into {e.dst}: not an active space"
    new_members(pool, _int32(e.dst, "dst"), _int32(e.slot, "slot"), _int32(e.page, "page"),
                "CopyTail")
    pool.pg_committed[e.slot] = e.columns
    dst.committed = dst.provisional = (dst.nmem - 1) * P + e.columns


_I32 = struct.Struct("<i")


def _int32(v: int, what: str) -> bytes:
    """One event field packed as ``events.pack`` packs an array's (an int32, refused outside)."""
    assert -(1 << 31) <= v < (1 << 31), f"{what}={v} does not fit the journal's int32"
    return _I32.pack(v)


def _set_metadata(st: StoreState, e: ev.SetMetadata) -> None:
    st.bundles[e.bundle].meta = bytes(e.meta)


def _recovered(st: StoreState, e: ev.Recovered) -> None:
    """A marker for tools; the state changes follow as ordinary events."""


_HANDLERS: dict[type, Callable[[StoreState, Any], None]] = {
    ev.Configure: _configure,
    ev.Recovered: _recovered,
    ev.Activate: _activate,
    ev.PublishActive: _publish,
    ev.Materialize: _materialize,
    ev.CommitFrontiers: _commit,
    ev.ProvisionalFrontiers: _provisional,
    ev.Truncate: _truncate,
    ev.Trim: _trim,
    ev.Grow: _grow,
    ev.Finish: _finish,
    ev.Release: _release,
    ev.Move: _move,
    ev.Fork: _fork,
    ev.Share: _share,
    ev.Prefix: _prefix,
    ev.CopyTail: _copy_tail,
    ev.HostConfigure: ah.host_configure,
    ev.HostReserve: ah.host_reserve,
    ev.HostPublish: ah.host_publish,
    ev.HostAbort: ah.host_abort,
    ev.HostDrop: ah.host_drop,
    ev.DeviceDrop: ah.device_drop,
    ev.DeviceRestore: ah.device_restore,
    ev.Pin: ah.pin,
    ev.Unpin: ah.unpin,
    ev.SetMetadata: _set_metadata,
}
