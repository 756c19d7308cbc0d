"""The decode round's compiled kernels (engine/round_kernels.py) and apply's
(engine/apply_kernels.py, engine/page_life_kernels.py) against plain-Python oracles written
from the rules they implement (§8.1, §8.2, §9.4), or against the steps a fused kernel
replaces, on random pool arrays."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer_kv.engine import apply_kernels as ak
from ninfer_kv.engine import page_life
from ninfer_kv.engine import page_life_kernels as plk
from ninfer_kv.engine import round_kernels as rk
from ninfer_kv.engine.bundle_table import from_dense
from ninfer_kv.engine.decode import writable
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import PG_ROWS
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.journal.events import pack

I64 = np.int64


def pg_matrix(**rows: np.ndarray) -> np.ndarray:
    """A ``PoolState.pg`` holding ``rows`` (``writer=...``: row ``PG_WRITER``), zeros else."""
    n = max(len(r) for r in rows.values())
    pg = np.zeros((len(PG_ROWS), n), I64)
    for name, r in rows.items():
        pg[PG_ROWS.index(name.upper()), :len(r)] = r
    return pg


def oracle_resolve(bundles, bundle_index, sp_active):
    seen = set()
    for j, b in enumerate(bundles):
        i = bundle_index[b] if 0 <= b < len(bundle_index) else -1
        if i < 0 or not sp_active[i]:
            return rk.UNKNOWN, j
        if i in seen:
            return rk.DUPLICATE, j
        seen.add(i)
    return rk.OK, -1


@st.composite
def pools(draw):
    """A pool's space arrays: n spaces, some active, a bundle -> space map with holes."""
    n = draw(st.integers(1, 6))
    sp_active = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    nb = draw(st.integers(n, n + 4))
    order = draw(st.permutations(list(range(nb))))
    bundle_index = np.full(nb, -1, I64)
    for s, b in enumerate(order[:n]):
        bundle_index[b] = s
    return bundle_index, sp_active


@settings(max_examples=300, deadline=None)
@given(pools(), st.lists(st.integers(-2, 12), max_size=8))
def test_resolve_matches_oracle(pool, bundles):
    bundle_index, sp_active = pool
    b = np.array(bundles, I64)
    idx, code, j = rk.resolve(b, from_dense(bundle_index), sp_active)
    assert (code, j) == oracle_resolve(bundles, bundle_index, sp_active)
    if code == rk.OK:
        assert idx.tolist() == [int(bundle_index[x]) for x in bundles]


def test_resolve_refuses_a_bundle_without_space_even_when_the_last_space_is_active():
    """bundle_index -1 must not wrap around to the last space (numpy's a[-1])."""
    idx, code, j = rk.resolve(np.array([0], I64), from_dense(np.array([-1, 0], I64)),
                             np.array([True]))
    assert (code, j) == (rk.UNKNOWN, 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-70, 700), st.integers(0, 8), st.integers(0, 10)),
                min_size=1, max_size=6), st.integers(1, 10))
