"""Prefix reuse on the Mooncake synthetic trace (../shared/traces): retained checkpoints with the
cache layer's retention policy (ninfer_kv/cache/retention.py: LRU, leaves before parents,
demote to host before release); continuation by Fork/COW.

Two runs on the same trace and device capacity: device only, and with a host tier
(``--host-tokens``, default 4x the device: what a serving box's DRAM holds next to its HBM).
Each prints prefix-hit tokens / prompt tokens next to the trace's ideal (an unbounded cache:
every earlier prefix still held) and their ratio (the issue's bar: >= 0.90 with the host tier),
evictions, demotions, COW copies and µs per activation. Measures; asserts nothing.

The model geometry is one layer, one KV head, head_dim 16 (4 KiB pages): hit ratios depend on
page counts, not bytes, and small pages keep the host tier's real copies and CRCs cheap.

    python benchmarks/prefix_reuse_bench.py [--limit N] [--trace FILE] [--kv-tokens N]
                                            [--host-tokens N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from ninfer_kv.engine.layout import P
from ninfer_kv.tools.simulate import (
    DEFAULT_TRACE,
    HASH_BLOCK,
    Request,
    SimOptions,
    load_trace,
    make_store,
    simulate,
)

GEOMETRY = {"layers": 1, "kv_heads": 1, "head_dim": 16}


def ideal_hit_ratio(reqs: Sequence[Request]) -> float:
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        hit += min(k * HASH_BLOCK, r.prompt - 1)
        total += r.prompt
        seen.update(r.hash_ids)
    return hit / total


def host_bytes_for(tokens: int, opts: SimOptions) -> int:
    """Host arena bytes that hold ``tokens`` tokens of every pool (its real page bytes)."""
    store = make_store(opts)
    try:
        return -(-tokens // P) * sum(s.page_bytes for s in store.state.pool_specs)
    finally:
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--kv-tokens", type=int, default=1 << 22)
    ap.add_argument("--host-tokens", type=int, default=4 << 22)
    a = ap.parse_args()
    reqs = load_trace(a.trace, a.limit)
    ideal = ideal_hit_ratio(reqs)
    base = SimOptions(kv_tokens=a.kv_tokens, **GEOMETRY)  # type: ignore[arg-type]
    runs = {"device only": base,
            f"host tier {a.host_tokens:,} tokens": SimOptions(
                kv_tokens=a.kv_tokens, offload=True,
                host_bytes=host_bytes_for(a.host_tokens, base), **GEOMETRY)}  # type: ignore[arg-type]
    print(f"{len(reqs)} requests, device {a.kv_tokens:,} tokens; trace ideal (unbounded cache) "
          f"hit ratio {ideal:.3f}")
    for name, opts in runs.items():
        t0 = time.perf_counter()
        _, res = simulate(reqs, opts)
        wall = time.perf_counter() - t0
        d = res.to_dict()
        print(f"{name}: hit {res.hit_ratio:.3f} of ideal {ideal:.3f} = "
              f"{res.hit_ratio / max(1e-9, ideal):.2f}  ({d['prefix_hit_tokens']:,} / "
              f"{d['prompt_tokens']:,} prompt tokens; {d['skipped']} over max_context)")
        print(f"  evictions {d['evictions']}, demotions {d['demotions']}, offloaded pages "
              f"{d['offloaded_pages']:,}, COW copies {d['cow_copies']}, refused admissions "
              f"{d['refused_admissions']}, peak device occupancy {d['peak_occupancy']:.2f}")
        print(f"  µs per activation {d['us_per_activation']}, µs per request-step "
              f"{d['us_per_request_step']}; {d['rounds']} rounds in {wall:.1f} s")


if __name__ == "__main__":
    main()
