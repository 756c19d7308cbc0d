"""``apply(state, event)``: the only code that mutates a ``StoreState``.

It is pure bookkeeping and never chooses: every page id, slot and row is in the event. The
commands in ``store.py`` validate everything before they emit, so an event that reaches here is
valid; the asserts below guard the replay of a foreign or damaged journal, not normal use.
Replay (``ninfer_kv.replay``) calls this function unchanged. The handlers of the events that
end a sequence or make, continue and release checkpoints are engine/apply_checkpoints.py;
the host tier's are engine/apply_host.py; the page half of all of them is engine/page_life.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from ninfer_kv.engine import apply_checkpoints as ac
from ninfer_kv.engine import apply_host as ah
from ninfer_kv.engine import apply_kernels as ak
from ninfer_kv.engine.address_space import KVAddressSpace, SequenceKVBundle
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.page_life import I64, drop_membership, members_of, new_members
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import MAX_BUNDLE, StoreState
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
    assert 0 <= e.bundle <= min(st.next_bundle, MAX_BUNDLE), \
        f"Activate of seq {e.bundle}: ids are handed out in order (the next is " \
        f"{st.next_bundle}), up to {MAX_BUNDLE} (int32 fields)"
    assert e.bundle not in pool.spaces, f"Activate of seq {e.bundle}: it has a space in {e.pool}"
    assert e.row in pool.free_rows and 0 <= e.held <= e.entitlement <= pool.logical_pages \
        and 0 <= e.budget < (1 << 63), \
        f"Activate of seq {e.bundle}: row {e.row} not free, held {e.held} / entitlement " \
        f"{e.entitlement} outside [0, L={pool.logical_pages}], or budget {e.budget} outside " \
        "int64"
    # ``held``: a Move/Fork in this record brings these pages, so they are not reserved; the
    # budget is the bundle's, per space too (kv_lease_growth reads it as an array)
    pool.spaces[e.bundle] = KVAddressSpace(pool, e.bundle, e.entitlement, e.row, e.budget,
                                           e.held)
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


def _commit(st: StoreState, e: ev.CommitFrontiers) -> None:
    """Applied in event order by one compiled loop on the packed fields
    (engine/apply_kernels.py): pages from the old frontier's block to the new one get their
    committed columns."""
    pool = st.pools[e.pool]
    bad = ak.apply_commit_raw(e.bundles, e.frontiers, pool.bundle_index, pool.sp_committed,
                              pool.sp_nmem, pool.sp_members, pool.sp_active, pool.pg_live,
                              pool.pg)
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
    if f % P and f < sp.committed:  # the sequence rewrites the tail page from column f % P:
        s = int(cut[0])  # its writer, or a page a Move handed over whole (§9.1, §9.4)
        w = int(pool.pg_writer[s])
        assert w == e.bundle or (w == NO_PAGE and pool.pg_refs[s] == 1), \
            f"Truncate of seq {e.bundle} to {f}: page {s} has writer {w} and " \
            f"{int(pool.pg_refs[s])} references (§9.4)"
        pool.pg_writer[s] = e.bundle
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
    # the membership judged whole, the references of its blocks from ``keep`` dropped (a
    # lost one refused first, nothing changed), the garbage collected: one compiled call
    drop_membership(st, pool, sp, e.bundle, sp.active, "Trim", keep=e.keep)
    dropped = sp.trim_members(e.keep)
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


def _set_metadata(st: StoreState, e: ev.SetMetadata) -> None:
    b = st.bundles[e.bundle]
    assert len(e.meta) <= ev.METADATA_MAX, \
        f"SetMetadata of seq {e.bundle}: {len(e.meta)} bytes, over {ev.METADATA_MAX}"
    if e.meta:  # one well-formed msgpack value: skipped, not built (what msgspec can encode
        try:    # but not decode back, e.g. a struct-keyed map, an old journal may hold)
            _ONE_VALUE.decode(e.meta)
        except msgspec.DecodeError as exc:
            raise ValueError(f"SetMetadata of seq {e.bundle}: {len(e.meta)} bytes that are "
                             f"not one msgpack value ({exc})") from None
        except RecursionError:  # nested past this stack's reach: whether it fits depends on
            pass  # the caller's depth, so no verdict; readers type what they cannot decode
    b.meta = bytes(e.meta)


_ONE_VALUE = msgspec.msgpack.Decoder(msgspec.Raw)
"""Checks that bytes hold exactly one well-formed msgpack value, without building it."""


def _recovered(st: StoreState, e: ev.Recovered) -> None:
    """A marker for tools, and where a reopened store's ids start (``next_id``: never back,
    never past the last id + 1); the other state changes follow as ordinary events. Its
    fields are checked, so every tool that reads it (replay, open, dump) refuses a damaged
    one alike."""
    assert e.records >= 0 and len(e.kept) % 4 == 0 and len(e.dropped) % 4 == 0, \
        f"Recovered: {e.records} records, {len(e.kept)} and {len(e.dropped)} bytes of kept " \
        "and dropped seqs (int32 each)"
    assert e.next_id == -1 or st.next_bundle <= e.next_id <= MAX_BUNDLE + 1, \
        f"Recovered: next id {e.next_id} before the next one {st.next_bundle}, or past " \
        f"{MAX_BUNDLE + 1}"
    st.next_bundle = max(st.next_bundle, e.next_id)


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
    ev.Finish: ac.finish,
    ev.Release: ac.release,
    ev.Move: ac.move,
    ev.Fork: ac.fork,
    ev.Share: ac.share,
    ev.Prefix: ac.prefix,
    ev.CopyTail: ac.copy_tail,
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