def test_plan_mapping_matches_oracle(rows, logical_pages):
    tokens = np.array([r[0] for r in rows], I64)
    nmem = np.array([min(r[1], logical_pages) for r in rows], I64)
    ent = np.array([r[2] for r in rows], I64)
    idx = np.arange(len(rows), dtype=I64)
    total, code, j = rk.plan_mapping(idx, tokens, nmem, ent, logical_pages)
    want_total, want = 0, (rk.OK, -1)
    for k, t in enumerate(tokens.tolist()):
        need = -(-t // P)
        if t < 0 or t > logical_pages * P:
            want = (rk.FRONTIER, k)
            break
        if need > nmem[k]:
            if need > ent[k]:
                want = (rk.ENTITLEMENT, k)
                break
            want_total += need - int(nmem[k])
    assert (code, j) == want
    if code == rk.OK:
        assert total == want_total
    # map_round: the same verdict, and on a passing plan the new pages, in batch order
    bundles = np.arange(100, 100 + len(rows), dtype=I64)
    free = np.zeros(8, np.bool_)
    free[[1, 4, 5]] = True
    groups = np.ones(64, np.bool_)
    bundle_index = np.full(100 + len(rows), -1, I64)
    bundle_index[bundles] = idx
    active = np.ones(len(rows), np.bool_)
    code2, j2, i2, n2, g, _, _, out = rk.map_round(
        bundles, from_dense(bundle_index), active, tokens, nmem, ent, logical_pages, free, 0, 3, 8,
        groups, 0, 64)
    assert (code2, j2) == want
    assert i2 == (j2 if code2 in (rk.FRONTIER, rk.ENTITLEMENT) else -1)  # its space
    assert out.dtype == np.int32
    if code != rk.OK:
        assert n2 == g == len(out) == 0
        return
    assert n2 == total and len(out) == 3 * total + 2 * g
    need_b, slots, pages = out[:total], out[total:2 * total], out[2 * total:3 * total]
    grown, firsts = out[3 * total:3 * total + g], out[3 * total + g:]
    grow = [(100 + k, int(nmem[k]), -(-t // P)) for k, t in enumerate(tokens.tolist())
            if -(-t // P) > nmem[k]]
    assert need_b.tolist() == [b for b, have, need in grow for _ in range(need - have)]
    assert grown.tolist() == [b for b, _, _ in grow]
    assert firsts.tolist() == [have for _, have, _ in grow]
    assert slots.tolist() == ([1, 4, 5] + list(range(8, 8 + total)))[:total]
    assert pages.tolist() == (list(range(min(total, 64))) + [-1] * total)[:total]


@st.composite
def commits(draw):
    """Spaces with memberships over distinct slots, page fields, and a commit batch."""
    n = draw(st.integers(1, 4))
    nmem = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    slots = draw(st.permutations(list(range(sum(nmem)))))
    members = np.full((n, 3), -1, np.int32)
    k = 0
    for i, m in enumerate(nmem):
        members[i, :m] = slots[k:k + m]
        k += m
    committed = [draw(st.integers(0, m * P)) for m in nmem]
    ns = sum(nmem)
    bundles = np.array(draw(st.permutations(list(range(10, 10 + n)))), I64)
    owner = {int(members[i, b]): int(bundles[i]) for i in range(n) for b in range(nmem[i])}
    writer = np.array([draw(st.sampled_from([owner[s], -1, 99])) for s in range(ns)], I64)
    pins = np.array(draw(st.lists(st.sampled_from([0, 0, 0, 1]), min_size=ns, max_size=ns)),
                    I64)
    protected = np.array(draw(st.lists(st.integers(0, P), min_size=ns, max_size=ns)), I64)
    frontiers = np.array([draw(st.integers(c - 3, m * P + 3)) for c, m in
                          zip(committed, nmem, strict=True)],
                         I64)
    return (bundles, np.arange(n, dtype=I64), frontiers, np.array(committed, I64),
            np.array(nmem, I64), members, writer, pins, protected)


def oracle_check_commit(bundles, idx, frontiers, committed, nmem, members, writer, pins,
                        protected):
    for j in range(len(idx)):
        i, f, old = idx[j], frontiers[j], committed[idx[j]]
        if not old <= f <= nmem[i] * P:
            return rk.FRONTIER, j, -1
        for blk in range(old // P, -(-f // P)):
            first = old - blk * P if blk == old // P else 0
            s = members[i, blk]
            page = SimpleNamespace(writer=writer[s], pins=pins[s], protected=protected[s])
            if not writable(page, bundles[j], first):  # §9.4
                return rk.WRITE, j, blk
    return rk.OK, -1, -1


@settings(max_examples=400, deadline=None)
@given(commits())
def test_check_commit_matches_oracle(args):
    got = rk.check_commit(*args)
    assert tuple(int(x) for x in got) == oracle_check_commit(*args)
    # commit_round: resolve (bundle -> space) first, then the same verdict
    bundles, idx, *rest = args
    bundle_index = np.full(int(bundles.max()) + 2, -1, I64)
    bundle_index[bundles] = idx
    active = np.ones(len(idx), np.bool_)
    pg = pg_matrix(writer=rest[4], pins=rest[5], protected=rest[6])
    code, j, blk, i, out = rk.commit_round(bundles, from_dense(bundle_index), active, rest[0],
                                           *rest[1:4], pg, 1 << 40)
    assert (int(code), int(j), int(blk)) == oracle_check_commit(*args)
    assert i == (idx[j] if code != rk.OK else -1)  # the space the refusal names
    if code == rk.OK:  # CommitFrontiers' two fields, as pack writes them
        assert out.tobytes() == pack(bundles) + pack(rest[0])
    else:
        assert len(out) == 0
    active[idx[-1]] = False  # an inactive checkpoint is refused before any frontier rule
    code, j, _, _, _ = rk.commit_round(bundles, from_dense(bundle_index), active, rest[0],
                                       *rest[1:4], pg, 1 << 40)
    assert (code, j) == oracle_resolve(bundles.tolist(), bundle_index, active)


@settings(max_examples=300, deadline=None)
@given(commits(), st.booleans(), st.integers(-1, 12))
def test_apply_commit_matches_oracle(args, repeat: bool, dead: int):
    """Applied in event order; an element below the frontier its space has by then (a commit
    only advances), past its membership, or writing a block whose slot is no live page it
    writes (a damaged state: §9.4's single writer) refuses the whole event, unchanged."""
    bundles, idx, frontiers, committed, nmem, members, writer, *_ = args
    if repeat and len(bundles) > 1:  # the first space listed twice
        bundles, idx = np.append(bundles, bundles[0]), np.append(idx, idx[0])
        frontiers = np.append(frontiers, frontiers[0] - 1)
    bundle_index = np.full(20, -1, I64)
    bundle_index[bundles] = idx
    active = np.ones(len(committed), np.bool_)
    pg = np.zeros(members.max() + 1, I64)
    live = np.ones(len(pg), np.bool_)
    if 0 <= dead < len(live):
        live[dead] = False
    want_pg, want_sp = pg.copy(), committed.copy()
    want_bad = -1
    for j in range(len(bundles)):  # the rule, in event order
        i, f = idx[j], int(frontiers[j])
        blocks = range(int(want_sp[i]) // P, -(-f // P))
        if not want_sp[i] <= f <= nmem[i] * P or any(
                not live[members[i, blk]] or writer[members[i, blk]] != bundles[j]
                for blk in blocks):
            want_bad = j
            break
        for blk in blocks:
            want_pg[members[i, blk]] = min(P, f - blk * P)
        want_sp[i] = f
    if want_bad >= 0:
        want_pg, want_sp = pg.copy(), committed.copy()
    got = ak.apply_commit(bundles, frontiers, from_dense(bundle_index), committed, nmem, members, pg, active,
                          live, writer)
    assert got == want_bad
    assert pg.tolist() == want_pg.tolist() and committed.tolist() == want_sp.tolist()


def _writable(members: np.ndarray, bundles: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """pg_live and pg_writer for ``members``: every slot a live page its row's bundle writes."""
    n = int(members.max()) + 1
    writer = np.full(n, -1, I64)
    for i, b in enumerate(bundles):
        row = members[i][members[i] >= 0]
        writer[row] = b
    return np.ones(n, np.bool_), writer


def test_apply_commit_into_an_inactive_space_applies_nothing() -> None:
    committed = np.array([5, 5], I64)
    pg = np.zeros(4, I64)
    members = np.array([[0, 1], [2, 3]], np.int32)
    bad = ak.apply_commit(np.array([0, 1], I64), np.array([9, 9], I64), from_dense(np.arange(2)),
                          committed, np.array([2, 2], I64), members, pg, np.array([True, False]),
                          *_writable(members, [0, 1]))
    assert bad == 1 and committed.tolist() == [5, 5] and pg.tolist() == [0, 0, 0, 0]


def test_apply_commit_of_an_unknown_seq_applies_nothing():
    committed = np.array([5], I64)
    pg = np.zeros(2, I64)
    members = np.array([[0, 1]], np.int32)
    bad = ak.apply_commit(np.array([0, 7], I64), np.array([9, 9], I64), from_dense(np.arange(1)),
                          committed, np.array([2], I64), members, pg, np.ones(1, np.bool_),
                          *_writable(members, [0]))
    assert bad == 1 and committed.tolist() == [5] and pg.tolist() == [0, 0]



def test_apply_commit_past_the_membership_applies_nothing() -> None:
    """Review finding: the apply loop read the -1 fill past a space's membership and wrote
    pg_committed[-1] (or the next space's row). A frontier outside [0, membership] is now a
    damaged record: nothing applied, the caller asserts."""
    committed = np.array([0, 0], I64)
    members = np.array([[0, 1, -1], [2, 3, -1]], np.int32)
    pg = np.zeros(4, I64)
    bad = ak.apply_commit(np.array([0, 1], I64), np.array([10, 3 * P + 1], I64),
                          from_dense(np.arange(2)), committed, np.array([2, 2], I64), members, pg,
                          np.ones(2, np.bool_), *_writable(members, [0, 1]))
    assert bad == 1 and committed.tolist() == [0, 0] and pg.tolist() == [0, 0, 0, 0]


@settings(max_examples=300, deadline=None)
@given(pools(), st.lists(st.tuples(st.integers(-2, 12), st.integers(-1, 3)), max_size=8),
       st.lists(st.integers(-1, 5), min_size=6, max_size=6))
@example((np.array([0], I64), np.array([True])), [(0, 1)], [-1, 0, 0, 0, 0, 0])  # BAD_LENGTH
def test_materialize_plan_matches_oracle(pool, pages, nmem):
    """apply(Materialize)'s checks: every bundle has a space, an active one, every new page
    a page group, and its space a membership of length >= 0 (a damaged state: refused here,
    before any page is taken); the width is the longest membership after the appends."""
    bundle_index, sp_active = pool
    sp_nmem = np.array(nmem[:len(sp_active)], I64)
    b = np.array([x for x, _ in pages], I64)
    devs = np.array([d for _, d in pages], I64)
    idx, code, j, width = ak.materialize_plan(b, devs, from_dense(bundle_index), sp_active, sp_nmem)
    want, grown = (rk.OK, -1), sp_nmem.copy()
    for k, (x, d) in enumerate(pages):
        i = bundle_index[x] if 0 <= x < len(bundle_index) else -1
        if i < 0 or not sp_active[i] or d < 0 or sp_nmem[i] < 0:
            want = (ak.NO_SPACE if i < 0 else ak.INACTIVE if not sp_active[i] else ak.NO_GROUP
                    if d < 0 else ak.BAD_LENGTH, k)
            break
        grown[i] += 1
    assert (code, j) == want
    if code == rk.OK:
        assert idx.tolist() == [int(bundle_index[x]) for x, _ in pages]
        assert width == max([int(grown[i]) for i in idx.tolist()], default=0)


@pytest.mark.parametrize("damage", ["short", "long", "negative", "past"])
def test_apply_commit_refuses_a_damaged_membership(damage: str) -> None:
    """Called directly: ``apply_commit_raw`` (compiled) calls it, so a test through ``apply``
    would not see a change to it. Space 0 (seq 0) commits 3 pages' worth through a damaged
    membership; the arrays are views into larger ones, so a read or write past them lands in
    memory the test owns. Each refused, nothing changed: a length shorter than the row's
    valid slots ("short"), past the row ("long": block 3 would read the slot after the
    row), a negative slot wrapping onto the space's own page, a slot past the arrays."""
    members = np.full((2, 3), -1, np.int32)
    members[0] = [0, 1, 2]
    members[1] = [3, 4, 5]
    nmem = np.array([3, 3], I64)
    live_big, writer_big = np.ones(8, np.bool_), np.zeros(8, I64)  # seq 0 writes every slot
    pg_big = np.zeros(8, I64)
    live, writer, pg = live_big[:6], writer_big[:6], pg_big[:6]
    frontier = 3 * P
    if damage == "short":
        nmem[0] = 2
    elif damage == "long":  # one space, a row of 3; flat[3] lies past it (slot 3, seq 0's)
        flat = np.array([0, 1, 2, 3, -1, -1], np.int32)
        members = flat[:3].reshape(1, 3)
        nmem = np.array([4], I64)
        frontier = 4 * P
    elif damage == "negative":
        members[0, 2] = 1 - len(live)     # wraps onto slot 1, the space's own page
    else:
        members[0, 2] = len(live)         # one past the arrays: live, written by seq 0
    committed = np.zeros(len(nmem), I64)
    before = (members.copy(), committed.copy(), pg_big.copy())
    bad = ak.apply_commit(np.array([0], I64), np.array([frontier], I64),
                          from_dense(np.arange(len(nmem))), committed, nmem, members, pg,
                          np.ones(len(nmem), np.bool_), live, writer)
    assert bad == 0
    assert (members.tolist(), committed.tolist(), pg_big.tolist()) == tuple(
        a.tolist() for a in before)


def test_fork_pages_refuses_a_membership_past_its_row() -> None:
    """A length past the row (with a committed frontier to match, both damaged) would copy
    the next space's row into the destination and write past the destination's row."""
    flat = np.full(9, -1, np.int32)
    members = flat[:6].reshape(3, 2)   # rows of 2; flat[6:] is past the array
    members[0] = [0, 1]
    members[1] = [2, 3]
    sp_nmem = np.array([3, 2, 0], I64)
    sp_committed = np.array([3 * P, 2 * P, 0], I64)
    refs, active = np.ones(4, I64), np.zeros(4, I64)
    before = (flat.copy(), refs.copy(), active.copy(), sp_nmem.copy())
    code = ak.fork_pages(0, 2, 3, np.array([False, False, True]), sp_committed,
                         np.zeros(3, I64), np.zeros(3, I64), members, sp_nmem,
                         np.ones(4, np.bool_), refs, active)
    assert code == ak.FORK_DEAD_PAGE
    assert all((a == b).all() for a, b in zip(before, (flat, refs, active, sp_nmem), strict=True))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=10, unique=True), st.integers(0, 12 * P),
       st.integers(3, 5), st.lists(st.integers(-1, P), min_size=8, max_size=8),
       st.lists(st.integers(2, 6), min_size=8, max_size=8))
def test_retain_pages_matches_numpy(slots, committed, bundle, protected, writers):
    """Finish(retain)'s page half against the numpy form it replaced (blocks past the
    committed frontier keep their coverage), on a membership of distinct slots (the handler
    reads it through ``members_of``)."""
    s = np.array(slots, I64)
    active, writer, prot = np.full(8, 9, I64), np.array(writers, I64), np.array(protected, I64)
    want_active, want_writer, want_prot = active.copy(), writer.copy(), prot.copy()
    want_active[s] -= 1
    want_writer[s[want_writer[s] == bundle]] = -1
    np.maximum.at(want_prot, s, np.minimum(P, committed - P * np.arange(len(s), dtype=I64)))
    ak.retain_pages(s, bundle, committed, active, writer, prot)
    assert active.tolist() == want_active.tolist()
    assert writer.tolist() == want_writer.tolist()
    assert prot.tolist() == want_prot.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-9, 9), max_size=10), st.lists(st.booleans(), min_size=8, max_size=8))
def test_membership_fault_names_the_first_bad_block(slots, live):
    """A slot outside [0, 8) or dead, else the later block of the first repeat in block
    order; -1 for distinct live pages."""
    want = next((k for k, x in enumerate(slots) if not (0 <= x < 8 and live[x])), None)
    if want is None:
        want = next((k for k, x in enumerate(slots) if x in slots[:k]), -1)
    assert plk.membership_fault(np.array(slots, I64), np.array(live)) == want


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 4), st.integers(-1, 5), st.booleans(), st.integers(0, 5 * P),
       st.lists(st.booleans(), min_size=6, max_size=6), st.booleans(), st.booleans())
def test_fork_pages_matches_its_rules(nmem, full, src_active, committed, live, dst_has_pages,
                                      onto_itself):
    """apply(Fork)'s checks in order, nothing changed on a refusal; else the prefix shared."""
    members = np.full((2, 5), -1, np.int32)
    members[0, :nmem] = np.arange(nmem) + 1
    sp_nmem = np.array([nmem, 1 if dst_has_pages else 0], I64)
    sp_active = np.array([src_active, True])
    sp_committed = np.array([min(committed, nmem * P), 0], I64)
    sp_provisional, sp_protected = np.array([7, 5], I64), np.array([3, 2], I64)
    pg_live, refs, active = np.array(live), np.ones(6, I64), np.zeros(6, I64)
    arrays = (members, sp_nmem, sp_committed, sp_provisional, sp_protected, refs, active)
    before = [a.copy() for a in arrays]
    code = ak.fork_pages(0, 0 if onto_itself else 1, full, sp_active, sp_committed,
                         sp_provisional, sp_protected, members, sp_nmem, pg_live, refs, active)
    if src_active:
        want = ak.FORK_ACTIVE_SOURCE
    elif onto_itself or dst_has_pages or full * P > sp_committed[0]:
        want = ak.FORK_BAD_TARGET
    elif not 0 <= full <= nmem:
        want = ak.FORK_BAD_COUNT
    elif not all(live[1:nmem + 1]):  # the whole membership is read, not just the prefix
        want = ak.FORK_DEAD_PAGE
    else:
        want = rk.OK
    assert code == want
    if code != rk.OK:
        assert all((a == b).all() for a, b in zip(before, arrays, strict=True))
        return
    shared = list(range(1, full + 1))
    assert members[1, :full].tolist() == shared and sp_nmem[1] == full
    assert sp_committed[1] == sp_provisional[1] == sp_protected[1] == full * P  # §9.4
    assert (sp_provisional[0], sp_protected[0]) == (7, 3)  # the source's are its own
    assert refs.tolist() == [1 + (s in shared) for s in range(6)]
    assert active.tolist() == [int(s in shared) for s in range(6)]


def oracle_publish(bundles, starts, bundle_index, sp_active, sp_row, members, nmem, device,
                   tables, published):
    """``publish_rows`` from its rules: per touched sequence with an active space, its row's
    entries from ``start`` to its membership end map its pages' device groups, the entries
    an earlier write mapped after that end are unmapped."""
    done = []
    for b, start in zip(bundles, starts, strict=True):
        k = bundle_index[b] if 0 <= b < len(bundle_index) else -1
        if k < 0 or not sp_active[k]:
            continue
        r = sp_row[k]
        if not 0 <= r < len(tables):
            return len(done), done
        end = max(start, nmem[k])
        for i in range(start, end):
            tables[r][i] = device[members[k][i]]
        hi = max(end, published[r])
        for i in range(end, hi):
            tables[r][i] = -1
        published[r] = end
        done.append([r, start, hi])
    return -1, done


@st.composite
def publications(draw):
    """A pool of spaces (some inactive, rows distinct), device groups per slot, a table with
    earlier writes in it, and a batch of touched sequences (unknown and negative ids too)."""
    bundle_index, sp_active = draw(pools())
    n, L, rows = len(sp_active), 6, 8
    nslots = 20
    device = np.array(draw(st.lists(st.integers(0, 50), min_size=nslots, max_size=nslots)), I64)
    nmem = np.array(draw(st.lists(st.integers(0, L), min_size=n, max_size=n)), I64)
    members = np.array(draw(st.lists(st.lists(st.integers(0, nslots - 1), min_size=L,
                                              max_size=L), min_size=n, max_size=n)), np.int32)
    sp_row = np.array(draw(st.permutations(list(range(rows))))[:n], I64)
    published = np.array(draw(st.lists(st.integers(0, L), min_size=rows, max_size=rows)), I64)
    tables = np.full((rows, L), -1, I64)
    for r in range(rows):
        tables[r, :published[r]] = draw(st.integers(0, 50))
    nb = len(bundle_index)
    touched = draw(st.lists(st.integers(-2, nb + 2), unique=True, max_size=6))
    starts = [draw(st.integers(0, L)) for _ in touched]
    return (np.array(touched, I64), np.array(starts, I64), bundle_index, sp_active, sp_row,
            members, nmem, device, tables, published)


@settings(max_examples=300, deadline=None)
@given(publications())
def test_publish_rows_matches_oracle(args):
    """Unknown, negative and inactive sequences are skipped; every written row ends where
    its membership (or its start) ends and holds nothing mapped after that."""
    b, s, bundle_index, sp_active, sp_row, members, nmem, device, tables, published = args
    want_t, want_p = tables.tolist(), published.tolist()
    want = oracle_publish(b.tolist(), s.tolist(), bundle_index.tolist(), sp_active.tolist(),
                          sp_row.tolist(), members.tolist(), nmem.tolist(), device.tolist(),
                          want_t, want_p)
    bad, done = rk.publish_rows(b, s, from_dense(bundle_index), sp_active, sp_row, members, nmem, device,
                                tables, published, np.ones(len(device), np.bool_))
    assert (bad, done.tolist()) == want
    assert tables.tolist() == want_t and published.tolist() == want_p


def test_publish_rows_stops_at_a_row_outside_the_table() -> None:
    """An active space whose row is past the table (only a damaged state holds one) is
    reported, and neither it nor anything after it is written (numba does not bounds-check:
    the write would land in another row's memory)."""
    bundle_index = np.array([0, 1], I64)
    members = np.zeros((2, 2), np.int32)
    tables, published = np.full((2, 2), -1, I64), np.zeros(2, I64)
    for row in (2, -1):
        bad, done = rk.publish_rows(np.array([0, 1], I64), np.zeros(2, I64), from_dense(bundle_index),
                                    np.array([True, True]), np.array([row, 1], I64), members,
                                    np.array([1, 1], I64), np.array([7], I64), tables, published,
                                    np.ones(1, np.bool_))
        assert (bad, done.tolist()) == (0, [])
        assert (tables == -1).all() and (published == 0).all()


@pytest.mark.parametrize("damage", ["dead", "negative", "past the pages", "past the row"])
def test_publish_rows_stops_at_a_damaged_membership(damage: str) -> None:
    """Seq 1's membership (row 1) is damaged; seq 0's row is written and reported, seq 1's
    is not touched. Unchecked, a negative slot wraps onto another page group and a length
    past the row writes into the next row's memory (views into a larger table here)."""
    bundle_index = np.array([0, 1], I64)
    members = np.array([[0, 1], [2, 3], [0, 0]], np.int32)[:2]  # [1, 2] reads a live slot 0
    nmem = np.array([2, 2], I64)
    live = np.ones(4, np.bool_)
    big = np.full((3, 2), -1, I64)
    tables, published = big[:2], np.zeros(2, I64)
    if damage == "dead":
        live[3] = False
    elif damage == "negative":
        members[1, 1] = 1 - len(live)     # wraps onto slot 1, seq 0's page
    elif damage == "past the pages":
        members[1, 1] = len(live)
    else:
        nmem[1] = 3
    bad, done = rk.publish_rows(np.array([0, 1], I64), np.zeros(2, I64), from_dense(bundle_index),
                                np.array([True, True]), np.array([0, 1], I64), members, nmem,
                                np.array([10, 11, 12, 13, 14], I64), tables, published, live)
    assert (bad, done.tolist()) == (1, [[0, 0, 2]])
    assert big.tolist() == [[10, 11], [-1, -1], [-1, -1]] and published.tolist() == [2, 0]


@st.composite
def provisionals(draw):
    """A pool of spaces with memberships, and a batch of (seq, provisional frontier) pairs:
    unknown, negative and repeated seqs, frontiers around [0, membership]."""
    bundle_index, sp_active = draw(pools())
    n = len(sp_active)
    nmem = np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), I64)
    nb = len(bundle_index)
    k = draw(st.integers(0, 6))
    bundles = [draw(st.integers(-2, nb + 1)) for _ in range(k)]
    edge = st.sampled_from([-1, 0, P, 4 * P, 4 * P + 1])  # where a rule's edge lies
    frontiers = [draw(st.one_of(edge, st.integers(-2, 4 * P + 2))) for _ in range(k)]
    return np.array(bundles, I64), np.array(frontiers, I64), bundle_index, sp_active, nmem


