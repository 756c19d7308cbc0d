"""``scan_memberships`` (the full §14 check's compiled membership pass) against a plain-Python
oracle on random, partly damaged memberships: dead, negative and out-of-range slots, a slot
twice, short columns, pages without a device replica, lengths past the membership array."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.engine import invariant_kernels as ik
from ninfer_kv.engine.bundle_table import from_dense
from ninfer_kv.engine.layout import P

NO_PAGE = -1


def oracle(bundles, idx, members, nmem, committed, active, n_slots, live, pg_committed,
           device):
    size = max([n_slots, *(int(members[i, j]) + 1 for i in idx
                           for j in range(min(max(nmem[i], 0), members.shape[1])))])
    refs, arefs = [0] * size, [0] * size
    twice, keys, problems = [], [], []
    for k, i in enumerate(idx):
        m = int(nmem[i])
        row = [int(x) for x in members[i, :max(m, 0)]]
        twice.append(len(set(row)) != m)
        c = int(committed[i])
        for j, s in enumerate(row):
            alive = 0 <= s < n_slots and bool(live[s])
            if not alive:
                problems.append((k, j, ik.DEAD, 0))
            if s < 0:
                continue
            refs[s] += 1
            if active[i]:
                arefs[s] += 1
                keys.append(int(bundles[k]) * size + s)
            if not alive:
                continue
            need = min(max(c - P * j, 0), P)
            if pg_committed[s] < need:
                problems.append((k, j, ik.SHORT, need))
            if active[i] and device[s] == NO_PAGE:
                problems.append((k, j, ik.NO_DEVICE, 0))
    return refs, arefs, twice, keys, problems


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 12), st.randoms(use_true_random=False))
def test_scan_memberships_matches_oracle(n_spaces: int, n_slots: int, rnd) -> None:
    width = 4
    members = np.array([[rnd.randint(-1, n_slots + 1) for _ in range(width)]
                        for _ in range(n_spaces + 1)], np.int32)
    nmem = np.array([rnd.randint(-1, width + 1) for _ in range(n_spaces + 1)], np.int64)
    committed = np.array([rnd.randint(0, (width + 1) * P) for _ in range(n_spaces + 1)],
                         np.int64)
    active = np.array([rnd.random() < 0.6 for _ in range(n_spaces + 1)], np.bool_)
    idx = np.array(rnd.sample(range(n_spaces + 1), n_spaces), np.int64)
    bundles = np.array(rnd.sample(range(100), n_spaces), np.int64)
    live = np.array([rnd.random() < 0.8 for _ in range(n_slots + 2)], np.bool_)
    pg_committed = np.array([rnd.randint(0, P) for _ in range(n_slots + 2)], np.int64)
    device = np.array([rnd.choice([NO_PAGE, 3, 7]) for _ in range(n_slots + 2)], np.int64)
    args = (bundles, idx, members, nmem, committed, active, n_slots, live, pg_committed,
            device)
    refs, arefs, twice, keys, problems = ik.scan_memberships(*args, NO_PAGE)
    want = oracle(*args)
    # a length past the membership array is a "slot twice" too (fewer distinct than nmem)
    want_twice = [w or bool(nmem[i] > width) for w, i in zip(want[2], idx, strict=True)]
    assert refs.tolist() == want[0] and arefs.tolist() == want[1]
    assert twice.tolist() == want_twice
    assert keys.tolist() == want[3]
    assert [tuple(r) for r in problems.tolist()] == want[4]


def test_a_negative_slot_twice_is_a_slot_twice() -> None:
    """A negative member names no page (it is not counted), but listed twice the membership
    still holds a slot twice, as ``len(set(members)) != nmem`` says (the mutation check's
    survivor: the random memberships above rarely repeat -1 where nothing else flags)."""
    for row, want in (([-1, -1, 0, 1], True), ([-1, 2, 0, 1], False), ([0, -1, 1, -1], True)):
        _, _, twice, _, problems = ik.scan_memberships(
            np.array([5], np.int64), np.array([0], np.int64), np.array([row], np.int32),
            np.array([4], np.int64), np.array([0], np.int64), np.array([False]), 3,
            np.ones(3, np.bool_), np.zeros(3, np.int64), np.zeros(3, np.int64), NO_PAGE)
        assert twice.tolist() == [want]
        assert [r[2] for r in problems.tolist()] == [ik.DEAD] * row.count(-1) + \
            [ik.DEAD] * sum(1 for s in row if s >= 3)


def oracle_commit(bundles, bundle_index, committed, nmem, protected, members, n_slots, live,
                  pg_committed, pg_protected, mirror):
    """The incremental checker's Python CommitFrontiers check this kernel replaced."""
    rows = []
    for b in bundles:
        k = bundle_index[b] if 0 <= b < len(bundle_index) else -1
        oc = mirror[b] if 0 <= b < len(mirror) else ik.ABSENT
        if k < 0 or oc == ik.ABSENT:
            rows.append((ik.C_NO_SPACE, b))
            continue
        c, m = int(committed[k]), int(nmem[k])
        mirror[b] = c
        if not protected[k] <= c <= m * P:
            rows.append((ik.C_ORDER, b, int(protected[k]), c, m * P))
        lo, hi = (oc // P, -(-c // P)) if oc < c else (c // P, -(-oc // P))
        for i in range(max(lo, 0), min(hi, m, members.shape[1])):
            s = int(members[k, i])
            if s < 0:
                return rows + [(ik.C_NEGATIVE, s)]
            if s >= n_slots or not live[s]:
                rows.append((ik.C_DEAD, b, i, s))
                continue
            pc, pr = int(pg_committed[s]), int(pg_protected[s])
            if pc < min(c - i * P, P):
                rows.append((ik.C_SHORT, b, i, s, pc, min(c - i * P, P)))
            if not 0 <= pr <= pc <= P:
                rows.append((ik.C_RANGE, s, pr, pc))
    return rows


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.randoms(use_true_random=False))
def test_check_commit_matches_oracle(n: int, rnd) -> None:
    """Random pools (dead slots, short or inverted columns, a negative member, frontiers out
    of order, spaces the mirror does not know) and a commit of some of their bundles, twice
    over the same mirror (the second pass sees the frontiers the first recorded)."""
    width, n_slots = 4, 10
    members = np.array([[rnd.randint(-1 if rnd.random() < 0.1 else 0, n_slots + 1)
                         for _ in range(width)] for _ in range(n)], np.int32)
    nmem = np.array([rnd.randint(0, width) for _ in range(n)], np.int64)
    committed = np.array([rnd.randint(-3, width * P + 3) for _ in range(n)], np.int64)
    protected = np.array([rnd.randint(0, 2 * P) for _ in range(n)], np.int64)
    bundle_index = np.full(12, -1, np.int64)
    for k, b in enumerate(rnd.sample(range(12), n)):
        bundle_index[b] = k
    live = np.array([rnd.random() < 0.85 for _ in range(n_slots + 1)], np.bool_)
    pg_committed = np.array([rnd.randint(0, P + 1) for _ in range(n_slots + 1)], np.int64)
    pg_protected = np.array([rnd.randint(-1, P + 1) for _ in range(n_slots + 1)], np.int64)
    mirror = np.array([rnd.choice([ik.ABSENT, rnd.randint(-3, width * P)])
                       for _ in range(10)], np.int64)  # shorter than the bundle ids
    bundles = [rnd.randint(-1, 12) for _ in range(rnd.randint(1, 6))]
    args = (bundle_index, committed, nmem, protected, members, n_slots, live, pg_committed,
            pg_protected)
    want_mirror = mirror.copy()  # the oracle's, indexed by bundle
    # the checker's mirror holds bundle b at entry at[b] (not b: ids and entries differ)
    at = np.array(rnd.sample(range(16), len(mirror)), np.int64)
    entries = np.full(16, ik.ABSENT, np.int64)
    entries[at] = mirror
    for _ in range(2):
        got = ik.check_commit(np.array(bundles, np.int32).tobytes(), from_dense(bundle_index),
                              *args[1:], from_dense(at), entries)
        want = oracle_commit(bundles, *args, want_mirror)
        assert [tuple(r[:len(w)]) for r, w in zip(got.tolist(), want, strict=True)] == want
        assert entries[at].tolist() == want_mirror.tolist()


