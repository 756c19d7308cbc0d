"""HostKVArena extent allocator: random recipes against a byte-level reference model; the
planning call approves exactly the recipes that then succeed."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.engine.host_arena import ALIGN, ExtentAllocator

CAP = 64 * ALIGN


def occupancy_model(a: ExtentAllocator) -> list[bool]:
    used = [False] * (a.capacity // ALIGN)
    for off, size in a.live.items():
        for i in range(off // ALIGN, (off + size) // ALIGN):
            assert not used[i], "live extents overlap"
            used[i] = True
    return used


def execute(a: ExtentAllocator, releases: list[int], sizes: list[int]) -> list[int] | None:
    for off in releases:
        a.free(off)
    out = []
    for s in sizes:
        off = a.best_fit(s)
        if off is None:
            return None
        a.allocate(off, s)
        out.append(off)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=40),
       st.lists(st.integers(1, 20), max_size=6), st.integers(0, 2**16))
def test_random_recipes_vs_reference(history, recipe_sizes, seed) -> None:
    rng = random.Random(seed)
    a = ExtentAllocator(CAP)
    for is_alloc, units in history:
        if is_alloc:
            off = a.best_fit(units * ALIGN)
            if off is not None:
                a.allocate(off, units * ALIGN)
        elif a.live:
            a.free(rng.choice(list(a.live)))
        assert not a.violations()
        used = occupancy_model(a)
        assert sum(used) * ALIGN == a.live_bytes == CAP - a.free_bytes
    releases = rng.sample(list(a.live), k=min(len(a.live), rng.randint(0, 3)))
    sizes = [u * ALIGN for u in recipe_sizes]
    before = (dict(a.by_off), dict(a.live))
    planned = a.plan(releases, sizes)
    assert (dict(a.by_off), dict(a.live)) == before  # planning mutates nothing
    got = execute(a, releases, sizes)
    assert planned == got  # approves exactly what then succeeds, at the same offsets
    if got is not None:
        assert not a.violations()
        occupancy_model(a)


def test_coalescing_and_best_fit() -> None:
    a = ExtentAllocator(10 * ALIGN)
    for i in range(10):
        a.allocate(i * ALIGN, ALIGN)
    for i in (1, 2, 5, 7, 8):
        a.free(i * ALIGN)
    assert dict(a.by_off) == {ALIGN: 2 * ALIGN, 5 * ALIGN: ALIGN, 7 * ALIGN: 2 * ALIGN}
    assert a.best_fit(ALIGN) == 5 * ALIGN          # the smallest hole that fits
    assert a.best_fit(2 * ALIGN) == ALIGN          # lowest offset among equal sizes
    assert a.best_fit(3 * ALIGN) is None           # 5 free units, but no 3 adjacent
    assert a.free_bytes == 5 * ALIGN
    assert a.plan([6 * ALIGN], [4 * ALIGN]) == [5 * ALIGN]  # a release that makes room


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 700)), max_size=60),
       st.lists(st.sampled_from([1, 63, 64, 65, 128, 200, 640]), max_size=40),
       st.integers(0, 2**16))
def test_plan_without_releases_is_sequential_best_fit(history, sizes, seed) -> None:
    """``plan([], sizes)`` runs on an overlay, not a copy: it must approve exactly what
    sequential best fit then does, at the same offsets (unaligned sizes, repeated sizes)."""
    rng = random.Random(seed)
    a = ExtentAllocator(CAP * 4)
    for is_alloc, size in history:
        if is_alloc:
            off = a.best_fit(size)
            if off is not None:
                a.allocate(off, size)
        elif a.live:
            a.free(rng.choice(list(a.live)))
    before = (dict(a.by_off), list(a.by_size), dict(a.live), a.free_bytes, a.live_bytes)
    planned = a.plan([], sizes)
    assert (dict(a.by_off), list(a.by_size), dict(a.live), a.free_bytes, a.live_bytes) == before
    assert planned == execute(a, [], sizes)
    assert not a.violations()


def test_violations_names_each_damage() -> None:
    """Each rule of ``ExtentAllocator.violations`` reports its own damage (and only a
    damaged arena is reported)."""
    def damaged(hurt) -> list[str]:  # noqa: ANN001
        a = ExtentAllocator(CAP)
        a.allocate(0, 2 * ALIGN)
        assert not a.violations()
        hurt(a)
        return a.violations()

    totals = damaged(lambda a: setattr(a, "live_total", a.live_total + ALIGN))
    assert totals == [f"host arena: running totals free {CAP - 2 * ALIGN} / live "
                      f"{3 * ALIGN} B, extents sum to {CAP - 2 * ALIGN} / {2 * ALIGN} B"]
    free = damaged(lambda a: setattr(a, "free_total", 0))
    assert len(free) == 1 and "running totals free 0 " in free[0]
    gap = damaged(lambda a: a.live.update({0: ALIGN}))  # a live extent shrunk: a gap after it
    assert f"host arena: gap or overlap at {ALIGN} (next free extent at {2 * ALIGN})" in gap
    assert "host arena: free + live != capacity" in gap