def oracle_provisional_verdict(bundles, frontiers, bundle_index, sp_active, nmem):
    """§8.2: each seq an active space, each frontier within [0, its membership]."""
    for j, (b, f) in enumerate(zip(bundles, frontiers, strict=True)):
        i = bundle_index[b] if 0 <= b < len(bundle_index) else -1
        if i < 0 or not sp_active[i] or not 0 <= f <= nmem[i] * P:
            return j
    return -1


@settings(max_examples=400, deadline=None)
@given(provisionals())
def test_provisional_round_matches_oracle(args):
    """The command refuses an unknown or repeated seq (``resolve``), then a frontier outside
    [0, membership]; on success its output is the event's two packed fields."""
    bundles, frontiers, bundle_index, sp_active, nmem = args
    code, j, i, out = rk.provisional_round(bundles, from_dense(bundle_index), sp_active, frontiers, nmem)
    rcode, rj = oracle_resolve(bundles.tolist(), bundle_index, sp_active)
    if rcode != rk.OK:
        assert (code, j, len(out)) == (rcode, rj, 0)
        return
    bad = oracle_provisional_verdict(bundles.tolist(), frontiers.tolist(), bundle_index,
                                     sp_active, nmem)
    if bad >= 0:
        assert (code, j, i, len(out)) == (rk.FRONTIER, bad, bundle_index[bundles[bad]], 0)
    else:
        assert (code, j) == (rk.OK, -1) and out.tobytes() == pack(bundles) + pack(frontiers)


