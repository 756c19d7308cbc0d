"""Seeded violations: replay a scripted journal that exercises every event kind; right after
one chosen event, damage the state in a way that breaks one invariant on something that event
touched, and require BOTH the incremental checker and the full ``violations()`` to report it.
Every check of engine/incremental.py has a case here whose message fragment only that check
emits, so deleting the check fails its case."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.incremental import IncrementalChecker
from ninfer_kv.engine.incremental_index import check_pages
from ninfer_kv.engine.invariants import violations
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.pages import NO_PAGE
from ninfer_kv.engine.state import StoreState
from ninfer_kv.engine.store import KVStore
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import unpack
from tests.engine.conftest import crash, small_config
from tests.engine.test_incremental import journal_events


def _step(s: KVStore) -> None:
    with s.boundary():
        pass
    s.check_invariants()


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """Two pools (main, mtp), host tier, lease growth: every event kind at least once."""
    tmp: Path = tmp_path_factory.mktemp("story")
    cfg = small_config(None, pages=80, concurrency=4, context=2048, backend=Backend.MTP,
                       host_bytes=8 << 20, persist_dir=str(tmp / "persist"), lease_growth=True,
                       lease_window=128, lease_cushion=64)
    s = KVStore.open(cfg)
    a, b = s.activate(300, 1500), s.activate(200, 100)
    for pool in s.pools:
        s.ensure_mapped_many(pool, [a, b], [448, 200])
    _step(s)
    for pool in s.pools:
        s.commit_many(pool, [a, b], [400, 200])
    s.grow(1)
    for pool in s.pools:
        s.ensure_mapped(a, pool, 512)
        s.commit_many(pool, [a, b], [401, 201])
        s.set_provisional(a, pool, 401)
        s.trim(a, pool)
        s.truncate(a, pool, 250)
    _step(s)
    ck = s.finish(a, retain=True)
    s.set_metadata(ck, {"tokens": [1, 2, 3]})       # SetMetadata
    s.offload(ck)
    _step(s)                                       # HostReserve, HostPublish
    s.drop_device(ck)
    _step(s)                                       # DeviceDrop
    c = s.activate_from(ck, 250, 300, 50)          # Pin, DeviceRestore, Fork, CopyTail
    _step(s)                                       # Unpin
    s.drop_host(ck)
    _step(s)                                       # HostDrop
    ck2 = s.finish(b, retain=True)
    d = s.activate_from(ck2, 128, 200, 50, keep_source=False, mode="move")
    _step(s)                                       # Move
    s.finish(c)                                    # Finish without retain: frees its tail
    s.release(ck)
    _step(s)
    e = s.activate(130, 10)
    for pool in s.pools:
        s.ensure_mapped(e, pool, 130)
    _step(s)
    for pool in s.pools:
        s.commit(e, pool, 130)
    shared = s.share_prefix(e)                     # Share (2 whole pages; e runs on)
    _step(s)
    s.release_tail(shared, P)                      # Prefix (1 page) + Release
    _step(s)
    s.offload(s.finish(d, retain=True))
    s._append_pending()
    crash(s)
    KVStore.open(cfg).close()                      # Recovered, HostAbort, Release
    events = journal_events(str(tmp / "persist" / "journal"))
    kinds = {type(e) for e in events}
    assert set(ev.Event.__args__) - kinds == set()  # type: ignore[attr-defined]
    return events


@dataclass(frozen=True)
class Case:
    name: str
    kind: type
    corrupt: Callable[[StoreState, Any, Any], None]
    inc: str                       # regex only the check under test emits
    full: str                      # regex the full check emits
    when: Callable[[Any], bool] = lambda e: True
    before: Callable[[StoreState, Any], Any] = lambda st, e: None


def seeded(events: list[Any], case: Case) -> tuple[list[str], list[str]]:
    st = StoreState()
    chk = IncrementalChecker(st)
    for e in events:
        hit = isinstance(e, case.kind) and case.when(e)
        ctx = case.before(st, e) if hit else None
        apply(st, e)
        if hit:
            case.corrupt(st, e, ctx)
            return chk.check(e), violations(st)
        assert chk.check(e) == [], type(e).__name__
    raise AssertionError(f"no {case.kind.__name__} event matched")


# --- what the damage is applied to -------------------------------------------------------------
def pool(st: StoreState, e: Any) -> Any:
    return st.pools[e.pool]


def space(st: StoreState, e: Any, b: int = 1) -> Any:
    return st.pools[e.pool].spaces[b]


def page(st: StoreState, e: Any, slot: int) -> Any:
    return st.pools[e.pool].pages[slot]


def frontier_page(st: StoreState, e: Any) -> Any:
    sp = space(st, e, 1)
    return page(st, e, sp.members[(sp.committed - 1) // P])


def block_page(st: StoreState, e: Any, i: int) -> Any:
    return page(st, e, space(st, e).members[i])


def swap_free(free: Any, add: int) -> None:
    """Put ``add`` on a free list and take another id off (the count stays)."""
    other = next(x for x in reversed(list(free)) if x != add)
    free.remove(other)
    free.add(add)


def bump_free_extent(st: StoreState, off: int) -> None:
    h = st.host
    v = h.by_off[off]  # type: ignore[union-attr]
    h.by_size.remove((v, off))  # type: ignore[union-attr]
    h.by_off[off] = v - 64  # type: ignore[union-attr]
    h.by_size.add((v - 64, off))  # type: ignore[union-attr]


def revive(st: StoreState, e: Any, members: list[int]) -> None:
    """Put a fresh, unreferenced page back into a slot the event recycled."""
    p = pool(st, e)
    s = next(x for x in members if p.pages[x] is None)
    p.init_pages([s], [NO_PAGE], NO_PAGE, False)
    p.pages[s].refs = 0  # type: ignore[union-attr]


MAT, COMMIT, ACT = ev.Materialize, ev.CommitFrontiers, ev.Activate
main = lambda e: e.pool == "main"  # noqa: E731
first_main_act = lambda e: e.pool == "main" and e.bundle == 1  # noqa: E731

CASES = [
    # --- spaces (_sync) ----------------------------------------------------------------------
    Case("dup member", MAT, lambda st, e, c: space(st, e).append_member(space(st, e).members[-1]),
         "appears twice in one membership", "appears twice", main),
    # more than 8 pages added at once: the set is updated whole unless one repeats
    Case("dup in a long add", MAT, lambda st, e, c: setattr(
        space(st, e), "members", space(st, e).members + space(st, e).members[:3]),
         "bundle 1: page 0 appears twice in one membership", "appears twice", main),
    Case("long add of members", MAT, lambda st, e, c: setattr(
        space(st, e), "members", space(st, e).members + space(st, e).members[:7]
        + space(st, e, 2).members[:1]),
         "bundle 1: page 0 appears twice in one membership", "appears twice",
         lambda e: main(e) and unpack(e.bundles).tolist() == [1]),
    Case("space key", ACT, lambda st, e, c: setattr(space(st, e), "bundle", 99),
         "space key 1 != bundle 99", "space key", first_main_act),
    Case("L", MAT, lambda st, e, c: setattr(pool(st, e), "logical_pages", 6), r"7 pages > L=6",
         r"> L=6", main),
    Case("frontier order", ev.Truncate,
         lambda st, e, c: setattr(space(st, e), "protected", space(st, e).committed + 1),
         r"out of order$", "out of order", main),
    Case("entitlement", MAT, lambda st, e, c: setattr(space(st, e), "entitlement", 6),
         r"membership 7 \+ incoming 0 > entitlement 6", "> entitlement", main),
    Case("no row", ACT, lambda st, e, c: setattr(space(st, e), "row", -1),
         "holds no execution row", "holds no execution row", first_main_act),
    Case("inactive row", ev.Finish, lambda st, e, c: setattr(space(st, e), "row", 2),
         "inactive bundle 1 occupies row 2", "inactive bundle 1 occupies row", main),
    Case("row twice", ACT, lambda st, e, c: setattr(space(st, e, 2), "row", 0),
         "row 0 leased to 1 and 2", "row 0 leased to", lambda e: main(e) and e.bundle == 2),
    Case("row owner", ACT, lambda st, e, c: pool(st, e).row_owner.__setitem__(0, 77),
         "row_owner says 77", "execution rows inconsistent", first_main_act),
    Case("row free", ACT, lambda st, e, c: swap_free(pool(st, e).free_rows, 0),
         "on the free list True", "execution rows inconsistent", first_main_act),
    Case("provisional", ev.ProvisionalFrontiers, lambda st, e, c: setattr(
        space(st, e), "provisional", len(space(st, e).members) * P + 1),
         "provisional frontier .* outside", "provisional frontier .* outside", main),
    Case("commit space gone", COMMIT, lambda st, e, c: pool(st, e).spaces.pop(1),
         "commit names bundle 1 without a space", "lists pool main without a space", main),
    # --- columns (commit and frontier blocks) -------------------------------------------------
    Case("frontier order commit", COMMIT,
         lambda st, e, c: setattr(space(st, e), "protected", space(st, e).committed + 1),
         r"out of order \(commit\)", "out of order", main),
    Case("commit no space", COMMIT, lambda st, e, c: (  # (full: KeyError if still listed)
        pool(st, e).spaces.pop(1), setattr(st.bundles[1], "pools", ("mtp",))),
        "commit names bundle 1 without a space", r"has no space in \['main'\]", main),
    Case("frontier dead", COMMIT, lambda st, e, c: pool(st, e).pg_live.__setitem__(
        frontier_page(st, e).slot, False), r"dead slot \d+ \(committed block\)", "dead slot", main),
    Case("frontier columns", COMMIT, lambda st, e, c: setattr(
        frontier_page(st, e), "committed", frontier_page(st, e).committed - 1),
        r"page \d+ committed 15 < 16 \(commit\)", r"committed 15 < 16", main),
    Case("frontier range", COMMIT, lambda st, e, c: setattr(
        frontier_page(st, e), "protected", frontier_page(st, e).committed + 1),
        r"out of range \(commit\)", "out of range", main),
    Case("truncated dead", ev.Truncate, lambda st, e, c: pool(st, e).pg_live.__setitem__(
        space(st, e).members[3], False), r"block 3 -> dead slot \d+ \(frontier block\)",
        "block 3 -> dead slot", main),
    Case("truncated columns", ev.Truncate, lambda st, e, c: setattr(
        block_page(st, e, 3), "committed", 57), r"block 3 page \d+ committed 57 < 58$",
        "committed 57 < 58", main),
    Case("truncated range", ev.Truncate, lambda st, e, c: setattr(
        block_page(st, e, 3), "protected", 59), r"out of range \(frontier block\)",
        "out of range", main),
    # --- pages (_pages) ------------------------------------------------------------------------
    Case("released not free", ev.DeviceDrop, lambda st, e, c: pool(st, e).free_pages.remove(c),
         "released device page 0 .* not on the free list", "!= capacity", main,
         lambda st, e: page(st, e, 0).device),
    Case("dev range", MAT, lambda st, e, c: setattr(page(st, e, 0), "device", 1000),
         "device page id 1000 of slot 0 out of range", "out of range", main),
    Case("dup lease", MAT, lambda st, e, c: setattr(page(st, e, 1), "device", 0),
         "device page 0 leased by slots 0 and 1", "leased by more than one", main),
    Case("dup lease outside", MAT, lambda st, e, c: [setattr(page(st, e, x), "device", 1000)
                                                     for x in (0, 1)],
         "device page 1000 leased by slots 0 and 1", "out of range", main),
    Case("leased free", MAT, lambda st, e, c: swap_free(pool(st, e).free_pages, 0),
         "leased device page 0 .* also on the free list", "also on the free list", main),
    Case("dead member", MAT, lambda st, e, c: pool(st, e).pg_live.__setitem__(6, False),
         "dead slot 6 still has 1 memberships", "dead slot 6", main),
    Case("free slot", MAT, lambda st, e, c: pool(st, e).free_slots.add(3), "free slot 3 is live",
         "free slot 3 is live", main),
    Case("refs", ev.Fork, lambda st, e, c: setattr(page(st, e, 0), "refs", 3),
         "page 0 refs 3 != memberships 2", "refs 3", main),
    Case("active refs", ev.Fork, lambda st, e, c: setattr(page(st, e, 0), "active_refs", 2),
         "page 0 active_refs 2 != 1", "active_refs 2", main),
    Case("page range", ev.Finish, lambda st, e, c: setattr(page(st, e, 0), "protected", P + 1),
         r"page 0 columns protected=65 committed=64 out of range$", "out of range", main),
    Case("writer", ev.Finish, lambda st, e, c: setattr(page(st, e, 3), "writer", 1),
         "writer 1 is not an active member", "not an active member", main),
    Case("shared writer", ev.Fork, lambda st, e, c: setattr(page(st, e, 0), "writer", 3),
         r"shared \(2 refs\) but has writer 3", r"\(§9.4\)", main),
    # the first Materialize maps seqs 1 (slots 0-6) and 2, both active
    Case("writer of another seq", MAT, lambda st, e, c: setattr(page(st, e, 0), "writer", 2),
         "page 0 writer 2 is not an active member", "not an active member", main),
    Case("writer of a shared page", ev.Fork, lambda st, e, c: setattr(page(st, e, 0), "writer",
                                                                      99),
         "page 0 writer 99 is not an active member", "not an active member", main),
    Case("no device", MAT, lambda st, e, c: setattr(page(st, e, 0), "device", NO_PAGE),
         "mapped by 1 active spaces but has no device replica", "no device replica", main),
    Case("pins", ev.Pin, lambda st, e, c: setattr(page(st, e, 0), "pins", 5),
         "pins 5 != pending transfers and queued copies 1", "pins 5", main),
    Case("lost", ev.DeviceDrop, lambda st, e, c: pool(st, e).host_of.pop(int(unpack(e.slots)[0])),
         "held but has neither a device nor a host replica", "neither a device nor a host",
         main),
    Case("not recycled", ev.Finish, lambda st, e, c: revive(st, e, c), "but is not recycled",
         "but is not recycled", lambda e: main(e) and not e.retain,
         lambda st, e: list(space(st, e, e.bundle).members)),
    # --- totals ----------------------------------------------------------------------------------
    Case("reserved", ev.Grow, lambda st, e, c: setattr(pool(st, e), "reserved",
                                                      pool(st, e).reserved + 1),
         "sum of active reservations", "sum of active reservations", main),
    Case("capacity", COMMIT, lambda st, e, c: pool(st, e).free_pages.remove(
        pool(st, e).free_pages.last()), "!= capacity", "!= capacity", main),
    Case("row count", COMMIT, lambda st, e, c: pool(st, e).free_rows.remove(
        pool(st, e).free_rows.last()), "execution rows inconsistent: ", "rows inconsistent", main),
    Case("copy count", MAT, lambda st, e, c: st.copy_pins.__setitem__(("main", 0), 1),
         "copy_pins holds 1 pages", "queued copies 1", main),
    Case("pending count", COMMIT, lambda st, e, c: st.host_pending.__setitem__(
        1 << 22, ("main", (0,), (1 << 22,))), "host_pending holds 1", "pending transfers", main),
    Case("copy pins", ev.Pin, lambda st, e, c: st.copy_pins.__setitem__(("main", 0), 3),
         r"copy_pins\[main:0\] = 3 != queued copies 1", "queued copies 3", main),
    # --- bundles -------------------------------------------------------------------------------
    Case("bundle pool", ev.Finish, lambda st, e, c: setattr(
        st.bundles[3], "pools", ("main", *st.bundles[3].pools)),
        "bundle 3 lists pool main without a space", "lists pool main without a space",
        lambda e: main(e) and not e.retain),
    Case("bundle missing", ev.PublishActive, lambda st, e, c: (
        st.pools["mtp"].spaces.pop(1), setattr(st.bundles[1], "pools", ("main",))),
        r"has no space in \['mtp'\]", r"has no space in \['mtp'\]", lambda e: e.bundle == 1),
    Case("bundle inactive", ev.PublishActive, lambda st, e, c: setattr(
        st.pools["main"].spaces[1], "active", False), "has an inactive space",
        "has an inactive space", lambda e: e.bundle == 1),
    # --- (host) configuration: a rebuild that reports the full check ---------------------------
    Case("configure", ev.HostConfigure, lambda st, e, c: setattr(st.pools["main"], "reserved", 3),
         "main: reserved 3 != sum of active reservations 0", "reserved 3 !=", lambda e: True),
    # --- host tier -----------------------------------------------------------------------------
    Case("owned twice", ev.HostPublish, lambda st, e, c: setattr(
        page(st, e, 1), "host", page(st, e, 0).host), "owned twice", "owned twice", main),
    Case("pending key", ev.HostReserve, lambda st, e, c: st.host_pending.__setitem__(
        64, st.host_pending.pop(0)), "recorded as None", "keyed 64 starts at 0", main),
    Case("leaked", ev.HostAbort, lambda st, e, c: st.host.live.__setitem__(c, 1 << 16),
         r"host extent \d+ leaked", "leaked", main, lambda st, e: st.host_pending[e.offset][2][0]),
    Case("replica extent", ev.HostPublish, lambda st, e, c: setattr(
        page(st, e, 0), "host", (64, *page(st, e, 0).host[1:])),
        "host replica at 64 is not a live extent", "not a live extent", main),
    Case("pending extent", ev.HostReserve, lambda st, e, c: st.host.live.pop(0),
         "pending destination at 0 is not a live extent",
         "pending destination at 0 is not a live extent", main),
    Case("tiling", ev.HostReserve, lambda st, e, c: st.host.live.__setitem__(0, (1 << 16) + 64),
         r"gap or overlap around offsets \[0\]", "gap or overlap", main),
    Case("size index", ev.HostReserve, lambda st, e, c: st.host.by_size.pop(),
         "size index out of step", "size index out of step", main),
    Case("free bytes", ev.HostReserve, lambda st, e, c: bump_free_extent(st, 4 << 16),
         r"host arena: free \d+ \+ live", r"free \+ live != capacity", main),
    Case("live count", ev.HostPublish, lambda st, e, c: st.host.live.__setitem__(
        st.host.capacity - 64, 64), "live extents, ", "leaked", main),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_seeded_violation_is_reported_by_both(story: list[Any], case: Case) -> None:
    inc, full = seeded(story, case)
    assert any(re.search(case.inc, v) for v in inc), (case.inc, inc)
    assert any(re.search(case.full, v) for v in full), (case.full, full)


def test_a_shared_page_of_its_writer_is_not_reported_as_foreign(story: list[Any]) -> None:
    """"shared writer": seq 3 writes page 0 which seqs 1 and 3 both hold. Seq 3 is an
    active member, so only the sharing is a violation (the checker asks its mirror which
    membership is the writer's when a page has several)."""
    inc, _ = seeded(story, next(c for c in CASES if c.name == "shared writer"))
    assert inc and not any("not an active member" in v for v in inc), inc


def test_every_check_has_a_seeded_case() -> None:
    """At least one case per ``out.append`` / ``out.extend`` of the incremental checker (the
    mutation script deletes each; a check no case trips is a defect)."""
    root = Path(__file__).resolve().parents[2] / "ninfer_kv" / "engine"
    checks = sum(f.read_text().count("out.append(") + f.read_text().count("out.extend(")
                 for f in root.glob("incremental*.py"))
    assert checks <= len(CASES), (checks, len(CASES))
    assert len({c.name for c in CASES}) == len(CASES)


def test_clean_story_is_clean(story: list[Any]) -> None:
    st = StoreState()
    chk = IncrementalChecker(st)
    for e in story:
        apply(st, e)
        assert chk.check(e) == [] and violations(st) == [], type(e).__name__


def test_lease_index_follows_pages_outside_the_pool(story: list[Any]) -> None:
    """The lease index keeps device ids outside the pool in a dict: a slot that leaves such
    an id frees it for another slot (no false double lease), and a slot past those the
    checker has seen is an IndexError (as before its arrays), never a read out of bounds."""
    st = StoreState()
    chk = IncrementalChecker(st)
    for e in story:
        apply(st, e)
        chk.check(e)
        if isinstance(e, MAT) and main(e):
            break
    pool, pm = st.pools["main"], chk.pools["main"]
    assert not chk.check(e)
    old = pool.pg_device[0]
    pool.pg_device[0] = 1000
    out: list[str] = []
    check_pages(pool, pm, [0], None, out)
    assert "device page id 1000 of slot 0 out of range" in out
    assert pm.lease_outside == {1000: 0}
    pool.pg_device[0], pool.pg_device[1] = old, 1000
    out = []
    check_pages(pool, pm, [0, 1], None, out)
    assert "device page 1000 leased by slots 0 and 1 (§14)" not in out, out
    assert pm.lease_outside == {1000: 1}
    pm.extend(pm.n + 1)  # its arrays grow by doubling: longer than the slots it has seen
    assert pm.n < len(pm.refs)
    for past in (pm.n, len(pm.refs)):
        with pytest.raises(IndexError, match="past the checker's index"):
            check_pages(pool, pm, [past], None, [])
