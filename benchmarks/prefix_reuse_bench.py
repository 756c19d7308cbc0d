"""Prefix reuse on the Mooncake synthetic trace (../shared/traces): retained checkpoints with an
LRU retention policy (in tools, not in the engine); continuation by Fork/COW.

Prints prefix-hit tokens / prompt tokens next to the trace's ideal (every earlier prefix still
cached), COW copies, and µs per activation. Measures; asserts nothing.

    python benchmarks/prefix_reuse_bench.py [--limit N] [--trace FILE] [--kv-tokens N]
"""

from __future__ import annotations

import argparse
import time

from ninfer_kv.tools.simulate import DEFAULT_TRACE, SimOptions, load_trace, simulate


def ideal_hit_ratio(reqs) -> float:
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        hit += min(k * 512, r.prompt - 1)
        total += r.prompt
        seen.update(r.hash_ids)
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--kv-tokens", type=int, default=1 << 22)
    a = ap.parse_args()
    reqs = load_trace(a.trace, a.limit)
    t0 = time.perf_counter()
    _, res = simulate(reqs, SimOptions(kv_tokens=a.kv_tokens))
    wall = time.perf_counter() - t0
    d = res.to_dict()
    print(f"requests {d['requests']} (skipped {d['skipped']} over max_context), "
          f"{d['rounds']} rounds in {wall:.1f} s")
    print(f"prefix-hit tokens / prompt tokens: {d['prefix_hit_tokens']:,} / "
          f"{d['prompt_tokens']:,} = {res.hit_ratio:.3f}   "
          f"(trace ideal with unbounded cache: {ideal_hit_ratio(reqs):.3f}; "
          f"ratio {res.hit_ratio / max(1e-9, ideal_hit_ratio(reqs)):.2f})")
    print(f"COW copies {d['cow_copies']}, LRU evictions {d['evictions']}, "
          f"peak device occupancy {d['peak_occupancy']:.2f}")
    print(f"µs per activation {d['us_per_activation']}, µs per request-step "
          f"{d['us_per_request_step']}")


if __name__ == "__main__":
    main()