@settings(max_examples=400, deadline=None)
@given(provisionals())
def test_apply_provisional_matches_oracle(args):
    """apply sets each space's provisional frontier in event order (a repeated seq keeps its
    last), or, for a damaged event, names the first bad element and changes nothing."""
    bundles, frontiers, bundle_index, sp_active, nmem = args
    prov = np.arange(len(sp_active), dtype=I64) + 1000
    want = prov.copy()
    bad = oracle_provisional_verdict(bundles.tolist(), frontiers.tolist(), bundle_index,
                                     sp_active, nmem)
    if bad < 0:
        for b, f in zip(bundles.tolist(), frontiers.tolist(), strict=True):
            want[bundle_index[b]] = f
    got = ak.apply_provisional(pack(bundles), pack(frontiers), from_dense(bundle_index), sp_active, nmem,
                               prov)
    assert got == bad and prov.tolist() == want.tolist()
    assert ak.apply_provisional(pack(bundles), pack([*frontiers.tolist(), 0]), from_dense(bundle_index),
                                sp_active, nmem, prov) == ak.COMMIT_LENGTHS
    raw = pack(bundles) + b"\0\0"    # equally long fields, not whole int32s
    assert ak.apply_provisional(raw, raw, from_dense(bundle_index), sp_active, nmem,
                                prov) == ak.COMMIT_LENGTHS
    assert prov.tolist() == want.tolist()


