"""Pages as arrays (engine/pool.py, pages.py): views, growth, and the snapshot built from the
arrays agreeing with the views."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.engine.address_space import KVAddressSpace
from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.page_life import new_members
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.pool import PG_FIELDS, PoolState
from ninfer_kv.engine.state import page_tuples
from ninfer_kv.engine.store import KVStore
from ninfer_kv.journal import events as ev
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, step


def a_space(p: PoolState, bundle: int = 5) -> int:
    """An active space in ``p`` for new pages to join (writer ``bundle``)."""
    p.spaces[bundle] = KVAddressSpace(p, bundle, p.logical_pages, 0)
    return bundle


def one(v: int) -> bytes:
    return np.array([v], np.int32).tobytes()


def test_a_page_in_the_slot_past_the_arrays_grows_them() -> None:
    """Slots outnumber device pages once checkpoints live on the host only: a CopyTail into
    the next never-used slot, right at the arrays' end, must grow them (it raised
    IndexError)."""
    p = PoolState("main", 16, 1, 4)
    p.init_pages(list(range(16)), [NO_PAGE] * 16, NO_PAGE, False)
    assert p.n_slots == len(p.pg_live) == 16
    b = a_space(p)
    new_members(p, one(b), one(16), one(3), "CopyTail")
    page = p.pages[16]
    assert page is not None
    assert (p.n_slots, page.device, page.writer, page.refs) == (17, 3, b, 1)
    assert 3 not in p.free_pages and p.spaces[b].members == [16]


def test_snapshot_pages_equal_the_views(tmp_path: Path) -> None:
    """page_tuples (arrays) == LogicalKVPage.as_tuple (views), host replicas included."""
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20))
    a = checkpoint_at(s, 150)
    s.offload(a)
    step(s)
    s.activate_from(a, 100, 160, 64)  # Fork mid-page: a COW tail, shared pages
    step(s)
    for p in s.state.pools.values():
        views = [list(pg.as_tuple()) for pg in p.pages if pg is not None]
        assert views and page_tuples(p) == views
        assert any(pg.host is not None for pg in p.pages if pg is not None) or p.name != "main"
    s.close()


def test_a_host_replica_on_a_free_slot_is_reported_and_never_inherited(tmp_path: Path) -> None:
    """Review finding: with replicas in a per-pool dict, a stale entry on a freed slot was
    reported by nothing and the slot's next page would have inherited it."""
    s = KVStore.open(small_config(tmp_path, host_bytes=8 << 20))
    a = checkpoint_at(s, 64)
    s.offload(a)
    step(s)
    p = s.state.pools["main"]
    (slot,) = s.space(a, "main").members
    replica = p.host_of[slot]
    s.release(a)
    step(s)
    assert slot not in p.host_of and p.pages[slot] is None
    b = s.activate(10, 100)                    # entitled to a page it has not mapped yet
    step(s)
    p.host_of[slot] = replica  # the fault
    assert any("still records a host replica" in v for v in s.violations())
    with pytest.raises(AssertionError, match="still records a host replica"):
        p.init_pages([slot], [NO_PAGE], NO_PAGE, False)
    before = (s.digest(), p.free_slots.n, p.free_pages.n, p.reserved)
    page = next(iter(p.free_pages))  # apply(Materialize) into that slot: refused, unchanged
    with pytest.raises(AssertionError, match="still records a host replica"):
        apply(s.state, ev.Materialize("main", ev.pack([b]), ev.pack([slot]), ev.pack([page])))
    assert (s.digest(), p.free_slots.n, p.free_pages.n, p.reserved) == before


def test_a_space_slots_view_is_read_only(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    a = checkpoint_at(s, 100)
    before = s.digest()
    with pytest.raises(ValueError, match="read-only"):
        s.space(a, "main").slots[0] = 7
    assert s.digest() == before
    s.close()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 12), st.integers(0, 2**16), st.booleans(), st.booleans())
