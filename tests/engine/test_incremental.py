"""The incremental §14 verifier (engine/incremental.py) against the full ``violations()``:
long random runs of the real store replayed with both checkers after every event (both clean),
a checker started mid-journal, and ``replay(verify_every=...)`` wiring. Seeded violations, one
per check, are in test_incremental_seeded.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.incremental import IncrementalChecker
from ninfer_kv.engine.invariants import violations
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.state import StoreState, decode_state, encode_state
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import KVStoreError
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.replay import replay
from tests.engine.conftest import crash, small_config


def journal_events(directory: str) -> list[Any]:
    return [e for _, _, e in JournalReader(directory).events()]


def both_after_every_event(events: list[Any], st: StoreState | None = None) -> int:
    """Apply ``events``; after each, both checkers must be clean. Returns events checked."""
    st = st if st is not None else StoreState()
    chk = IncrementalChecker(st)
    assert chk.initial == []
    for n, e in enumerate(events):
        apply(st, e)
        inc, full = chk.check(e), violations(st)
        assert inc == [] and full == [], (n, type(e).__name__, inc[:3], full[:3])
    return len(events)


def headroom(s: KVStore) -> bool:
    """A continuation's Activate reserves its whole entitlement before its Fork/Move turns the
    held prefix into membership (and a DeviceRestore takes pages in between): only continue
    when that transient cannot drive ``available`` below zero (see test_transient_...)."""
    return all(p.available >= 2 * p.logical_pages for p in s.state.pools.values())


def _try(fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except KVStoreError:
        return None


def drive(s: KVStore, rng: random.Random, steps: int) -> None:
    """Random commands over the public API; refused commands are fine."""
    host = s.state.host is not None
    for _ in range(steps):
        act, cks, pools = sorted(s.active()), sorted(s.checkpoints()), s.pools
        r = rng.random()
        if r < 0.12 or not act:
            _try(s.activate, rng.randint(1, 600), rng.randint(0, 300))
        elif r < 0.36:  # decode round: map, publish, commit
            t = rng.randint(1, 70)
            for pool in pools:
                _try(s.ensure_mapped_many, pool, act, [s.space(b, pool).committed + t for b in act])
            _try(s.close_boundary)
            s.unit_complete()
            for pool in pools:
                sps = [s.space(b, pool) for b in act]
                _try(s.commit_many, pool, act, [min(sp.committed + t, len(sp.members) * P)
                                                 for sp in sps])
        elif r < 0.42:
            b, pool = rng.choice(act), rng.choice(pools)
            sp = s.space(b, pool)
            _try(s.set_provisional, b, pool, min(sp.committed + rng.randint(0, 70),
                                                 len(sp.members) * P))
            _try(s.trim, b, pool)
        elif r < 0.47:
            b = rng.choice(act)
            for pool in pools:
                _try(s.truncate, b, pool, max(0, s.space(b, pool).committed - rng.randint(0, 100)))
        elif r < 0.57:
            _try(s.finish, rng.choice(act), retain=rng.random() < 0.7)
        elif r < 0.64 and cks:
            _try(s.release, rng.choice(cks))
        elif r < 0.74 and cks and headroom(s):
            ck = rng.choice(cks)
            frac = rng.random()
            fr = {p: int(s.space(ck, p).committed * frac) for p in pools}
            _try(s.activate_from, ck, fr, max(fr.values()) + rng.randint(0, 200), 40,
                 keep_source=rng.random() < 0.6, mode=rng.choice(["auto", "fork", "move"]))
        elif r < 0.82 and cks and host:
            _try(s.offload, rng.choice(cks), drop_device=rng.random() < 0.4)
        elif r < 0.86 and cks and host:
            _try(s.drop_device, rng.choice(cks))
        elif r < 0.89 and cks and host:
            _try(s.drop_host, rng.choice(cks))
        elif r < 0.93 and s.config.lease_growth:
            _try(s.grow, rng.randint(1, 64))
        if rng.random() < 0.4:
            _try(s.close_boundary)
            s.unit_complete()


@pytest.mark.parametrize("seed,backend,growth", [(1, Backend.OFF, False), (2, Backend.MTP, True),
                                                 (3, Backend.OFF, True)])
def test_random_runs_clean_under_both_checkers(tmp_path: Path, seed: int, backend: Backend,
                                               growth: bool) -> None:
    s = KVStore.open(small_config(tmp_path, pages=96, concurrency=6, context=1024,
                                  backend=backend, lease_growth=growth, lease_window=128,
                                  lease_cushion=64))
    drive(s, random.Random(seed), 8000)
    s.close()
    events = journal_events(str(tmp_path / "journal"))
    kinds = {type(e) for e in events}
    assert {ev.Materialize, ev.CommitFrontiers, ev.Finish, ev.Release, ev.Fork, ev.Trim,
            ev.Truncate} <= kinds, kinds
    assert both_after_every_event(events) > 6000


@pytest.mark.parametrize("seed", [4, 5])
def test_random_host_runs_with_crash_clean_under_both_checkers(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    cfg = small_config(None, pages=96, concurrency=6, context=1024, backend=Backend.MTP,
                       host_bytes=4 << 20, persist_dir=str(tmp_path / "persist"))
    s = KVStore.open(cfg)
    drive(s, rng, 4000)
    for b in s.active():
        s.finish(b)
    for ck in s.checkpoints():
        s.release(ck)
    a = s.activate(300, 10)
    for pool in s.pools:
        s.ensure_mapped(a, pool, 300)
    s.close_boundary()
    s.unit_complete()
    for pool in s.pools:
        s.commit(a, pool, 300)
    assert s.offload(s.finish(a, retain=True)) > 0  # unpublished at the crash: HostAbort
    s._append_pending()
    crash(s)
    s = KVStore.open(cfg)
    drive(s, rng, 4000)
    s.close()
    events = journal_events(str(tmp_path / "persist" / "journal"))
    kinds = {type(e) for e in events}
    assert {ev.HostReserve, ev.HostPublish, ev.HostAbort, ev.DeviceDrop, ev.DeviceRestore,
            ev.HostDrop, ev.Pin, ev.Unpin, ev.Recovered, ev.Move, ev.CopyTail} <= kinds, kinds
    assert both_after_every_event(events) > 8000


def test_checker_started_mid_journal(tmp_path: Path) -> None:
    """Built from a decoded snapshot (pending transfers, copy pins, host replicas in flight),
    the checker's own indexes agree with the state and stay clean to the end."""
    cfg = small_config(None, pages=96, concurrency=6, context=1024, backend=Backend.MTP,
                       host_bytes=4 << 20, persist_dir=str(tmp_path / "persist"))
    s = KVStore.open(cfg)
    drive(s, random.Random(6), 500)
    s.close()
    events = journal_events(str(tmp_path / "persist" / "journal"))
    st = StoreState()
    starts = 0
    for n, e in enumerate(events):
        if st.host_pending or st.copy_pins or n == len(events) // 2:
            mid = decode_state(encode_state(st))
            both_after_every_event(events[n:n + 60], mid)
            starts += 1
            if starts > 8:
                break
        apply(st, e)
    assert starts > 3