@st.composite
def drop_cases(draw):
    """A 16-slot pool with random page arrays and free lists and one space (index 0, seq 3)
    whose membership may break any rule: dead, repeated or out-of-range slots, a length
    past its row, pages without references or whose slot or page group is free already."""
    p = PoolState("main", 16, 2, 8)
    n = 16
    for name, lo, hi in (("pg_refs", 0, 2), ("pg_pins", 0, 1), ("pg_active", 0, 2),
                         ("pg_writer", -1, 4), ("pg_device", -1, 15)):
        getattr(p, name)[:] = draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    p.pg_live[:] = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    for ids in (p.free_slots, p.free_pages):
        ids.bits[:] = False
        ids.n = 0
        ids.give(np.array(draw(st.lists(st.integers(0, 15), max_size=6, unique=True)), I64))
    p.n_slots = n
    width = p.sp_members.shape[1]
    if draw(st.booleans()):  # a sound membership (most of its pages garbage once dropped)
        slots = draw(st.lists(st.integers(0, 15), max_size=width, unique=True))
        groups = draw(st.permutations(range(16)))
        for k, s in enumerate(slots):
            p.pg_live[s], p.pg_device[s] = True, groups[k] if k % 5 else -1
            p.pg_refs[s] = draw(st.sampled_from((1, 1, 2)))
            p.pg_pins[s] = draw(st.sampled_from((0, 0, 1)))
            if s in p.free_slots:
                p.free_slots.take([s])
            if p.pg_device[s] >= 0 and int(p.pg_device[s]) in p.free_pages:
                p.free_pages.take([int(p.pg_device[s])])
        p.sp_members[0, :len(slots)] = slots
        p.sp_nmem[0] = len(slots)
        if slots and draw(st.booleans()):  # then at most one damage
            s = slots[draw(st.integers(0, len(slots) - 1))]
            damage = draw(st.sampled_from(("dead", "no ref", "slot free", "group free")))
            if damage == "dead":
                p.pg_live[s] = False
            elif damage == "no ref":
                p.pg_refs[s] = 0
            elif damage == "slot free":
                p.free_slots.give(np.array([s], I64))
            elif p.pg_device[s] >= 0:
                p.free_pages.give(np.array([p.pg_device[s]], I64))
    else:  # anything
        p.sp_members[0] = draw(st.lists(st.integers(-2, 17), min_size=width, max_size=width))
        p.sp_nmem[0] = draw(st.integers(-1, width + 1))
    for ids in (p.free_slots, p.free_pages):  # a valid hint: at most the lowest free id
        free = np.flatnonzero(ids.bits)
        ids.lo = draw(st.integers(0, int(free[0]) if len(free) else len(ids.bits)))
    return p, draw(st.booleans())


