"""``KVStore.release_tail`` (the ``Prefix`` event + ``Release``): an inactive checkpoint gives
up the pages above its first whole pages, and its prefix stays continuable — as vLLM frees a
cached request's blocks tail first, so its prompt outlives its generated tail."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import FrontierError, FrozenUnit, InvalidArgument, UnknownHandle
from ninfer_kv.journal import events as ev
from ninfer_kv.replay import replay
from tests.engine.conftest import assert_refusals_change_nothing, crash, small_config
from tests.engine.test_continuation import checkpoint_at, page_bytes, running, step, write_tokens
from tests.engine.test_host_tier import host_store


def device_bytes(s: KVStore, ck: int) -> dict[str, list[list[torch.Tensor]]]:
    return {pool: [page_bytes(s, pool, s.state.pools[pool].pages[x].device)
                   for x in s.space(ck, pool).members] for pool in s.pools}


def close_and_replay(s: KVStore) -> None:
    """Close ``s``; replaying its journal with the checker after every event finds nothing
    and the live store's digest."""
    s.close()
    assert s.config.journal_dir is not None
    r = replay(s.config.journal_dir, verify_every=1)
    assert r.digest == s.digest() and not r.violations


@pytest.mark.parametrize("backend", [Backend.OFF, Backend.MTP, Backend.DFLASH])
def test_the_tail_frees_and_the_prefix_continues(tmp_path: Path, backend: Backend) -> None:
    s = KVStore.open(small_config(tmp_path, backend=backend, checked=True))
    ck = checkpoint_at(s, 5 * P + 10)                  # 6 pages per pool, the last partial
    other = s.activate_from(ck, 2 * P, 2 * P + 1, 10)  # a Fork: shares the first two pages
    step(s)
    before = device_bytes(s, ck)
    free0 = s.occupancy()["main"]["available"]
    new = s.release_tail(ck, 3 * P + 40)              # keeps three whole pages
    step(s)
    assert new is not None and ck not in s.state.bundles
    assert s.occupancy()["main"]["available"] == free0 + 3  # the three it held alone
    for pool in s.pools:
        assert s.space(new, pool).committed == 3 * P
        for got, want in zip(device_bytes(s, new)[pool], before[pool][:3], strict=True):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    info = s.checkpoint_info(new)
    assert info.parent is None and info.pools["main"].pages == 3
    c = s.activate_from(new, 3 * P, 3 * P + 1, 10)     # the prefix continues
    step(s)
    assert s.space(c).members[:2] == s.space(other).members[:2]
    again = s.release_tail(new, P - 1)                 # no whole page kept: a plain release
    step(s)
    assert again is None and new not in s.state.bundles
    close_and_replay(s)


def test_refusals_change_nothing(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path))
    ck = checkpoint_at(s, 2 * P + 3)
    a = running(s, 100)
    assert_refusals_change_nothing(s, [
        (UnknownHandle, "999 is not an inactive checkpoint", lambda: s.release_tail(999, P)),
        (UnknownHandle, f"{a} is not an inactive", lambda: s.release_tail(a, P)),
        (FrontierError, "at most its frontier 131", lambda: s.release_tail(ck, 2 * P + 4)),
        (InvalidArgument, "frontier", lambda: s.release_tail(ck, -1)),
        (InvalidArgument, "frontier", lambda: s.release_tail(ck, 1.5)),  # type: ignore[arg-type]
        # integers are checked before any rule: a bad frontier names itself, whatever the id
        (InvalidArgument, "frontier=-1 must be >= 0", lambda: s.release_tail(999, -1)),
        (InvalidArgument, "frontier=True: a bool", lambda: s.release_tail(a, True)),
    ])
    s.close_boundary()
    with pytest.raises(FrozenUnit):
        s.release_tail(ck, P)
    s.unit_complete()
    s.close()


def test_the_kept_prefix_survives_a_restart_and_the_old_checkpoint_does_not(
        tmp_path: Path) -> None:
    s = host_store(tmp_path)
    ck = checkpoint_at(s, 4 * P)
    s.offload(ck)
    step(s)
    new = s.release_tail(ck, 2 * P)
    step(s)
    assert s.checkpoint_info(new).survives_restart
    crash(s)
    s2 = KVStore.open(s.config)
    assert set(s2.checkpoints()) == {new} and s2.space(new).committed == 2 * P
    s2.check_invariants()
    s2.close()