def test_replay_verify_uses_incremental_and_full(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=96, concurrency=6, context=1024))
    drive(s, random.Random(7), 300)
    s.close()
    d = str(tmp_path / "journal")
    clean = replay(d, verify_every=1)
    assert clean.violations == [] and clean.digest == replay(d).digest
    assert replay(d, verify_every=1, full_every=7).violations == []

    def damage(st: StoreState, seq: int, i: int, e: Any) -> None:
        if isinstance(e, ev.Materialize) and not hit:
            st.pools[e.pool].reserved += 1  # a counter apply corrupted, from here on
            hit.append(seq)

    hit: list[int] = []
    r = replay(d, verify_every=1, full_every=50, on_event=damage)
    first = r.violations[0]
    assert first.check == "incremental" and first.seq == hit[0] and first.event == "Materialize"
    assert any("sum of active reservations" in p for p in first.problems)
    assert any(v.check == "full" for v in r.violations)
    assert r.violations[-1].event == "end" and r.violations[-1].check == "full"
    hit.clear()
    old = replay(d, verify_every=1, incremental=False, on_event=damage)
    assert old.violations and all(v.check == "full" for v in old.violations)


def test_a_continuation_never_over_reserves_between_its_events(tmp_path: Path) -> None:
    """Activate.held: the pages a Fork/Move hands over are never reserved as well, so
    available >= 0 after every event of the record, not only at its end (§5.2)."""
    s = KVStore.open(small_config(tmp_path, pages=64, concurrency=4, context=2048))
    a = s.activate(1500, 10)
    s.ensure_mapped(a, "main", 1500)
    with s.boundary():
        pass
    s.commit(a, "main", 1500)
    ck = s.finish(a, retain=True)
    s.activate(2000, 10)  # leaves fewer free pages than the continuation entitles
    assert s.state.pools["main"].available < s.entitlement_pages("main", 1500, 1510)
    s.activate_from(ck, 23 * P, 1500, 10)  # accepted: it needs only entitlement - held pages
    s.close()
    both_after_every_event(journal_events(str(tmp_path / "journal")))