def _arrays(p: PoolState) -> dict[str, object]:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in (
        *((f, getattr(p, f)) for f in ("pg_refs", "pg_pins", "pg_active", "pg_writer",
                                       "pg_device", "pg_gen", "pg_live", "sp_members",
                                       "sp_nmem")),
        ("slots", p.free_slots.bits), ("slots n", p.free_slots.n), ("slots lo", p.free_slots.lo),
        ("pages", p.free_pages.bits), ("pages n", p.free_pages.n), ("pages lo", p.free_pages.lo))}


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)  # type: ignore[arg-type]


def _sound_pool(no_ref_block: int = -1) -> PoolState:
    """Space 0 (seq 3) holds slots 5, 6, 7, 8 (page groups 1-4), one reference each, no
    pin; block ``no_ref_block`` (if any) has lost its reference (a damaged state)."""
    p = PoolState("main", 16, 2, 8)
    p.n_slots = 16
    for ids, free in ((p.free_slots, [0, 1, 2, 3, 4, 9]), (p.free_pages, [0, 5, 6])):
        ids.bits[:] = False
        ids.n = ids.lo = 0
        ids.give(np.array(free, I64))
    for k, s in enumerate((5, 6, 7, 8)):
        p.pg_live[s], p.pg_device[s], p.pg_refs[s], p.pg_active[s] = True, k + 1, 1, 1
    if no_ref_block >= 0:
        p.pg_refs[5 + no_ref_block] = 0
    p.sp_members[0, :4] = [5, 6, 7, 8]
    p.sp_nmem[0] = 4
    return p


