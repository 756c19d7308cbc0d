"""The simulator's lease growth and preemption: when running requests outgrow the pool, the
most recently admitted one is swapped out (to the host tier, or retained for the retention
policy) and later resumed or recomputed — every request still completes with all its output,
and the journal replays to the same digest. Without lease growth nothing is preempted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ninfer_kv.replay import replay
from ninfer_kv.tools.simulate import Request, SimOptions, simulate

# eight requests of 300 prompt + 1,500 output tokens at once, on a pool of 64 pages
# (4,096 tokens): each needs 29 pages to finish, so at most two finish side by side
REQS = [Request(i, 0, 300, 1500, (100 + i,)) for i in range(8)]
OPTS = SimOptions(max_concurrency=8, max_context=2048, kv_tokens=64 * 64, lease_window=128,
                  layers=1, kv_heads=1, head_dim=16, host_bytes=4 << 20)


@pytest.mark.parametrize("offload", [True, False])
def test_outgrown_requests_are_preempted_and_still_complete(tmp_path: Path,
                                                            offload: bool) -> None:
    opts = dataclasses.replace(OPTS, offload=offload, journal_dir=str(tmp_path / "j"))
    store, res = simulate(REQS, opts)
    store.check_invariants()
    assert res.output_tokens == sum(r.output for r in REQS)
    assert res.requests == len(REQS) and res.refused_admissions >= 0
    assert res.swaps > 0
    assert res.swap_ins + res.recomputed == res.swaps
    if offload:
        assert res.swap_ins == res.swaps   # the host tier keeps every preempted request
    assert store.active() == []
    digest = store.digest()
    store.close()
    assert replay(str(tmp_path / "j")).digest == digest
    d = res.to_dict()
    assert (d["swaps"], d["swap_ins"], d["recomputed"]) == (res.swaps, res.swap_ins,
                                                             res.recomputed)


def test_without_lease_growth_nothing_is_preempted() -> None:
    store, res = simulate(REQS, dataclasses.replace(OPTS, lease_growth=False))
    store.check_invariants()
    assert res.output_tokens == sum(r.output for r in REQS)
    assert res.swaps == 0 and res.refused_admissions > 0   # waits for whole budgets instead
    store.close()


def test_review_livelock_repro_finishes(tmp_path: Path) -> None:
    """Review repro (live sharing, host tier, lease growth, a tiny pool): a partly demoted
    checkpoint the retention policy then skipped forever stalled the queue head with nothing
    running. Every output token must come out, and the journal replay the same digest."""
    rows = [(50, 512, 1097, (200, 201, 202, 203)), (60, 685, 91, (0, 1, 2)),
            (60, 1006, 642, (100, 101, 102, 103, 104)), (60, 781, 474, (100, 101, 102, 103, 104)),
            (60, 635, 1408, (100,)), (60, 779, 1241, (100, 101, 102)),
            (60, 969, 1074, (100, 101, 102, 103, 104)), (60, 125, 113, (0, 1, 2, 3, 4)),
            (60, 437, 1109, (200, 201)), (70, 343, 387, (0, 1, 2, 3)),
            (80, 577, 307, (200, 201, 202, 203, 204)), (90, 1350, 693, (200, 201, 202)),
            (90, 152, 642, (100,)), (100, 1341, 702, (200, 201, 202, 203, 204, 205))]
    reqs = [Request(i, t, p, o, h) for i, (t, p, o, h) in enumerate(rows)]
    opts = SimOptions(max_concurrency=2, max_context=2048, kv_tokens=40 * 64, layers=1,
                      kv_heads=1, head_dim=16, offload=True, share=True, host_bytes=1 << 20,
                      lease_window=64, journal_dir=str(tmp_path / "j"))
    store, res = simulate(reqs, opts)
    store.check_invariants()
    assert res.output_tokens == sum(r.output for r in reqs)
    digest = store.digest()
    store.close()
    assert replay(str(tmp_path / "j")).digest == digest


def test_mtp_with_a_window_shorter_than_the_draft_finishes() -> None:
    """Second review repro: MTP steps 4 tokens, lease_window 1 — grow never covered the step
    and the run stalled with the pool nearly empty."""
    opts = dataclasses.replace(OPTS, mtp=True, lease_window=1, offload=True)
    store, res = simulate(REQS[:3], opts)
    store.check_invariants()
    assert res.output_tokens == sum(r.output for r in REQS[:3])
    store.close()
