"""A refusal for want of pages says how many are missing (``CapacityExhausted.short``,
``GrowResult.short``): an engine's eviction frees exactly that many and retries — no more
(a cached prefix evicted for nothing) and no fewer (a second refusal)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import CapacityExhausted
from tests.engine.conftest import small_config
from tests.engine.test_continuation import checkpoint_at, running, step


def refusal(call: Callable[[], object]) -> CapacityExhausted:
    with pytest.raises(CapacityExhausted) as exc:
        call()
    return exc.value


def free_pages(s: KVStore, ck: int, n: int) -> int:
    """``ck`` gives up ``n`` whole tail pages it holds alone; returns the checkpoint left."""
    before = s.occupancy()["main"]["available"]
    new = s.release_tail(ck, (len(s.space(ck).members) - n) * P)
    step(s)
    assert s.occupancy()["main"]["available"] == before + n
    assert new is not None
    return new


CALLS: dict[str, Callable[[KVStore, int], object]] = {
    "activate": lambda s, src: s.activate(10 * P, 64),
    "activate_from": lambda s, src: s.activate_from(src, 2 * P + 5, 9 * P, 64),
    "fork_live": lambda s, src: s.fork_live(src, 9 * P, 2 * P + 5),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_freeing_short_pages_lets_the_retry_pass(tmp_path: Path, name: str) -> None:
    s = KVStore.open(small_config(tmp_path, pages=32, lease_growth=True,
                                  lease_window=8 * P, lease_cushion=0))
    src = running(s, 3 * P) if name == "fork_live" else checkpoint_at(s, 3 * P, out=0)
    cache = checkpoint_at(s, 24 * P, out=0)   # the cache an engine evicts from
    call = CALLS[name]
    exc = refusal(lambda: call(s, src))
    assert exc.pool == "main" and exc.short > 1, exc
    cache = free_pages(s, cache, exc.short - 1)
    assert refusal(lambda: call(s, src)).short == 1   # one page fewer: still refused
    free_pages(s, cache, 1)
    call(s, src)
    step(s)
    s.close()


def test_rows_are_not_pages(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=32, concurrency=1))
    s.activate(P, 10)
    exc = refusal(lambda: s.activate(P, 10))
    assert exc.short == 0 and "rows" in str(exc)
    s.close()


def test_grow_says_how_many_pages_its_exhausted_sequences_lack(tmp_path: Path) -> None:
    s = KVStore.open(small_config(tmp_path, pages=24, context=1024, lease_growth=True,
                                  lease_window=P, lease_cushion=0))
    seqs = [running(s, 2 * P, out=400) for _ in range(3)]  # entitled to 3 pages each
    cache = checkpoint_at(s, s.occupancy()["main"]["available"] * P, out=0)
    for a in seqs:                                 # every sequence at its entitlement's end
        s.ensure_mapped(a, "main", 3 * P)
    step(s)
    for a in seqs:
        s.commit(a, "main", 3 * P)
    assert s.occupancy()["main"]["available"] == 0
    res = s.grow(1)
    assert set(res.exhausted) == set(seqs) and res.short == {"main": 3}
    cache = free_pages(s, cache, 2)
    res = s.grow(1)
    assert len(res.exhausted) == 1 and res.short == {"main": 1}
    free_pages(s, cache, 1)
    res = s.grow(1)
    assert not res.exhausted and not res.short
    s.close()


@pytest.mark.parametrize("window", [P, 4 * P])
def test_grow_short_counts_the_windows_earlier_sequences_take_first(
        tmp_path: Path, window: int) -> None:
    """Review repro: with a window wider than the step, a retry hands freed pages to earlier
    sequences' windows first (first come, first served); ``short`` counts them."""
    s = KVStore.open(small_config(tmp_path, pages=20, context=1024, lease_growth=True,
                                  lease_window=window, lease_cushion=0))
    seqs = [running(s, 2 * P, out=700) for _ in range(2)]
    cache = checkpoint_at(s, s.occupancy()["main"]["available"] * P, out=0)
    for a in seqs:
        s.ensure_mapped(a, "main", s.space(a).entitlement * P)
    step(s)
    for a in seqs:
        s.commit(a, "main", s.space(a).entitlement * P)
    res = s.grow(1)
    short = res.short["main"]
    assert len(res.exhausted) == 2 and short >= 2
    cache = free_pages(s, cache, short - 1)
    assert s.grow(1).exhausted                         # one page fewer: still short
    free_pages(s, cache, 1)
    assert not s.grow(1).exhausted
    s.close()