def test_a_damaged_prefix_or_share_is_refused(tmp_path: Path) -> None:
    """A Prefix needs an inactive source; neither a Prefix nor a Share may land on a bundle
    that has a space in the pool already (a damaged Share overwrote it: its pages' references
    leaked and the bundle's membership was lost)."""
    s = KVStore.open(small_config(tmp_path))
    ck = checkpoint_at(s, 2 * P)
    a = running(s, 2 * P)
    st = copy.deepcopy(s.state)
    refs = st.pools["main"].pg_refs.copy()
    for bad, match in [(ev.Prefix(a, st.next_bundle, "main", 1), "inactive"),
                       (ev.Prefix(ck, st.next_bundle, "main", 3), "inactive"),
                       (ev.Prefix(ck, a, "main", 1), "has a space"),
                       (ev.Share(a, ck, "main", 1), "has a space")]:
        with pytest.raises(AssertionError, match=match):
            apply(st, bad)
        assert (st.pools["main"].pg_refs == refs).all()
    s.close()


def test_a_prefix_into_another_commands_checkpoint_is_refused(tmp_path: Path) -> None:
    """A multi-pool checkpoint is built by one event per pool: the second pool's Prefix may
    only join the Prefix checkpoint the first made, not a Share's (a damaged record)."""
    s = KVStore.open(small_config(tmp_path, backend=Backend.MTP))
    ck = checkpoint_at(s, 2 * P)
    a = running(s, 2 * P)
    st = copy.deepcopy(s.state)
    dst = st.next_bundle
    apply(st, ev.Share(a, dst, "main", 1))
    refs = {n: p.pg_refs.copy() for n, p in st.pools.items()}
    with pytest.raises(AssertionError, match="not this prefix checkpoint"):
        apply(st, ev.Prefix(ck, dst, "mtp", 1))
    assert all((st.pools[n].pg_refs == r).all() for n, r in refs.items())
    s.close()


def checkpoint_per_pool(s: KVStore, tokens: dict[str, int]) -> int:
    """An inactive checkpoint whose pools hold different committed frontiers (as a DFlash
    sequence's main and draft pools do)."""
    a = s.activate(max(tokens.values()), 100)
    for pool, n in tokens.items():
        s.ensure_mapped(a, pool, n)
    step(s)
    for pool, n in tokens.items():
        write_tokens(s, a, pool, 0, n)
        s.commit(a, pool, n)
    ck = s.finish(a, retain=True)
    step(s)
    assert ck is not None
    return ck


def test_a_frontier_per_pool_keeps_each_pools_own_prefix(tmp_path: Path) -> None:
    """One frontier is capped by the lowest pool; a mapping keeps each pool's own whole pages,
    and a pool whose frontier holds no whole page keeps an empty space (still continuable at
    frontier 0 there)."""
    s = KVStore.open(small_config(tmp_path, backend=Backend.DFLASH, checked=True))
    draft = next(p for p in s.pools if p != "main")
    ck = checkpoint_per_pool(s, {"main": 5 * P + 7, draft: 2 * P + 3})
    before = device_bytes(s, ck)
    with pytest.raises(FrontierError, match=f"lowest over pools .*'{draft}': {2 * P + 3}"):
        s.release_tail(ck, 4 * P)                     # one int: the draft pool caps it
    new = s.release_tail(ck, {"main": 4 * P + 1, draft: 2 * P})
    step(s)
    assert new is not None and ck not in s.state.bundles
    assert s.space(new, "main").committed == 4 * P and s.space(new, draft).committed == 2 * P
    for pool, n in (("main", 4), (draft, 2)):
        for got, want in zip(device_bytes(s, new)[pool], before[pool][:n], strict=True):
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    c = s.activate_from(new, {"main": 4 * P, draft: 2 * P}, 4 * P, 10)
    step(s)
    assert s.space(c, draft).members[:2] == s.space(new, draft).members
    zero = s.release_tail(new, {"main": 3 * P, draft: P - 1})  # the draft keeps nothing
    step(s)
    assert zero is not None and s.space(zero, draft).members == []
    assert s.space(zero, "main").committed == 3 * P
    d = s.activate_from(zero, {"main": 3 * P, draft: 0}, 3 * P, 10)
    step(s)
    assert s.space(d, draft).committed == 0
    gone = s.release_tail(zero, {"main": P - 1, draft: 0})  # nothing kept: a plain release
    step(s)
    assert gone is None and zero not in s.state.bundles
    close_and_replay(s)


