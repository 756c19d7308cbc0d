"""Partial-tail COW copies at a boundary (spec §9.3): a batch of k Forks at mid-page frontiers,
copied one pair at a time (one kernel call per plane per Fork: the boundary before
``engine/effects.py``) and as one batch (``copy_tails``: one call per plane). Planes of a real
model's geometry (default: 32 layers, 8 KV heads, head_dim 128, BF16: 64 planes), on this
machine's device (the CPU kernels here). Prints µs per Fork for both, their ratio, and the
bytes each Fork copies against this machine's memcpy bandwidth. Measures; asserts nothing.

    python benchmarks/cow_bench.py [--forks 16] [--layers 32] [--heads 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse

import torch
from timing import best_of, memcpy_gbps

from ninfer_kv.engine.layout import P, PlaneOrder
from ninfer_kv.kernels.copy import copy_tail, copy_tails


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--columns", type=int, default=17, help="committed columns of each tail")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    k = a.forks
    pages = 2 * k + 2
    planes = [torch.randn(pages, a.heads, P, a.head_dim).to(torch.bfloat16)  # page-major
              for _ in range(2 * a.layers)]                                    # K and V
    src, dst, cols = list(range(k)), list(range(k, 2 * k)), [a.columns] * k

    def one_at_a_time() -> None:
        for s, d, c in zip(src, dst, cols, strict=True):
            copy_tail(planes, PlaneOrder.PAGE_MAJOR, s, d, c)

    def batched() -> None:
        copy_tails(planes, PlaneOrder.PAGE_MAJOR, src, dst, cols)

    old = best_of(one_at_a_time, a.repeats) / k
    new = best_of(batched, a.repeats) / k
    per_fork = len(planes) * a.heads * a.columns * a.head_dim * 2
    gbps = memcpy_gbps(1 << 26)
    print(f"{k} Forks per boundary, {len(planes)} planes, {per_fork / 1e6:.2f} MB per Fork "
          f"({a.columns} columns)")
    print(f"  one call per plane per Fork   {old * 1e6:9.1f} us per Fork")
    print(f"  one call per plane (batched)  {new * 1e6:9.1f} us per Fork   ratio {old / new:.2f}x")
    print(f"  memcpy of the same bytes      {per_fork / gbps / 1e3:9.1f} us per Fork "
          f"({gbps:.1f} GB/s numpy)")


if __name__ == "__main__":
    main()
