"""CPU kernels beside busy processes: each workload with every kernel forced onto numba's
parallel loop (the behaviour before ``jit.SERIAL_BELOW``) and with the default choice (small
work on the calling thread), on an idle machine and with ``--busy`` processes spinning (default:
one per core). Prints the median and 90th percentile µs of each and the ratio. Measures;
asserts nothing.

A parallel region ends at a barrier that waits for every worker; a worker the scheduler has
descheduled for a busy process holds it for a time slice. Small work pays that in full.

    python benchmarks/contention_bench.py [--busy N] [--repeats 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable

import torch

from ninfer_kv.engine.layout import P, PlaneOrder, PoolKind, Profile, pool_geometry
from ninfer_kv.engine.views import PagedKVBatchLayerView
from ninfer_kv.kernels import jit
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode
from ninfer_kv.kernels.copy import copy_tails

HEADS, D = 8, 128


def spin() -> None:
    while True:
        pass


def view(pages: int, rows: int) -> PagedKVBatchLayerView:
    """One BF16 layer of ``pages`` page groups; row r maps pages [r * L, (r + 1) * L)."""
    g = pool_geometry(PoolKind.MAIN, Profile.BF16, 1, HEADS, D, pages)
    planes = {k: torch.randn(g.shape(p)).to(p.dtype) if p.dtype.is_floating_point
              else torch.zeros(g.shape(p), dtype=p.dtype)
              for k, p in g.layer_planes(0).items()}
    per = pages // rows
    tables = torch.arange(rows * per, dtype=torch.int32).reshape(rows, per)
    return PagedKVBatchLayerView(planes["k_code"], planes["v_code"], None, None, tables, D,
                                 HEADS, Profile.BF16, g.order)


def workloads() -> dict[str, Callable[[], object]]:
    small = view(64, 8)
    big = view(1024, 64)
    rows8, rows64 = torch.arange(8, dtype=torch.int32), torch.arange(64, dtype=torch.int32)
    q8, q64 = torch.randn(8, HEADS, D), torch.randn(64, HEADS, D)
    kv8 = torch.randn(8, HEADS, D)
    planes = [small.k_pages, small.v_pages]
    return {
        "COW tail, 1 Fork (2 planes)": lambda: copy_tails(planes, PlaneOrder.PAGE_MAJOR, [1],
                                                          [60], [17]),
        "append, 8 tokens": lambda: append_kv(small, rows8, torch.full((8,), 100,
                                                                      dtype=torch.int32),
                                              kv8, kv8),
        "decode, 8 rows x 200 tokens": lambda: paged_decode(
            q8, small, rows8, torch.full((8,), 200, dtype=torch.int32)),
        "decode, 64 rows x 1000 tokens": lambda: paged_decode(
            q64, big, rows64, torch.full((64,), 1000, dtype=torch.int32)),
    }


def sample(fn: Callable[[], object], repeats: int, budget_s: float) -> list[float]:
    fn()
    out: list[float] = []
    end = time.perf_counter() + budget_s
    while len(out) < repeats and (len(out) < 5 or time.perf_counter() < end):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(cases: dict[str, Callable[[], object]], repeats: int, budget_s: float) -> None:
    print(f"  {'workload':32s} {'parallel med/p90 us':>22s} {'default med/p90 us':>22s} "
          f"{'ratio':>7s}")
    for name, fn in cases.items():
        with jit.forcing(True):
            par = sample(fn, repeats, budget_s)
        ours = sample(fn, repeats, budget_s)
        pm, dm = statistics.median(par), statistics.median(ours)
        p90 = sorted(par)[int(0.9 * (len(par) - 1))]
        d90 = sorted(ours)[int(0.9 * (len(ours) - 1))]
        print(f"  {name:32s} {pm * 1e6:10.1f} /{p90 * 1e6:9.1f} {dm * 1e6:10.1f} /"
              f"{d90 * 1e6:9.1f} {pm / dm:7.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per measurement at most")
    a = ap.parse_args()
    cases = workloads()
    with jit.forcing(False):  # compile both twins before timing
        for fn in cases.values():
            fn()
    print(f"P={P}, {HEADS} KV heads, head_dim {D}, numba threads {jit.numba.get_num_threads()},"
          f" grain {jit.SERIAL_BELOW} element operations")
    print("idle:")
    run(cases, a.repeats, a.budget)
    procs = [mp.Process(target=spin, daemon=True) for _ in range(a.busy)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5)
        print(f"beside {a.busy} busy processes:")
        run(cases, a.repeats, a.budget)
    finally:
        for p in procs:
            p.terminate()


if __name__ == "__main__":
    main()