def test_a_negative_frontier_is_reported_not_raised(tmp_path: Path) -> None:
    """Review repro: a damaged CopyTail (columns=-5) left a continuation at frontier -5, and at
    its next commit the array-reading checker indexed block -1 and raised IndexError out of
    ``replay(verify_every=1)``. apply now refuses such a CopyTail, and check_commit starts a
    negative old frontier's walk at block 0 (a mirror pushed negative by hand here)."""
    import msgspec

    from tests.engine.test_continuation import checkpoint_at

    s = KVStore.open(small_config(tmp_path, pages=32, concurrency=4, context=1024))
    ck = checkpoint_at(s, 100, out=64)
    dst = s.activate_from(ck, 10, 100, 50, mode="fork")   # Fork of 0 pages + CopyTail(10)
    with s.boundary():
        pass
    s.close()
    events = journal_events(str(tmp_path / "journal"))
    k = next(i for i, e in enumerate(events) if isinstance(e, ev.CopyTail))
    st = StoreState()
    for e in events[:k]:
        apply(st, e)
    before = st.pools["main"].pg_refs.copy()
    with pytest.raises(AssertionError, match="CopyTail"):
        apply(st, msgspec.structs.replace(events[k], columns=-5))
    assert (st.pools["main"].pg_refs == before).all()
    st, chk = StoreState(), None
    for e in events:
        apply(st, e)
        chk = chk or IncrementalChecker(st)
        assert chk.check(e) == []
    chk.pools["main"].see_committed(dst, -5)              # the mirror as damage left it
    e = ev.CommitFrontiers("main", ev.pack([dst]), ev.pack([10]))
    apply(st, e)
    assert isinstance(chk.check(e), list)                 # a report, not an IndexError


def test_the_mirror_follows_live_spaces_not_ids_handed_out(tmp_path: Path) -> None:
    """The checker's per-space arrays are sized by the spaces that exist: 300 sequences, at
    most 3 alive at once, leave them at their first size. (They were indexed by seq id, 9
    bytes per id ever handed out: ~19 GB for a journal that reached the last id.) Every
    event is still checked clean, and a commit of an id the mirror dropped is reported."""
    s = KVStore.open(small_config(tmp_path))
    live: list[int] = []
    for i in range(300):
        b = s.activate(70, 10)
        s.ensure_mapped(b, "main", 70)
        with s.boundary():
            pass
        s.commit(b, "main", 70 + i % 3)
        live.append(b)
        if len(live) == 3:
            s.finish(live.pop(0), retain=i % 50 == 0)  # a few checkpoints too
            with s.boundary():
                pass
    s.close()
    events = journal_events(str(tmp_path / "journal"))
    st = StoreState()
    chk = IncrementalChecker(st)
    for e in events:
        apply(st, e)
        assert chk.check(e) == [], type(e).__name__
    pm = chk.pools["main"]
    assert max(live) >= 299 and len(pm.committed) == len(pm.active) == 64
    assert len(pm.index) == pm.ids.live == len(st.pools["main"].spaces)
    gone = min(live) - 1  # finished without retain: its space is gone from pool and mirror
    assert gone not in st.pools["main"].spaces and pm.seen_committed(gone) == -(1 << 63)