@settings(max_examples=500, deadline=None)
@given(drop_cases(), st.one_of(st.just(0), st.integers(0, 10)))
@example(case=(_sound_pool(), True), keep=2)  # a Trim that frees the tail
@example(case=(_sound_pool(no_ref_block=3), True), keep=2)  # refused: names block 3's slot
def test_drop_membership_is_members_of_then_unref(case, keep: int) -> None:
    """The fused Finish/Release/Trim page half (``page_life.drop_membership``: one compiled
    call) against the two steps it replaces (``members_of``, then ``unref`` of the blocks
    from ``keep`` with its ``collect``): both refuse, changing nothing, or both reach the
    same arrays and free lists."""
    p, active = case
    q = copy.deepcopy(p)
    before = _arrays(p)
    sp, sq = _Space(p), _Space(q)
    try:
        page_life.unref(None, q, page_life.members_of(q, sq, "Release")[keep:], 3, active)
        want = None
    except ValueError as exc:
        want = exc
    try:
        page_life.drop_membership(None, p, sp, 3, active, "Release", keep=keep)
        got = None
    except ValueError as exc:
        got = exc
    assert (got is None) == (want is None), (got, want)
    if got is None:
        assert _same(_arrays(p), _arrays(q))
    else:
        assert str(got) == str(want)
        assert _same(_arrays(p), before) and _same(_arrays(q), before)


