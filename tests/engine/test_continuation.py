"""Engine core II: Move / Fork / partial-tail COW, backend pools, speculative rounds, lease
growth, fault injection (spec §6.2, §7.3, §9, §10)."""

from __future__ import annotations

import random

import pytest
import torch

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.continuation import STEPS
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.engine.views import CyclicKVCacheLayerView
from ninfer_kv.errors import (
    EntitlementExceeded,
    FrontierError,
    InjectedFault,
    WritePermissionError,
)
from ninfer_kv.journal.events import CopyTail, Fork, Move
from tests.engine.conftest import MakeStore

GEN = torch.Generator().manual_seed(0)


def step(s: KVStore) -> None:
    with s.boundary():
        pass
    s.check_invariants()


def write_tokens(s: KVStore, seq: int, pool: str, start: int, end: int) -> None:
    """What a GPU append would do: random bytes into every plane at [start, end)."""
    pd = s.device.pools[pool]
    row = s.space(seq, pool).row
    table = pd.block_tables[row]
    head_major = pd.geometry.order.value == "head-major"
    if s.config.checked and end > start:  # the kernels' write guard, every layer
        for layer in range(pd.geometry.layers):
            guard = s.batch_view(pool, layer).guard
            assert guard is not None
            guard(torch.full((end - start,), row, dtype=torch.int32), torch.arange(start, end))
    for pos in range(start, end):
        g, col = int(table[pos // P]), pos % P
        for layer in pd.planes:
            for t in layer.values():
                view = t[:, g, col] if head_major else t[g, :, col]
                view.copy_(torch.randint(0, 255, view.shape, generator=GEN).to(t.dtype))


def page_bytes(s: KVStore, pool: str, page: int) -> list[torch.Tensor]:
    pd = s.device.pools[pool]
    hm = pd.geometry.order.value == "head-major"
    return [(t[:, page] if hm else t[page]).clone() for layer in pd.planes for t in layer.values()]


def running(s: KVStore, tokens: int, out: int = 200) -> int:
    """A sequence with ``tokens`` tokens written and committed in every pool."""
    a = s.activate(tokens, out)
    for pool in s.pools:
        s.ensure_mapped(a, pool, tokens)
    step(s)
    for pool in s.pools:
        write_tokens(s, a, pool, 0, tokens)
        s.commit(a, pool, tokens)
    return a


def checkpoint_at(s: KVStore, tokens: int, out: int = 100) -> int:
    a = running(s, tokens, out)
    ck = s.finish(a, retain=True)
    step(s)
    assert ck is not None
    return ck


def test_worked_example_f1000_fork(make_store: MakeStore) -> None:
    """Spec §9.3: P=64, F=1000 -> 15 shared immutable full pages + 40 copied tail columns."""
    s = make_store(pages=80)
    ck = checkpoint_at(s, 1000)
    main = s.state.pools["main"]
    src = s.space(ck).members
    src_tail_dev = main.pages[src[15]].device
    before = [page_bytes(s, "main", main.pages[x].device) for x in src]
    dst = s.activate_from(ck, 1000, 1000, 200, keep_source=True)
    forks = [e for e in s._pending if isinstance(e, Fork)]
    cows = [e for e in s._pending if isinstance(e, CopyTail)]
    assert forks[0].full_pages == 15 and cows[0].columns == 40  # never rounded to 960
    step(s)
    d = s.space(dst)
    assert d.members[:15] == src[:15] and d.members[15] not in src
    assert d.committed == 1000 and d.protected == 960
    for slot in d.members[:15]:
        pg = main.pages[slot]
        assert pg.refs == 2 and pg.writer == -1 and pg.committed == P  # shared, immutable
    tail = main.pages[d.members[15]]
    assert tail.refs == 1 and tail.writer == dst and tail.committed == 40
    after_cow = page_bytes(s, "main", tail.device)
    for a_, b_ in zip(after_cow, before[15], strict=True):
        assert torch.equal(a_[:, :40], b_[:, :40])  # the 40 committed columns, bit-exact
    # further appends land only in the private tail
    s.ensure_mapped(dst, "main", 1100)
    step(s)
    write_tokens(s, dst, "main", 1000, 1100)
    s.commit(dst, "main", 1100)
    step(s)
    now = [page_bytes(s, "main", main.pages[x].device) for x in src]
    for old, new in zip(before, now, strict=True):
        for a_, b_ in zip(old, new, strict=True):
            assert torch.equal(a_, b_)  # the source checkpoint's bytes are unchanged
    assert main.pages[src[15]].device == src_tail_dev and s.space(ck).committed == 1000


def test_move_private_source(make_store: MakeStore) -> None:
    s = make_store(pages=80)
    ck = checkpoint_at(s, 1000)
    src = list(s.space(ck).members)
    dst = s.activate_from(ck, 1000, 1000, 100, keep_source=False)
    assert any(isinstance(e, Move) for e in s._pending)
    assert not any(isinstance(e, CopyTail) for e in s._pending)  # no copy
    step(s)
    assert s.space(dst).members == src and ck not in s.state.bundles  # identity kept
    tail = s.state.pools["main"].pages[src[-1]]
    assert tail.writer == dst and tail.protected == 0
    s.ensure_mapped(dst, "main", 1010)
    s.commit(dst, "main", 1010)  # the single writer appends in the unprotected suffix
    step(s)


def test_move_at_earlier_frontier_releases_the_rest(make_store: MakeStore) -> None:
    s = make_store(pages=80)
    ck = checkpoint_at(s, 1000)
    src = list(s.space(ck).members)
    tail_epoch = s.state.pools["main"].pages[src[10]].epoch
    dst = s.activate_from(ck, 650, 700, 100, keep_source=False)
    step(s)
    d = s.space(dst)
    assert d.members == src[:11] and d.committed == 650
    pg = s.state.pools["main"].pages[src[10]]
    assert pg.committed == 10 and pg.epoch == tail_epoch + 1 and pg.writer == dst


def test_fork_cases_and_errors(make_store: MakeStore) -> None:
    s = make_store(pages=120)
    ck1 = checkpoint_at(s, 1000)
    # keep_source -> Fork even though private
    a = s.activate_from(ck1, 960, 1000, 64, keep_source=True)
    assert not any(isinstance(e, CopyTail) for e in s._pending)  # page-aligned: no COW
    step(s)
    s.ensure_mapped(a, "main", 1000)
    step(s)
    write_tokens(s, a, "main", 960, 1000)
    s.commit(a, "main", 1000)
    ck2 = s.finish(a, retain=True)
    step(s)
    # ck2 shares 15 pages with ck1: Move must be refused, auto falls back to Fork + release
    d0 = s.digest()
    with pytest.raises(WritePermissionError, match="surviving references"):
        s.activate_from(ck2, 1000, 1000, 10, keep_source=False, mode="move")
    with pytest.raises(FrontierError, match="beyond its committed frontier 1000"):
        s.activate_from(ck2, 1001, 1001, 10)
    assert s.digest() == d0
    b = s.activate_from(ck2, 1000, 1000, 10, keep_source=False)
    assert any(isinstance(e, Fork) for e in s._pending)
    step(s)
    assert ck2 not in s.state.bundles and ck1 in s.state.bundles
    # a forked shared page is immutable: truncating into it is refused
    with pytest.raises(FrontierError):
        s.truncate(b, "main", 900)
    with pytest.raises(WritePermissionError, match="Move of checkpoint"):
        s.activate_from(ck1, 100, 100, 10, keep_source=True, mode="move")


@pytest.mark.parametrize("backend", [Backend.MTP, Backend.DFLASH])
def test_speculative_rounds_keep_invariants(make_store: MakeStore, backend: Backend) -> None:
    rng = random.Random(7)
    k = 4
    s = make_store(pages=96, concurrency=4, backend=backend, draft_window=k)
    backend_pool = [p for p in s.pools if p != "main"][0]
    if backend is Backend.MTP:
        assert s.state.pools["mtp"].capacity == 96 + 4 * 1  # M + C*ceil((K-1)/P)
    else:
        assert s.state.pools["draft_full"].capacity == 96
        assert s.device.pools["draft_full"].geometry.order.value == "head-major"
    seqs = [s.activate(rng.randint(10, 300), 300) for _ in range(3)]
    for b in seqs:
        for pool in s.pools:
            s.ensure_mapped(b, pool, s.state.bundles[b].budget - 300)
    step(s)
    for b in seqs:
        for pool in s.pools:
            s.commit(b, pool, s.state.bundles[b].budget - 300)
    for _round in range(60):
        live = s.active()
        main_f = {b: s.space(b, "main").committed for b in live}
        for b in live:  # verify writes K tokens in Main; MTP drafts run ahead by K-1
            s.ensure_mapped(b, "main", main_f[b] + k)
            s.set_provisional(b, "main", main_f[b] + k)
            lead = k - 1 if backend is Backend.MTP else -1  # DFlash Full lags behind Main
            s.ensure_mapped(b, backend_pool, main_f[b] + k + lead)
            s.set_provisional(b, backend_pool, main_f[b] + k + lead)
        step(s)
        for b in live:
            acc = rng.randint(1, k)
            s.commit(b, "main", main_f[b] + acc)           # each pool commits its own frontier
            s.commit(b, backend_pool, max(s.space(b, backend_pool).committed,
                                          main_f[b] + acc - (0 if backend is Backend.MTP else 1)))
            for pool in s.pools:                           # then trims rejected mappings
                s.set_provisional(b, pool, 0)
                s.trim(b, pool)
            if main_f[b] + acc + 2 * k > s.state.bundles[b].budget:
                s.finish(b, retain=rng.random() < 0.5)
        s.check_invariants()
        for b in s.active():
            for pool in s.pools:
                sp = s.space(b, pool)
                assert len(sp.members) == -(-sp.committed // P)  # rejected tails trimmed
        if not s.active():
            break
    step(s)


def test_lease_growth_bounded_completion(make_store: MakeStore) -> None:
    s = make_store(pages=40, concurrency=4, context=2048, lease_growth=True, lease_window=128,
                   lease_cushion=64)
    seqs = [s.activate(64, 1900) for _ in range(4)]
    assert all(s.space(b).entitlement == 4 for b in seqs)  # ceil((64+128+64)/64), not 33
    ended: dict[int, int] = {}
    frontier = {b: 64 for b in seqs}
    for b in seqs:
        s.ensure_mapped(b, "main", 64)
    step(s)
    for b in seqs:
        s.commit(b, "main", 64)
    for _ in range(2000):
        live = s.active()
        if not live:
            break
        g = s.grow(step_tokens=1)
        for b, cover in g.exhausted.items():
            assert cover >= frontier[b]
            s.finish(b, retain=False, reason="length")
            ended[b] = frontier[b]
        live = s.active()
        for b in live:
            sp = s.space(b)
            assert -(-(frontier[b] + 1) // P) <= sp.entitlement  # the step is covered
            s.ensure_mapped(b, "main", frontier[b] + 1)  # never EntitlementExceeded
        step(s)
        for b in live:
            frontier[b] += 1
            s.commit(b, "main", frontier[b])
            assert len(s.space(b).members) <= s.space(b).entitlement
    assert ended, "the pool was sized so that some sequence must end with length"
    from ninfer_kv.replay import replay

    live = s.digest()
    s.close()
    assert replay(s.config.journal_dir).digest == live  # Grow events replay exactly
    s = KVStore.open(s.config)
    assert all(s.state.bundles.get(b) is None for b in ended)
    with pytest.raises(EntitlementExceeded):
        b = s.activate(64, 1900)
        s.ensure_mapped(b, "main", 64 * 5)


@pytest.mark.parametrize("backend", [Backend.OFF, Backend.MTP, Backend.DFLASH])
def test_fault_injection_every_step_and_pool(make_store: MakeStore, backend: Backend) -> None:
    s = make_store(pages=80, backend=backend)
    ck = checkpoint_at(s, 1000)
    for keep in (True, False):
        for step_name in STEPS:
            for pool in s.pools:
                def hook(st: str, p: str, step_name=step_name, pool=pool) -> None:
                    if (st, p) == (step_name, pool):
                        raise InjectedFault(f"{st}/{p}")
                before = (s.digest(), s.occupancy(), len(s._pending), len(s._effects))
                s.fault_hook = hook
                with pytest.raises(InjectedFault):
                    s.activate_from(ck, 1000, 1000, 50, keep_source=keep)
                s.fault_hook = None
                assert (s.digest(), s.occupancy(), len(s._pending), len(s._effects)) == before
                assert all(pg.pins == 0 for p in s.state.pools.values() for pg in p.pages if pg)
                s.check_invariants()
    dst = s.activate_from(ck, 1000, 1000, 50, keep_source=False)
    step(s)
    assert s.space(dst).committed == 1000


def test_cyclic_view() -> None:
    v = CyclicKVCacheLayerView.allocate(2, 1, 8, 16)
    assert v.k.shape == (2, 1, 8, 16) and v.slot(13) == 5
    assert list(v.valid_range(13)) == list(range(5, 13)) and list(v.valid_range(3)) == [0, 1, 2]