def test_check_commit_stops_at_a_negative_member() -> None:
    """A negative slot in a block the commit crossed is reported as the last row (the caller
    then raises IndexError naming it, as a page view read does): never read as an index
    (numba would wrap it to the last page)."""
    members = np.array([[0, -1, 1, 2]], np.int32)
    live = np.ones(3, np.bool_)
    live[2] = False  # the last slot: what a wrapped index would read
    mirror = np.array([10], np.int64)
    rows = ik.check_commit(np.array([0], np.int32).tobytes(), from_dense(np.array([0])),
                           np.array([3 * P], np.int64), np.array([4], np.int64),
                           np.array([0], np.int64), members, 3, live,
                           np.full(3, P, np.int64), np.zeros(3, np.int64),
                           from_dense(np.array([0])), mirror)
    assert rows.tolist()[-1][:2] == [ik.C_NEGATIVE, -1]
    assert [r[0] for r in rows.tolist()] == [ik.C_NEGATIVE]  # block 0 is fine, block 1 stops


def blocks_oracle(members: list[int], c: int, lo: int, hi: int, k: int, n_slots: int,
                  live: np.ndarray, committed: np.ndarray, protected: np.ndarray
                  ) -> list[tuple[int, ...]] | str:
    """The incremental checker's frontier-block loop before it was compiled (a list read
    per block, so a negative block counts from the end and a block past the membership or
    a negative slot raises)."""
    rows: list[tuple[int, ...]] = []
    for i in range(lo, hi):
        try:
            s = members[i]
        except IndexError:
            return "index"
        if s < 0:
            return "index"
        if s >= n_slots or not live[s]:
            if i < k:
                rows.append((ik.B_DEAD, i, s))
            continue
        pc, need = int(committed[s]), min(c - i * P, P)
        if pc < need:
            rows.append((ik.B_SHORT, i, s, pc, need))
        if i < k and not 0 <= protected[s] <= pc <= P:
            rows.append((ik.B_RANGE, i, s, int(protected[s]), pc))
    return rows


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_check_blocks_matches_the_list_loop(data: st.DataObject) -> None:
    """Random memberships (dead, negative and far slots), frontiers (negative ones too) and
    block ranges past either end."""
    n_slots = data.draw(st.integers(0, 12))
    members = data.draw(st.lists(st.integers(-2, 14), max_size=8))
    live = np.array(data.draw(st.lists(st.booleans(), min_size=16, max_size=16)))
    committed = np.array(data.draw(st.lists(st.integers(-1, P + 1), min_size=16, max_size=16)))
    protected = np.array(data.draw(st.lists(st.integers(-1, P + 1), min_size=16, max_size=16)))
    c = data.draw(st.integers(-2 * P, 9 * P))
    lo = data.draw(st.integers(-10, 9))
    hi = data.draw(st.integers(lo, 10))
    k = data.draw(st.integers(0, 9))
    row = np.full(10, 3, np.int32)  # the pool's member row, longer than the membership
    row[:len(members)] = members
    got = ik.check_blocks(row, len(members), c, lo, hi, k, n_slots, live, committed, protected)
    want = blocks_oracle(members, c, lo, hi, k, n_slots, live, committed, protected)
    rows = [tuple(r[:{ik.B_DEAD: 3}.get(r[0], 5)]) for r in got.tolist()]
    if want == "index":
        assert rows and rows[-1][0] == ik.B_INDEX, rows
    else:
        assert rows == want


def test_the_writer_check_reads_the_mirror_by_id_not_by_entry() -> None:
    """``check_slots``' writer rule asks whether the writer is an active space of the mirror:
    through its bundle table (ids 1000 and 2000 at entries 3 and 5), never by id or entry
    number directly."""
    table = from_dense(np.array([-1] * 1000 + [3] + [-1] * 999 + [5]))
    active = np.zeros(8, np.int8)
    active[3] = 1
    assert ik._active(table, active, 1000)
    assert not ik._active(table, active, 2000)            # held, not active
    assert not ik._active(table, active, 3)               # an entry number is no id
    assert not ik._active(table, active, -1)
    assert not ik._active(table, np.zeros(2, np.int8), 1000)  # an entry past the array
