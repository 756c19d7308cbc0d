"""The bundle table (engine/bundle_table.py): bundle id -> space index for compiled loops.

It used to be an array indexed by bundle id, which grew with every id the journal ever handed
out (8 bytes per pool per admitted sequence, never shrinking). These tests hold the table to a
dict model, its memory to the live spaces, and the §14 check to noticing a damaged table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer_kv.engine import bundle_table as bt
from ninfer_kv.engine.store import KVStore
from tests.engine.conftest import small_config

ops = st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 40), st.integers(0, 4)),
               max_size=300)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 3))
@example([(True, 64 * k, 0) for k in range(40)] + [(False, 0, 0)] * 40, 1)  # congruent ids
def test_table_matches_a_dict(steps: list[tuple[bool, int, int]], style: int) -> None:
    """Inserts and removals of ids that are recent (a sliding window, as the engine hands them
    out), congruent modulo the capacity (one home entry), or arbitrary: every lookup answers
    as the dict, the invariants hold after each step, and capacity follows the most live
    entries held (removals shrink it at the next rebuild, not at once)."""
    t, model = bt.BundleTable(), {}
    nxt = peak = 0
    for insert, raw, pick in steps:
        if insert or not model:
            b = (nxt if style == 0 else nxt * 64 if style == 1 else raw if style == 2
                 else (nxt if raw % 3 else raw))
            nxt += 1
            if b in model:
                continue
            t.insert(b, len(model) + pick)
            model[b] = len(model) + pick
        else:
            b = sorted(model)[pick % len(model)]
            t.remove(b)
            del model[b]
        peak = max(peak, len(model))
        assert t.check() == []
        assert t.items() == model
        assert t.array.shape[0] <= max(bt.MIN_CAPACITY, 8 * (peak + 1))
    for b in [*model, -1, -5, nxt, nxt * 64 + 1, 1 << 41]:
        assert bt.lookup(t.array, b) == model.get(b, -1)


def test_ids_sharing_one_home_are_all_found() -> None:
    """40 ids whose home is one entry of the minimum table (a probe chain of 40), then half
    of them removed: each lookup walks the chain past tombstones."""
    mask = bt.MIN_CAPACITY - 1
    same = [b for b in range(200_000) if bt.home(b, mask) == 7][:40]
    t = bt.BundleTable()
    t.array = bt.new_table(128)  # no rebuild (it would spread them): the chain stays
    for k, b in enumerate(same[:30]):
        t.insert(b, k)
    for b in same[:30:2]:
        t.remove(b)
    assert t.array.shape[0] == 128 and t.check() == []
    for k, b in enumerate(same[:30]):
        assert bt.lookup(t.array, b) == (-1 if k % 2 == 0 else k)
    for b in same[30:]:
        assert bt.lookup(t.array, b) == -1


def test_a_damaged_table_without_room_is_refused_not_looped() -> None:
    """Every entry taken (a damaged table): an insert raises instead of probing forever."""
    t = bt.BundleTable()
    t.array = np.column_stack([np.arange(100, 164), np.zeros(64, np.int64)])
    with pytest.raises(AssertionError, match="no free entry"):
        t.insert(7, 0)


def test_a_lookup_of_a_full_damaged_table_ends() -> None:
    """No EMPTY entry (a damaged table): a miss stops after one pass instead of looping."""
    a = np.full((8, 2), bt.GONE, np.int64)
    a[3] = (11, 0)
    assert bt.lookup(a, 5) == -1 and bt.lookup(a, 11) == 0


def test_memory_follows_the_live_sequences_not_the_ids_handed_out(tmp_path: Path) -> None:
    """3,000 requests, four at a time: the table stays at its minimum size. The array indexed
    by bundle id grew to 4,096 entries per pool here (and on, by 8 bytes per request)."""
    s = KVStore.open(small_config(tmp_path, pages=64, concurrency=4, allocate_planes=False))
    live: list[int] = []
    for _ in range(3000):
        live.append(s.activate(40, 8))
        if len(live) == 4:
            with s.boundary():
                pass
            for b in live:
                s.finish(b)
            live = []
    with s.boundary():
        pass
    assert s.state.next_bundle > 3000
    for pool in s.state.pools.values():
        assert pool.bundle_index.shape[0] == bt.MIN_CAPACITY, pool.bundle_index.shape
    s.check_invariants()
    s.close()


def test_the_invariant_check_notices_a_damaged_table(tmp_path: Path) -> None:
    """An entry missing, one pointing at another space's index, or the kernels' array not
    the table's (a copy left behind by a rebuild): §14 reports each."""
    s = KVStore.open(small_config(tmp_path, pages=64, concurrency=4, allocate_planes=False))
    a, b = s.activate(40, 8), s.activate(40, 8)
    with s.boundary():
        pass
    pool = s.state.pools["main"]
    assert s.violations() == []
    saved = pool.bundle_index.copy()
    h = int(np.flatnonzero(pool.bundle_index[:, 0] == a)[0])
    pool.bundle_index[h, 1] = pool.spaces[b].i  # a's entry names b's arrays
    assert any("bundle table" in v for v in s.violations())
    pool.bundle_index[:] = saved
    pool.bundle_table.remove(a)  # a's entry gone (the counts follow: only the map is wrong)
    assert any("bundle table maps 1 seqs" in v for v in s.violations())
    pool.bundle_table.insert(a, pool.spaces[a].i)
    pool.bundle_index = pool.bundle_table.array
    assert s.violations() == []
    pool.bundle_index = pool.bundle_index.copy()  # what the kernels read, left behind by a
    assert any("not the bundle table's array" in v for v in s.violations())  # rebuild
    pool.bundle_index = pool.bundle_table.array
    s.close()


def test_check_names_each_broken_invariant() -> None:
    """``BundleTable.check`` (part of §14's ``violations``): counts that disagree with the
    entries, a table past half full, an entry its probe sequence does not reach."""
    t = bt.BundleTable()
    t.insert(5, 0)
    assert t.check() == []
    h = bt.home(5, bt.MIN_CAPACITY - 1)
    t.array[h] = (bt.GONE, bt.EMPTY)  # removed behind the counts' back
    assert any("counts 1 live / 0 removed, holds 0 / 1" in v for v in t.check())
    t = bt.BundleTable()
    t.insert(5, 0)
    far = (h + 2) % bt.MIN_CAPACITY
    t.array[h], t.array[far] = (bt.EMPTY, bt.EMPTY), (5, 0)  # an EMPTY entry before it
    assert any(f"bundle 5 at entry {far} is not found" in v for v in t.check())
    t = bt.BundleTable()
    t.array = bt.new_table(4)
    for b in (0, 1, 2):
        bt._place(t.array, b, b)
    t.live = 3
    assert any("past half full" in v for v in t.check())
    t = bt.BundleTable()
    t.insert(5, 0)
    t.array[(h + 1) % bt.MIN_CAPACITY, 0] = -7  # a key no writer makes: a damaged table
    assert any("entry" in v and "holds key -7" in v for v in t.check())


def test_an_id_listed_twice_is_reported() -> None:
    """The second entry of an id is never reached by probing (the first stops it), even when
    both name the same space index."""
    t = bt.BundleTable()
    t.insert(5, 3)
    h = bt.home(5, bt.MIN_CAPACITY - 1)
    twin = (h + 1) % bt.MIN_CAPACITY
    t.array[twin] = (5, 3)
    t.live = 2
    assert [v for v in t.check() if "bundle 5" in v] == [
        f"bundle 5 at entry {twin} is not found by probing from its home {h} (or is listed "
        "twice)"]
