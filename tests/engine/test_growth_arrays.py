"""kv_lease_growth on arrays (engine/growth.py) against the per-sequence loop it replaced,
on random stores: the same Grow events and the same exhausted sequences."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_kv.engine.bundle_table import from_dense
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.layout import P, PoolKind, ceil_div
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import KVStoreError
from ninfer_kv.journal import events as ev
from tests.engine.conftest import small_config


def oracle(store: KVStore, step_tokens: int) -> tuple[list[tuple[str, list[int], list[int]]],
                                                      dict[int, int]]:
    """The loop growth.grow used before the arrays (ac36cac), emitting nothing — with the
    later fix that the window tops up at least the step (``max(lease_window, step)``)."""
    cfg, st = store.config, store.state
    lead_mtp = cfg.serving.draft_window - 1
    active = sorted(b for b, x in st.bundles.items() if x.active)
    events, covers = [], {}
    for name in store.pools:
        pool = st.pools[name]
        lead = lead_mtp if name == PoolKind.MTP.value else 0
        available = pool.available
        ids, adds = [], []
        for b in active:
            sp = pool.spaces[b]
            budget = st.bundles[b].budget or store.plan.S
            window = max(cfg.lease_window, step_tokens)
            target = min(budget, sp.committed + window + cfg.lease_cushion) + lead
            want = min(pool.logical_pages, ceil_div(target, P)) - sp.entitlement
            got = max(0, min(want, available))
            if got:
                ids.append(b)
                adds.append(got)
                available -= got
            ent = sp.entitlement + got
            need = min(min(budget, sp.committed + step_tokens + cfg.lease_cushion) + lead,
                       pool.logical_pages * P)
            if ceil_div(need, P) > ent:
                covers[b] = min(covers.get(b, 1 << 62), max(sp.committed, ent * P - lead))
        if ids:
            events.append((name, ids, adds))
    return events, covers


@pytest.mark.parametrize("seed,pages", [(seed, 40) for seed in range(4)]
                         + [(seed, 20) for seed in range(4, 8)])
def test_grow_matches_the_loop(seed: int, pages: int) -> None:
    """Roomy pools (grants) and tight ones (exhausted sequences)."""
    rng = random.Random(seed)
    s = KVStore.open(small_config(None, pages=pages, concurrency=6, context=pages * 64 // 40 * 32,
                                  backend=Backend.MTP if seed % 2 else Backend.OFF,
                                  lease_growth=True, lease_window=rng.choice([64, 128, 300]),
                                  lease_cushion=rng.choice([0, 64])))
    granted = exhausted = 0
    for _ in range(150):
        seqs = sorted(s.active())
        op = rng.random()
        try:
            if op < 0.3 or not seqs:
                s.activate(rng.randint(1, 400), rng.randint(1, 600))
            elif op < 0.95:
                b = rng.choice(seqs)
                for pool in s.pools:
                    sp = s.space(b, pool)
                    f = min(sp.entitlement * P, sp.committed + rng.randint(1, 200))
                    s.ensure_mapped(b, pool, f)
                with s.boundary():
                    pass
                for pool in s.pools:
                    sp = s.space(b, pool)
                    s.commit(b, pool, min(sp.nmem * P, sp.committed + rng.randint(1, 200)))
            else:
                s.finish(rng.choice(seqs))
        except KVStoreError:
            pass
        step = rng.randint(1, 8)
        want_events, want_covers = oracle(s, step)
        n = len(s._pending)
        got = s.grow(step)
        emitted = [(e.pool, ev.unpack(e.bundles).tolist(), ev.unpack(e.pages).tolist())
                   for e in s._pending[n:] if isinstance(e, ev.Grow)]
        assert emitted == want_events
        assert got.exhausted == want_covers
        assert got.granted == {name: sum(a) for name, _, a in want_events}
        granted += bool(got.granted)
        exhausted += bool(got.exhausted)
        with s.boundary():
            pass
        s.check_invariants()
    assert granted and (exhausted or pages == 40)  # the branches under test ran
    s.close()


@pytest.mark.parametrize("window,cushion", [(1, 64), (1, 0), (3, 0), (4, 0)])
def test_a_window_shorter_than_the_step_still_grows(window: int, cushion: int) -> None:
    """Review repro: MTP steps 4 tokens; with lease_window < 4 the grant target stayed below
    what the step needs, so a sequence near a page edge was 'exhausted' on every round with
    the pool nearly empty (the simulator livelocked)."""
    s = KVStore.open(small_config(None, pages=40, backend=Backend.MTP, lease_growth=True,
                                  lease_window=window, lease_cushion=cushion))
    seq = s.activate(64 * 3 - 2, 500)                    # its frontier near a page edge
    for pool in s.pools:
        s.ensure_mapped(seq, pool, 64 * 3 - 2 + (3 if pool == "mtp" else 0))
    with s.boundary():
        pass
    for pool in s.pools:
        s.commit(seq, pool, 64 * 3 - 2)
    assert s.grow(4).exhausted == {}
    for pool in s.pools:                                 # and the step then maps
        s.ensure_mapped(seq, pool, 64 * 3 + 2 + (3 if pool == "mtp" else 0))
    s.check_invariants()


def numpy_grow(ids, bundle_index, committed_all, ent_all, budget_all, ceiling, logical_pages,
               window, cushion, step, lead, available):
    """The numpy version of one pool's grow this kernel replaced (409a30d's growth.py)."""
    import numpy as np

    idx = bundle_index[ids]
    committed, ent = committed_all[idx], ent_all[idx]
    budget = np.where(budget_all[idx] > 0, budget_all[idx], ceiling)
    target = np.minimum(budget, committed + window + cushion) + lead
    want = np.maximum(np.minimum(logical_pages, -(-target // P)) - ent, 0)
    before = np.cumsum(want) - want
    got = np.clip(available - before, 0, want)
    ent = ent + got
    need = np.minimum(np.minimum(budget, committed + step + cushion) + lead, logical_pages * P)
    short = -(-need // P) > ent
    missing = 0
    if short.any():
        left = want - got
        ahead = np.cumsum(left) - left
        deficit = -(-need // P) - ent
        missing = int((ahead + deficit)[short].max() - (available - got.sum()))
    cover = np.where(short, np.maximum(committed, ent * P - lead), -1)
    return got.tolist(), cover.tolist(), int(got.sum()), missing, int(short.sum())


@settings(max_examples=300, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 3))
def test_grow_pool_matches_numpy(rnd, lead: int) -> None:
    """``round_kernels.grow_pool`` against the numpy version it replaced, ``short`` included
    (the pages a retry needs freed), on random spaces and pool availability."""
    import numpy as np

    from ninfer_kv.engine import round_kernels as rk

    n, lp = rnd.randint(0, 8), rnd.randint(1, 12)
    ids = np.array(sorted(rnd.sample(range(20), n)), np.int64)
    bundle_index = np.full(20, -1, np.int64)
    bundle_index[ids] = rnd.sample(range(n), n) if n else []
    ent = np.array([rnd.randint(0, lp) for _ in range(n)], np.int64)
    committed = np.array([rnd.randint(0, int(e) * P) for e in ent], np.int64)
    budget = np.array([rnd.choice([0, rnd.randint(1, lp * P + 50)]) for _ in range(n)],
                      np.int64)
    args = (ids, bundle_index, committed, ent, budget, lp * P, lp, rnd.randint(1, 200),
            rnd.choice([0, 64]), rnd.randint(1, 8), lead, rnd.randint(0, 3 * n + 2))
    got, cover, granted, short, n_short = rk.grow_pool(args[0], from_dense(args[1]), *args[2:])
    assert (got.tolist(), cover.tolist(), granted, short, n_short) == numpy_grow(*args)


def test_a_decoded_snapshot_keeps_each_space_budget() -> None:
    """``grow`` reads each active space's budget from an array (``sp_budget``, set by
    Activate); a state decoded from a snapshot (a TP follower's, a standby's) must hold the
    same, or its grants would differ from the leader's."""
    from ninfer_kv.engine.state import decode_state, encode_state

    s = KVStore.open(small_config(None, pages=40, backend=Backend.MTP, lease_growth=True,
                                  lease_window=64))
    seqs = [s.activate(100 + 50 * k, 300 + 100 * k) for k in range(3)]
    for pool in s.pools:
        s.ensure_mapped(seqs[0], pool, 130)
    with s.boundary():
        pass
    for pool in s.pools:
        s.commit(seqs[0], pool, 130)
    shared = s.share_prefix(seqs[0])  # a checkpoint whose bundle budget is its 2 pages
    st = decode_state(encode_state(s.state))
    for name in s.pools:
        a, b = s.state.pools[name], st.pools[name]
        got = [b.spaces[x].budget for x in seqs]
        assert got == [a.spaces[x].budget for x in seqs] == [400 + 150 * k for k in range(3)]
        assert b.spaces[shared].budget == a.spaces[shared].budget == 2 * P
        assert sorted(b.sp_bundle[b.sp_active].tolist()) == sorted(seqs)
        assert {x: b.spaces[x].budget for x in b.spaces} == \
            {x: a.spaces[x].budget for x in a.spaces}
    s.close()


def test_grow_refuses_an_active_sequence_without_a_space() -> None:
    """``grow_pool`` looks every active bundle of the first pool up in each pool: one with no
    space there (a damaged journal; commands activate every pool) is refused, never read
    past the index array."""
    import numpy as np

    from ninfer_kv.engine import round_kernels as rk

    z = np.zeros(2, np.int64)
    for bundle_index in (np.array([0, -1], np.int64), np.array([0], np.int64)):
        with pytest.raises(ValueError, match="no space in this pool"):
            rk.grow_pool(np.array([0, 1], np.int64), from_dense(bundle_index), z, z, z, 640, 10, 1, 0, 1,
                         0, 5)