def test_new_pages_in_one_event_equal_one_page_at_a_time(k: int, seed: int, shuffle: bool,
                                                         fresh_first: bool) -> None:
    """``new_members`` (Materialize's apply, one compiled call) of ``k`` pages leaves the pool
    as ``k`` one-page calls would (pages, membership, free slots, free page groups), in the
    order ``pick_slots`` hands out and in any other."""
    import copy
    import random

    rng = random.Random(seed)
    p = PoolState("main", 32, 1, 16)
    n = rng.randint(k, 20)
    p.init_pages(list(range(n)), list(range(n)), 0, True)
    p.free_pages.take(list(range(n)))
    for s in rng.sample(range(n), rng.randint(0, n)):   # free some slots and page groups
        p.pg_live[s] = False
        p.free_slots.give([s])
        p.free_pages.give([int(p.pg_device[s])])
        p.pg_device[s] = NO_PAGE
    b = a_space(p)
    slots = copy.deepcopy(p).pick_slot_array(k)
    devs = copy.deepcopy(p.free_pages).lowest_array(k)
    if shuffle:
        reused = int(np.count_nonzero(slots < p.n_slots))
        head = slots[:reused].tolist()
        rng.shuffle(head)
        slots = np.concatenate([np.array(head, np.int64), slots[reused:]])
    reused = int(np.count_nonzero(slots < p.n_slots))
    if fresh_first and 0 < reused < k:                   # not pick order: one page at a time
        slots = np.concatenate([slots[reused:reused + 1], slots[:reused], slots[reused + 1:]])
    a, c = copy.deepcopy(p), copy.deepcopy(p)
    new_members(a, np.full(k, b, np.int32).tobytes(), slots.astype(np.int32).tobytes(),
                devs.astype(np.int32).tobytes(), "Materialize")
    for sl, d in zip(slots.tolist(), devs.tolist(), strict=True):
        new_members(c, one(b), one(sl), one(d), "Materialize")
    assert page_tuples(a) == page_tuples(c)
    assert a.spaces[b].members == c.spaces[b].members == slots.tolist()
    assert list(a.free_slots) == list(c.free_slots) and list(a.free_pages) == list(c.free_pages)
    assert a.n_slots == c.n_slots and a.reserved == c.reserved


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(0, 2**16), st.sampled_from(
    ["live slot", "skipped fresh slot", "taken page group", "page group twice", "slot twice"]))
def test_new_pages_refuse_a_damaged_batch_and_change_nothing(k: int, seed: int,
                                                             damage: str) -> None:
    """A Materialize from a damaged journal (a live slot, a fresh slot out of order, a page
    group not free, one id twice): refused naming the element, and the pool as it was — no
    slot or page group left taken, no member added."""
    import copy
    import random

    rng = random.Random(seed)
    p = PoolState("main", 32, 1, 16)
    n = rng.randint(2, 16)
    p.init_pages(list(range(n)), list(range(n)), 0, True)
    p.free_pages.take(list(range(n)))
    for s in rng.sample(range(1, n), rng.randint(1, n - 1)):  # slot 0 stays live
        p.pg_live[s] = False
        p.free_slots.give([s])
        p.free_pages.give([int(p.pg_device[s])])
        p.pg_device[s] = NO_PAGE
    b = a_space(p)
    slots = copy.deepcopy(p).pick_slot_array(k).astype(np.int32)
    devs = copy.deepcopy(p.free_pages).lowest_array(k).astype(np.int32)
    j = rng.randrange(k)
    if damage == "live slot":
        slots[j] = 0
    elif damage == "skipped fresh slot":
        slots[j] = p.n_slots + k + 3
    elif damage == "taken page group":
        devs[j] = int(p.pg_device[0])
    elif damage == "page group twice" and k > 1:
        devs[j] = devs[(j + 1) % k]
    elif damage == "slot twice" and k > 1:
        slots[j] = slots[(j + 1) % k]
    else:
        slots[j] = 0
    before = copy.deepcopy(p)
    with pytest.raises(AssertionError, match="new page"):
        new_members(p, np.full(k, b, np.int32).tobytes(), slots.tobytes(), devs.tobytes(),
                    "Materialize")
    assert page_tuples(p) == page_tuples(before) and p.n_slots == before.n_slots
    assert list(p.free_slots) == list(before.free_slots)
    assert list(p.free_pages) == list(before.free_pages)
    assert len(p.free_slots) == len(before.free_slots)
    assert len(p.free_pages) == len(before.free_pages)
    assert p.spaces[b].members == [] and p.reserved == before.reserved


