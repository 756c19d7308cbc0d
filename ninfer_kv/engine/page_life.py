"""A logical page's life in the pool's arrays (spec §5.1, §5.3): born into a free slot with
a device lease (``new_members``, one compiled call), referenced by memberships, and
collected — device lease and host replica freed, slot recycled with its generation advanced
— when no reference and no pin is left (``unref``, ``collect``). Only ``apply`` calls these:
they are the array half of its handlers, kept apart so that apply.py reads as the list of
events.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.engine import apply_kernels as ak
from ninfer_kv.engine import page_life_kernels as plk
from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.state import StoreState
from ninfer_kv.journal.events import unpack

I64 = np.int64


def collect(st: StoreState, pool: PoolState, slots: np.ndarray) -> None:
    """Of ``slots``, the pages with no reference and no pin are garbage: free their device
    and host replicas and recycle the slots, advancing their generations (§5.3). A garbage
    slot that is not live, or whose slot or page group is free already, is a damaged journal:
    ``ValueError``, nothing freed."""
    dead = plk.dead_slots(slots, pool.pg_refs, pool.pg_pins)
    if not len(dead):
        return
    hosted = dead[pool.pg_host_off[dead] >= 0] if pool.host_of else dead[:0]
    j, freed, low, low_slot = plk.free_dead(dead, pool.pg_live, pool.pg_device, pool.pg_gen,
                                           pool.free_pages.bits, pool.free_slots.bits)
    if j >= 0:
        raise ValueError(f"{pool.name}: freeing slot {int(dead[j])} (page group "
                         f"{int(pool.pg_device[dead[j]])}): not live, or the slot or page "
                         "group is free already")
    pool.free_pages.n += freed
    if freed:
        pool.free_pages.lo = min(pool.free_pages.lo, low)
    pool.free_slots.n += len(dead)
    pool.free_slots.lo = min(pool.free_slots.lo, low_slot)
    for s in hosted.tolist():
        off = int(pool.pg_host_off[s])
        del pool.host_of[s]
        st.host.free(off)  # type: ignore[union-attr]


def unref(st: StoreState, pool: PoolState, slots: np.ndarray | list[int], bundle: int,
           active: bool) -> None:
    """``bundle``'s space drops its references to ``slots`` (an active space also its
    writer right); pages left without references are collected. A slot that is no live,
    referenced page, or a garbage page whose slot or page group is free already, is a
    damaged state: ``ValueError``, nothing changed — the handlers call this before their
    other changes, so the whole event is refused."""
    slots = np.asarray(slots, I64)
    if pool.host_of:
        host_extents_live(st, pool, slots, f"seq {bundle} drops")
    j = plk.unref_slots(slots, bundle, active, pool.pg_live, pool.pg_refs, pool.pg_active,
                       pool.pg_writer, pool.pg_pins, pool.pg_device, pool.free_pages.bits,
                       pool.free_slots.bits)
    if j >= 0:
        raise ValueError(_cannot_drop(pool, bundle, int(slots[j])))
    collect(st, pool, slots)


def _cannot_drop(pool: PoolState, bundle: int, slot: int) -> str:
    return (f"{pool.name}: seq {bundle} drops slot {slot}, which is no live page it "
            "references, or whose slot or page group is free already (§14)")


def drop_membership(st: StoreState, pool: PoolState, sp: KVAddressSpace, bundle: int,
                    active: bool, what: str, keep: int = 0) -> None:
    """``unref`` of ``sp``'s membership from block ``keep`` on (the whole read through
    ``members_of``; ``keep`` >= 0): one compiled call (``page_life_kernels.drop_membership``)
    when the pool holds no host replica, else those two steps (a host replica's arena extent
    is freed here, in Python). Refuses as they do, with nothing changed. The membership's
    length is unchanged (Trim cuts it after)."""
    assert keep >= 0, f"{what} of seq {bundle}: keep {keep} < 0"
    if pool.host_of:
        unref(st, pool, members_of(pool, sp, what)[keep:], bundle, active)
        return
    fs, fp = pool.free_slots, pool.free_pages
    code, j, freed, low, n_dead, low_slot = plk.drop_membership(
        sp.i, keep, bundle, active, pool.sp_members, pool.sp_nmem, pool.pg_live, pool.pg,
        fp.bits, fs.bits)
    if code == plk.MEMBERS_FAULT:
        members_of(pool, sp, what)  # raises, naming the block
        raise AssertionError(f"{what} of seq {bundle}: membership refused at block {j}")
    if code == plk.UNREF_FAULT:
        raise ValueError(_cannot_drop(pool, bundle, int(pool.sp_members[sp.i, j])))
    fp.n += freed
    if freed:
        fp.lo = min(fp.lo, low)
    if n_dead:
        fs.n += n_dead
        fs.lo = min(fs.lo, low_slot)


def retain_membership(pool: PoolState, sp: KVAddressSpace, bundle: int, what: str) -> None:
    """``apply(Finish(retain))``'s page half (``apply_kernels.retain_pages`` on ``sp``'s
    membership, read as ``members_of`` reads it) in one compiled call; refuses as
    ``members_of`` does, with nothing changed."""
    k = ak.retain_membership(sp.i, bundle, sp.committed, pool.sp_members, pool.sp_nmem,
                             pool.pg_live, pool.pg)
    if k != -1:
        members_of(pool, sp, what)  # raises, naming the block
        raise AssertionError(f"{what} of seq {bundle}: membership refused at block {k}")


def collectable(st: StoreState, pool: PoolState, slots: np.ndarray, what: str) -> None:
    """Each of ``slots`` could be collected: a live page whose slot and page group are
    leased, its host replica (if any) in a live extent — so a ``collect`` after the caller's
    changes cannot fail half way. Else (a damaged state) ``ValueError``; called before a
    handler changes anything."""
    j = plk.first_unfreeable(slots, pool.pg_live, pool.pg_device, pool.free_pages.bits,
                            pool.free_slots.bits)
    if j >= 0:
        s = int(slots[j])
        group = int(pool.pg_device[s]) if 0 <= s < len(pool.pg_device) else "-"
        raise ValueError(f"{pool.name}: {what} slot {s}: not live, or its slot or page group "
                         f"{group} is free already (§5.3)")
    if pool.host_of:
        host_extents_live(st, pool, slots, what)


def host_extents_live(st: StoreState, pool: PoolState, slots: np.ndarray, what: str) -> None:
    """The host replicas of ``slots`` lie in live extents of the arena, one extent each, so
    ``collect`` can free them; else (a damaged state) ``ValueError`` naming the slot —
    checked before a handler changes anything."""
    offs = pool.pg_host_off[slots]
    have = offs >= 0
    held = offs[have].tolist()
    live = st.host.live  # type: ignore[union-attr]
    if all(map(live.__contains__, held)) and len(set(held)) == len(held):
        return  # the common case, in C loops; below only names the first bad slot
    seen: set[int] = set()
    for s, off in zip(slots[have].tolist(), held, strict=True):
        if off not in live or off in seen:
            raise ValueError(f"{pool.name}: {what} slot {s}, whose host replica at {off} is "
                             "no live extent of the arena, or another's (§5.3)")
        seen.add(off)


def members_of(pool: PoolState, sp: KVAddressSpace, what: str) -> np.ndarray:
    """``sp``'s membership as a fresh int64 array (slot ids by logical block), read for an
    event that changes its pages: distinct live pages (§14), else (a damaged state: a foreign
    snapshot, a bug) ``ValueError`` naming the block — before the handler changes anything.
    Every handler reads a membership through this (Finish and Release through
    ``page_life_kernels.membership_of``, the same rule compiled), so a repeat or an
    out-of-range slot cannot count a page twice or (numpy and numba wrap negative indices)
    alias another's."""
    n = pool.sp_nmem[sp.i]
    if not 0 <= n <= pool.sp_members.shape[1]:  # numpy would wrap or clamp the slice
        raise ValueError(f"{what} of seq {sp.bundle} in {pool.name}: a membership of {n} "
                         f"pages, outside [0, its row's {pool.sp_members.shape[1]}] (§14)")
    slots = pool.sp_members[sp.i, :n].astype(I64)
    k = plk.membership_fault(slots, pool.pg_live)
    if k >= 0:
        raise ValueError(f"{what} of seq {sp.bundle} in {pool.name}: block {k} names slot "
                         f"{int(slots[k])}, no live page or one an earlier block names (a "
                         "membership holds distinct live pages, §14)")
    return slots


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
            pool.pg)
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