def test_a_frontier_per_pool_is_refused_whole(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, backend=Backend.DFLASH))
    draft = next(p for p in s.pools if p != "main")
    ck = checkpoint_per_pool(s, {"main": 3 * P, draft: P + 5})
    assert_refusals_change_nothing(s, [
        (InvalidArgument, rf"missing \['{draft}'\], unknown \[\]",
         lambda: s.release_tail(ck, {"main": P})),
        (InvalidArgument, r"missing \[\], unknown \['x'\]",
         lambda: s.release_tail(ck, {"main": P, draft: P, "x": 0})),
        (FrontierError, f"pool {draft} keeps at most its frontier {P + 5}, not {2 * P}",
         lambda: s.release_tail(ck, {"main": P, draft: 2 * P})),
        (FrontierError, f"pool main keeps at most its frontier {3 * P}, not {3 * P + 1}",
         lambda: s.release_tail(ck, {"main": 3 * P + 1, draft: 0})),
        (InvalidArgument, r"frontier\['main'\]=-1 must be >= 0",
         lambda: s.release_tail(ck, {"main": -1, draft: 0})),
        (InvalidArgument, r"frontier\['main'\]=True: a bool",
         lambda: s.release_tail(ck, {"main": True, draft: 0})),
    ])
    s.close()


@settings(max_examples=20, deadline=None, database=None)
@given(main=hs.integers(0, 5 * P + 7), draft=hs.integers(0, 2 * P + 3))
def test_any_frontier_per_pool_keeps_exactly_its_whole_pages(main: int, draft: int) -> None:
    """For any per-pool frontiers: each pool keeps its own whole pages (the same slots and
    bytes), frees the rest, and replay agrees; equal frontiers given per pool or as one int
    give the same digest."""
    with tempfile.TemporaryDirectory() as d:
        stores = [KVStore.open(small_config(Path(d) / str(k), backend=Backend.DFLASH))
                  for k in range(2)]
        other = next(p for p in stores[0].pools if p != "main")
        want = {"main": main, other: draft}
        low = min(want.values())
        for k, s in enumerate(stores):
            ck = checkpoint_per_pool(s, {"main": 5 * P + 7, other: 2 * P + 3})
            held = {p: s.space(ck, p).members for p in s.pools}
            before, free0 = device_bytes(s, ck), s.occupancy()
            if k == 0:
                new = s.release_tail(ck, want)
                fs = want
            else:  # one int, and its dict twin on the first store's twin below
                new = s.release_tail(ck, low)
                fs = dict.fromkeys(s.pools, low)
            step(s)
            keep = {p: f // P for p, f in fs.items()}
            assert (new is None) == (not any(keep.values())) and ck not in s.state.bundles
            for p in s.pools:
                freed = s.occupancy()[p]["available"] - free0[p]["available"]
                assert freed == len(held[p]) - keep[p], (p, freed)
                if new is not None:
                    assert s.space(new, p).members == held[p][:keep[p]]
                    assert s.space(new, p).committed == keep[p] * P
                    for got, w in zip(device_bytes(s, new)[p], before[p], strict=False):
                        assert all(torch.equal(g, x) for g, x in zip(got, w, strict=True))
        twin = KVStore.open(small_config(Path(d) / "twin", backend=Backend.DFLASH))
        ck = checkpoint_per_pool(twin, {"main": 5 * P + 7, other: 2 * P + 3})
        twin.release_tail(ck, dict.fromkeys(twin.pools, low))
        step(twin)
        assert twin.digest() == stores[1].digest()
        for s in (*stores, twin):
            close_and_replay(s)