@pytest.mark.parametrize("full", [-1, -3])
def test_a_damaged_fork_or_share_with_negative_pages_is_refused(tmp_path: Path,
                                                                full: int) -> None:
    """Review repro: a damaged Fork with full_pages < 0 sliced the membership row's -1
    padding, which numpy wraps to the pool's last slot — another checkpoint's live page
    gained a reference. apply refuses it (replay: UnappliableRecord); so does a Share."""
    import copy

    from ninfer_kv.engine.apply import apply
    from ninfer_kv.journal import events as ev

    s = KVStore.open(small_config(tmp_path, pages=16, context=1024))
    ck = checkpoint_at(s, 128, out=0)              # slots 0, 1
    big = checkpoint_at(s, 14 * 64, out=0)         # slots 2..15: the arrays' last slot live
    st = copy.deepcopy(s.state)
    refs = st.pools["main"].pg_refs.copy()
    dst = st.next_bundle
    apply(st, ev.Activate(dst, "main", 4, st.pools["main"].free_rows.first(), 256, 0, 0))
    with pytest.raises(AssertionError, match="outside"):
        apply(st, ev.Fork(ck, dst, "main", full, full * 64))
    assert (st.pools["main"].pg_refs == refs).all()
    s.release(big)
    step(s)
    a = s.activate(64, 1)
    s.ensure_mapped(a, "main", 64)
    step(s)
    s.commit(a, "main", 64)
    st = copy.deepcopy(s.state)
    with pytest.raises(AssertionError, match="Share"):
        apply(st, ev.Share(a, st.next_bundle, "main", full))
    s.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40),
                          st.tuples(st.integers(0, 1 << 40), st.integers(0, 9),
                                    st.integers(1, 64), st.integers(0, (1 << 32) - 1))),
                max_size=30))
def test_host_replicas_in_arrays_behave_as_a_dict(ops) -> None:
    """``host_of`` (slot -> replica over the ``pg_host_*`` arrays) against a dict: sets
    (a newer replica replaces the old), deletes, lookups, order, the count; a slot without a
    replica holds offset -1 and zeros, so the snapshot's page rows need no dict."""
    p = PoolState("main", 16, 2, 8)
    model: dict[int, tuple[int, int, int, int]] = {}
    for put, slot, replica in ops:
        if put:
            p.host_of[slot] = replica
            model[slot] = replica
        elif slot in model:
            del p.host_of[slot]
            del model[slot]
        else:
            with pytest.raises(KeyError):
                del p.host_of[slot]
        assert dict(p.host_of.items()) == model and list(p.host_of) == sorted(model)
        assert len(p.host_of) == len(model) and bool(p.host_of) == bool(model)
        assert all((s in p.host_of) == (s in model) and p.host_of.get(s) == model.get(s)
                   for s in range(-1, 42))
        none = p.pg_host_off < 0
        assert (p.pg_host_off[none] == NO_PAGE).all()
        assert not (p.pg_host_epoch[none].any() or p.pg_host_cov[none].any()
                    or p.pg_host_crc[none].any())
    p.host_of.recount()
    assert len(p.host_of) == len(model)
    with pytest.raises(AssertionError, match="offset -1"):
        p.host_of[3] = (-1, 0, 0, 0)


def test_the_page_fields_are_rows_of_one_matrix_through_growth_copy_and_pickle() -> None:
    """``pg_*`` are the rows of ``PoolState.pg`` (the compiled loops take the matrix, the
    Python code the rows): after the arrays grow, and in a deep copy or a pickle, a write
    through a row is the matrix's, and growth keeps every value and fills the new slots as
    never used. A copy taken field by field would let the two drift apart unseen."""
    p = PoolState("main", 16, 2, 8)
    for k, (name, _) in enumerate(PG_FIELDS):
        getattr(p, name)[3] = 100 + k
    p.ensure_slot(40)
    assert p.pg.shape == (len(PG_FIELDS), len(p.pg_live)) and len(p.pg_live) > 40
    for k, (name, fill) in enumerate(PG_FIELDS):
        row = getattr(p, name)
        assert row.base is p.pg and p.pg[k, 3] == 100 + k
        assert (p.pg[k, 16:] == fill).all()
        row[40] = 7 + k
        assert p.pg[k, 40] == 7 + k
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p))):
        assert np.array_equal(q.pg, p.pg)
        for k, (name, _) in enumerate(PG_FIELDS):
            getattr(q, name)[5] = -50 - k
            assert q.pg[k, 5] == -50 - k and p.pg[k, 5] != -50 - k
