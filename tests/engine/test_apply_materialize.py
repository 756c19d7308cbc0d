"""``apply(Materialize)`` as one compiled call (``apply_kernels.materialize``) against the
composition it replaced: ``materialize_plan``, ``new_pages`` (its free-list and page-field
kernels), ``ensure_members`` and ``append_members``. Same state after a valid event; a
damaged one (unknown, inactive or repeated ids, a live slot, a fresh slot out of order, a
page group not free) is refused with the state digest unchanged — including when the arrays
had to grow first."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.engine import apply_kernels as ak
from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.bundle_table import from_dense
from ninfer_kv.engine.pages import PG_ROWS
from ninfer_kv.engine.state import StoreState, digest
from ninfer_kv.engine.store import KVStore
from ninfer_kv.journal import events as ev
from tests.engine.conftest import small_config

DAMAGE = ["none", "none", "unknown seq", "inactive seq", "live slot", "skipped fresh slot",
          "taken page group", "page group twice", "slot twice", "no page group"]


def oracle(st_: StoreState, e: ev.Materialize) -> None:
    """The pre-fusion apply(Materialize): raises on a refusal (state then as it was)."""
    pool = st_.pools[e.pool]
    b, slots, devs = ev.unpack(e.bundles), ev.unpack(e.slots), ev.unpack(e.pages)
    idx, code, _, width = ak.materialize_plan(b, devs, pool.bundle_index, pool.sp_active,
                                              pool.sp_nmem)
    if code != ak.OK:
        raise AssertionError(code)
    n_old = pool.n_slots  # page_life.new_pages, as it was
    j, reused, taken, n_new = ak.take_new_pages(slots, devs, n_old, pool.free_slots.bits,
                                                pool.free_pages.bits, pool.pg_live)
    if j >= 0:
        raise ValueError(f"new page {j}: a slot or page group not free")
    pool.free_slots.n -= reused
    pool.free_pages.n -= taken
    if n_new > n_old:
        pool.ensure_slot(n_new - 1)
        pool.n_slots = n_new
    ak.init_new_pages(slots, devs, b.astype(np.int64), 1, pool.pg_live, pool.pg)
    pool.ensure_members(width)
    ak.append_members(idx, slots, pool.sp_members, pool.sp_nmem)
    pool.reserved -= len(b)


def a_store(seed: int) -> tuple[KVStore, list[int], int]:
    """Active sequences with pages, freed slots, one retained checkpoint (inactive)."""
    rng = random.Random(seed)
    s = KVStore.open(small_config(None, pages=160, concurrency=6, context=2048, journal=False))
    live = []
    for _ in range(5):
        b = s.activate(64 * rng.randint(1, 4), 64 * 12)
        s.ensure_mapped(b, "main", 64 * rng.randint(1, 4))
        live.append(b)
    with s.boundary():
        pass
    s.commit(live[0], "main", 10)
    ck = s.finish(live.pop(0), retain=True)
    s.finish(live.pop(rng.randrange(len(live))))  # frees its slots and page groups
    with s.boundary():
        pass
    assert ck is not None
    return s, live, ck


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.integers(0, 2**16), st.integers(1, 24), st.sampled_from(DAMAGE))
def test_materialize_equals_the_composition_it_replaced(seed: int, k: int, damage: str) -> None:
    rng = random.Random(seed)
    s, live, ck = a_store(seed)
    pool = s.state.pools["main"]
    bundles = np.array([rng.choice(live) for _ in range(k)], np.int32)
    slots = copy.deepcopy(pool).pick_slot_array(k).astype(np.int32)
    devs = copy.deepcopy(pool.free_pages).lowest_array(k).astype(np.int32)
    assert len(devs) == k
    j = rng.randrange(k)
    live_slot = int(s.space(live[0], "main").slots[0])
    if damage == "unknown seq":
        bundles[j] = 999
    elif damage == "inactive seq":
        bundles[j] = ck
    elif damage == "live slot":
        slots[j] = live_slot
    elif damage == "skipped fresh slot":
        slots[j] = pool.n_slots + k + 3
    elif damage == "taken page group":
        devs[j] = int(pool.pg_device[live_slot])
    elif damage == "page group twice" and k > 1:
        devs[j] = devs[(j + 1) % k]
    elif damage == "slot twice" and k > 1:
        slots[j] = slots[(j + 1) % k]
    elif damage == "no page group":
        devs[j] = -1
    e = ev.Materialize("main", ev.pack(bundles), ev.pack(slots), ev.pack(devs))
    new, old = s.state, copy.deepcopy(s.state)
    before = digest(new)
    try:
        oracle(old, e)
        refused = False
    except (AssertionError, ValueError):
        refused = True
    if refused:
        with pytest.raises(AssertionError):
            apply(new, e)
        assert digest(new) == before
        assert len(pool.free_slots) == pool.free_slots.n
    else:
        apply(new, e)
        assert digest(new) == digest(old)
        p_old = old.pools["main"]
        assert (pool.free_slots.n, pool.free_pages.n, pool.n_slots) == \
            (p_old.free_slots.n, p_old.free_pages.n, p_old.n_slots)
        assert list(pool.free_slots) == list(p_old.free_slots)
        assert list(pool.free_pages) == list(p_old.free_pages)
    s.close()


def test_materialize_asks_for_room_and_changes_nothing() -> None:
    """Memberships too narrow, or page arrays too short, for the new pages: ``NO_ROOM`` with
    the width and length needed, and no array written (a kernel cannot replace arrays)."""
    bundles = np.array([7, 7, 7], np.int32)
    slots = np.array([2, 3, 4], np.int32)
    devs = np.array([0, 1, 2], np.int32)
    bundle_index = np.full(8, -1, np.int64)
    bundle_index[7] = 0
    sp_active = np.ones(1, np.bool_)
    sp_nmem = np.array([2], np.int64)
    page_bits = np.ones(4, np.bool_)

    def call(width: int, n_pg: int, n_live: int | None = None
             ) -> tuple[tuple[int, ...], list[np.ndarray]]:
        members, slot_bits = np.full((1, width), -1, np.int32), np.zeros(n_pg, np.bool_)
        pg = np.zeros((len(PG_ROWS), n_pg), np.int64)
        nmem, groups = sp_nmem.copy(), page_bits.copy()
        got = ak.materialize(bundles.tobytes(), slots.tobytes(), devs.tobytes(), 2, 16,
                             from_dense(bundle_index), sp_active, nmem, members, slot_bits, groups,
                             np.zeros(n_live or n_pg, np.bool_), pg)
        return tuple(int(x) for x in got), [members, nmem, groups, *pg]

    # one short each way; the last two: the matrix and pg_live of different lengths (each
    # is checked: the kernel writes both without bounds checks)
    for width, n_pg, n_live in ((4, 5, None), (5, 4, None), (5, 4, 5), (5, 5, 4)):
        got, arrays = call(width, n_pg, n_live)
        assert got == (ak.NO_ROOM, -1, 5, 5, 0)
        assert all(not a.any() or (a == -1).all() for a in arrays if a.ndim == 2)
        assert arrays[1].tolist() == [2] and not any(a.any() for a in arrays[3:])
        assert arrays[2].all()  # the page groups it took are free again
    page_bits[1] = False  # a page group not free: refused before the arrays would grow
    for width, n_pg in ((4, 5), (5, 4)):
        got, arrays = call(width, n_pg)
        assert got[:2] == (ak.BAD_SLOT, 1)
        assert arrays[2].tolist() == [True, False, True, True] and arrays[1].tolist() == [2]
    page_bits[1] = True
    got, arrays = call(5, 5)
    assert got == (ak.OK, -1, 0, 3, 5)
    assert arrays[0].tolist() == [[-1, -1, 2, 3, 4]] and arrays[1].tolist() == [5]
    assert arrays[2].tolist() == [False, False, False, True]


def test_materialize_refuses_fields_of_different_lengths() -> None:
    one, two = np.zeros(1, np.int32).tobytes(), np.zeros(2, np.int32).tobytes()
    z = np.zeros(4, np.int64)
    for raws in ((one, one, two), (one, two, one), (two, one, one), (one[:3], one[:3], one[:3])):
        got = ak.materialize(*raws, 0, 4, from_dense(z), z.astype(np.bool_), z,
                             np.full((4, 4), -1, np.int32),
                             z.astype(np.bool_), z.astype(np.bool_), z.astype(np.bool_),
                             np.zeros((len(PG_ROWS), 4), np.int64))
        assert got[0] == ak.LENGTHS


def test_apply_names_fields_of_different_lengths() -> None:
    """apply(Materialize) words the kernel's LENGTHS refusal as such (without that assert
    the refusal fell through to the last, wrong message); nothing changes."""
    s, live, _ = a_store(4)
    pool = s.state.pools["main"]
    slot, page = int(next(iter(pool.free_slots))), int(next(iter(pool.free_pages)))
    before = digest(s.state)
    for e in (ev.Materialize("main", ev.pack([live[0], live[1]]), ev.pack([slot]),
                             ev.pack([page])),
              ev.Materialize("main", ev.pack([live[0]]), ev.pack([slot])[:3], ev.pack([page]))):
        with pytest.raises(AssertionError, match=r"bytes of seqs, slots and page groups"):
            apply(s.state, e)
        assert digest(s.state) == before
    s.close()


def test_a_membership_past_l_is_refused_before_any_array_grows() -> None:
    """Review repro: the arrays grew to what a damaged event asked before it was refused
    (here a membership past L; with never-used slots, as many as the event listed), so an
    event of a few MB made apply allocate GBs, a MemoryError replay does not turn into a
    refusal. Every rule is now checked before NO_ROOM (for the slot rules see
    ``test_materialize_asks_for_room_and_changes_nothing``)."""
    s, live, _ = a_store(3)
    pool = s.state.pools["main"]
    k = pool.logical_pages + 1
    slots = np.arange(pool.n_slots, pool.n_slots + k, dtype=np.int32)
    devs = copy.deepcopy(pool.free_pages).lowest_array(k).astype(np.int32)
    assert len(devs) == k
    e = ev.Materialize("main", ev.pack([live[0]] * k), ev.pack(slots), ev.pack(devs))
    shapes = (pool.sp_members.shape, pool.pg_live.shape, pool.free_slots.bits.shape)
    before = digest(s.state)
    with pytest.raises(AssertionError, match="past L"):
        apply(s.state, e)
    assert digest(s.state) == before
    assert (pool.sp_members.shape, pool.pg_live.shape, pool.free_slots.bits.shape) == shapes
    s.close()


def test_commit_on_packed_fields_refuses_different_lengths() -> None:
    """``apply(CommitFrontiers)`` reads its fields in place (``apply_commit_raw``): fields of
    different lengths, or not whole int32s, are refused before any frontier moves."""
    s, live, _ = a_store(1)
    p = s.state.pools["main"]
    b = live[0]
    before = digest(s.state)
    for bundles, frontiers, torn in (([b], [1, 2], 0), ([b, b], [1], 0), ([b], [1], 1),
                                     ([b], [1], 2)):
        raw_b, raw_f = ev.pack(bundles), ev.pack(frontiers)
        if torn:  # a torn int32: in one field, or in both alike
            raw_f = raw_f[:3]
            raw_b = raw_b[:3] if torn == 2 else raw_b
        e = ev.CommitFrontiers("main", raw_b, raw_f)
        with pytest.raises(AssertionError, match="seqs"):
            apply(s.state, e)
        assert digest(s.state) == before
    assert ak.apply_commit_raw(ev.pack([b]), ev.pack([1, 2]), p.bundle_index, p.sp_committed,
                               p.sp_nmem, p.sp_members, p.sp_active, p.pg_live,
                               p.pg) == ak.COMMIT_LENGTHS
    s.close()


def test_grow_on_packed_fields_refuses_different_lengths() -> None:
    """``apply(Grow)`` reads its fields in place (``apply_grow``): fields of different
    lengths, or a torn int32 in both alike, are refused by name before any entitlement
    moves."""
    s, live, _ = a_store(2)
    b = live[0]
    before = digest(s.state)
    for raw_b, raw_n in ((ev.pack([b, b]), ev.pack([1])), (ev.pack([b])[:3], ev.pack([1])[:3])):
        with pytest.raises(AssertionError, match="bytes of seqs"):
            apply(s.state, ev.Grow("main", raw_b, raw_n))
        assert digest(s.state) == before
    s.close()


@pytest.mark.parametrize("bad", ["unknown", "negative id", "inactive", "twice", "negative",
                                 "past L"])
def test_apply_grow_refuses_each_rule_unchanged(bad: str) -> None:
    """Each rule of ``apply_grow`` on its own, with every space index active (so an unknown
    seq cannot be caught by reading a wrapped-around index's inactive flag instead)."""
    bundle_index = np.array([-1, 0, 1, 2], np.int64)
    sp_active = np.ones(3, np.bool_)
    ent = np.array([2, 3, 4], np.int64)
    seqs, pages = [1, 2, 3], [1, 1, 1]
    j = 1
    if bad == "unknown":
        seqs[j] = 0
    elif bad == "negative id":
        seqs[j] = -1
    elif bad == "inactive":
        sp_active[1] = False
    elif bad == "twice":
        seqs[j] = 1
    elif bad == "negative":
        pages[j] = -1
    else:
        pages[j] = 4  # 3 + 4 > L = 6
    table = from_dense(bundle_index)
    code, at, added = ak.apply_grow(ev.pack(seqs), ev.pack(pages), table, sp_active, ent, 6)
    assert (code, at, added) == (ak.GROW_BAD, j, 0)
    assert ent.tolist() == [2, 3, 4]
    sp_active[:] = True
    assert ak.apply_grow(ev.pack([1, 2, 3]), ev.pack([1, 1, 2]), table, sp_active, ent,
                         6) == (ak.OK, -1, 4)
    assert ent.tolist() == [3, 4, 6]
