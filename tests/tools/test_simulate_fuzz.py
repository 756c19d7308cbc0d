"""The simulator as a randomized end-to-end check of the cache layer on top of the store: random
small traces and pools (MTP, host tier, live sharing, lease windows, checked mode, tiny host
arenas) must finish — every output token out, no livelock (``simulate`` raises after
``STALL_ROUNDS`` idle refusals), invariants clean, the journal replaying to the live digest
with no violation, every preemption resumed or recomputed. Seeds 236, 243 and 279 livelocked
before make_room re-armed partly demoted checkpoints (an external review's fuzz)."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer_kv.replay import replay
from ninfer_kv.tools.simulate import Request, SimOptions, simulate

CTX = 2048


def scenario(seed: int, journal: str) -> tuple[list[Request], SimOptions]:
    rng = random.Random(seed * 7919)
    mtp, offload, share = rng.random() < .5, rng.random() < .5, rng.random() < .5
    pages = rng.choice([32, 33, 36, 40, 48])
    host = rng.choice([1 << 14, 1 << 16, 1 << 20])
    window = rng.choice([16, 64, 128, 512])
    conc = rng.choice([2, 3, 6])
    reqs, t = [], 0
    for i in range(rng.randint(4, 14)):
        t += rng.choice([0, 0, 10, 50])
        nb = rng.randint(1, 6)
        base = rng.randint(0, 2)
        hashes = tuple(base * 100 + j for j in range(nb))
        prompt = rng.randint(2, 1400)
        out = rng.randint(1, 1500)
        if prompt + out + 4 > CTX:
            out = max(1, CTX - prompt - 5)
        reqs.append(Request(i, t, prompt, out, hashes))
    scale = rng.choice([1, 2, 4])
    checked = rng.random() < .3
    return reqs, SimOptions(max_concurrency=conc, max_context=CTX, kv_tokens=pages * 64,
                            lease_window=window, layers=1, kv_heads=1, head_dim=16,
                            host_bytes=host, mtp=mtp, offload=offload, share=share,
                            journal_dir=journal, seed=seed, scale=scale, checked=checked,
                            allocate_planes=checked)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 10_000))
@example(236)
@example(243)
@example(279)
def test_random_small_simulations_finish_exactly(tmp_path_factory, seed: int) -> None:  # noqa: ANN001
    journal = str(Path(tmp_path_factory.mktemp("sim")) / "j")
    reqs, opts = scenario(seed, journal)
    store, res = simulate(reqs, opts)
    k = 4 if opts.mtp else 1
    sizes = [(max(2, r.prompt // opts.scale), max(1, r.output // opts.scale))
             if opts.scale > 1 else (r.prompt, r.output) for r in reqs]
    assert res.output_tokens == sum(o for p, o in sizes if p + o + k <= CTX)
    assert res.swap_ins + res.recomputed == res.swaps
    store.check_invariants()
    digest = store.digest()
    store.close()
    r = replay(journal, verify_every=50)
    assert r.digest == digest and not r.violations
