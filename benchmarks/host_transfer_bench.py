"""Host transfers on CPU tensors: pack (D2H) and unpack (H2D) of page runs with contiguous
vs random page ids, as a fraction of this machine's memcpy bandwidth measured in the same
run. Prints; asserts nothing.

    python benchmarks/host_transfer_bench.py [--pages 2048]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from timing import best_of, memcpy_gbps

from ninfer_kv.engine.host import runs
from ninfer_kv.engine.layout import PoolKind, Profile, pool_geometry
from ninfer_kv.kernels.copy import host_page_bytes, pack_pages, unpack_pages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=2048)
    a = ap.parse_args()
    g = pool_geometry(PoolKind.MAIN, Profile.BF16, 2, 4, 128, 2 * a.pages)
    planes = [torch.randint(0, 255, g.shape(p), dtype=torch.uint8).view(p.dtype)
              if p.dtype != torch.uint16 else torch.randint(0, 60000, g.shape(p),
                                                            dtype=torch.int32).to(torch.uint16)
              for p in g.planes]
    pb = host_page_bytes(planes, g.order)
    host = torch.empty(a.pages, pb, dtype=torch.uint8)
    total = a.pages * pb
    mem = memcpy_gbps(total)
    print(f"{a.pages} pages x {pb} B = {total / 2**20:.0f} MiB per transfer; "
          f"memcpy {mem:.1f} GB/s")
    rng = np.random.default_rng(0)
    for name, ids in (("contiguous", list(range(a.pages))),
                      ("random", rng.permutation(2 * a.pages)[:a.pages].tolist())):
        d2h = total / best_of(lambda ids=ids: pack_pages(planes, g.order, ids, host)) / 1e9
        h2d = total / best_of(lambda ids=ids: unpack_pages(planes, g.order, host, ids)) / 1e9
        print(f"{name:10s} ids ({runs(ids):5d} runs for {a.pages} pages): D2H {d2h:5.1f} GB/s "
              f"= {d2h / mem:4.0%} of memcpy, H2D {h2d:5.1f} GB/s = {h2d / mem:4.0%}")
    # a restore of one host extent: one call for the run (engine/host.py restore_pages) vs
    # one call per page (what restore_pages did before 2026-12-03)
    n = min(64, a.pages)
    ids = list(range(n))
    one = best_of(lambda: unpack_pages(planes, g.order, host[:n], ids))
    per_page = best_of(lambda: [unpack_pages(planes, g.order, host[i:i + 1], [i])
                                for i in range(n)])
    print(f"restore of {n} pages from one extent: one call {one * 1e3:6.2f} ms, one call per "
          f"page {per_page * 1e3:6.2f} ms ({per_page / one:.1f}x)")


if __name__ == "__main__":
    main()