@settings(max_examples=300, deadline=None)
@given(drop_cases(), st.integers(0, 9 * P))
def test_retain_membership_is_members_of_then_retain_pages(case, committed: int) -> None:
    """The fused Finish(retain) page half against ``members_of`` then ``retain_pages``."""
    p, _ = case
    q = copy.deepcopy(p)
    before = _arrays(p)
    sp, sq = _Space(p, committed), _Space(q, committed)
    try:
        slots = page_life.members_of(q, sq, "Finish")
        ak.retain_pages(slots, 3, committed, q.pg_active, q.pg_writer, q.pg_protected)
        want = None
    except ValueError as exc:
        want = exc
    try:
        page_life.retain_membership(p, sp, 3, "Finish")
        got = None
    except ValueError as exc:
        got = exc
    assert (got is None) == (want is None), (got, want)
    if got is None:
        assert _same(_arrays(p), _arrays(q)) and np.array_equal(p.pg_protected, q.pg_protected)
    else:
        assert str(got) == str(want) and _same(_arrays(p), before)


class _Space:
    """What the page-half functions read of a ``KVAddressSpace``: its index, seq, committed
    frontier."""

    def __init__(self, p: PoolState, committed: int = 0) -> None:
        self._p, self.i, self.bundle, self.committed = p, 0, 3, committed
