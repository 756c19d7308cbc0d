"""Ragged prefill on the CPU: the query-tiled kernel against the per-query path (each query
re-reads its whole context), on the same inputs in the same run. Prints ms and the ratio;
asserts nothing.

    python benchmarks/prefill_bench.py [--ctx 4096] [--chunk 512] [--seqs 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ninfer_kv.engine.layout import PoolKind, Profile, pool_geometry
from ninfer_kv.engine.views import PagedKVBatchLayerView
from ninfer_kv.kernels.prefill import paged_prefill_varlen


def make_view(profile: Profile, heads: int, head_dim: int, pages: int, rows: int,
              logical: int) -> PagedKVBatchLayerView:
    """One layer's planes and a table of permuted page ids (random codes filled in later)."""
    g = pool_geometry(PoolKind.MAIN, profile, 1, heads, head_dim, pages)
    planes = {k: torch.zeros(g.shape(p), dtype=p.dtype) for k, p in g.layer_planes(0).items()}
    perm = np.random.default_rng(0).permutation(pages)[: rows * logical]
    tables = torch.from_numpy(perm.reshape(rows, logical).astype(np.int32))
    return PagedKVBatchLayerView(planes["k_code"], planes["v_code"], planes.get("k_scale"),
                                 planes.get("v_scale"), tables, head_dim, heads, profile,
                                 g.order)


def best(fn, reps: int = 3) -> float:  # type: ignore[no-untyped-def]
    fn()  # compile / warm
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    a = ap.parse_args()
    logical = -(-a.ctx // 64)
    for profile in (Profile.BF16, Profile.FP8_ROW256):
        view = make_view(profile, a.heads, a.dim, pages=a.seqs * logical, rows=a.seqs,
                         logical=logical)
        view.k_pages.copy_(torch.randint(0, 100, view.k_pages.shape).to(view.k_pages.dtype))
        view.v_pages.copy_(torch.randint(0, 100, view.v_pages.shape).to(view.v_pages.dtype))
        for t in (view.k_scale_pages, view.v_scale_pages):
            if t is not None:
                t.copy_(torch.randint(1, 60, t.shape).to(t.dtype))
        # a ragged batch: one prefill chunk per sequence except the last, a decode row
        n = [a.chunk] * (a.seqs - 1) + [1]
        cu = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
        ctx = torch.full((a.seqs,), a.ctx, dtype=torch.int32)
        q = torch.randn(sum(n), a.heads * 4, a.dim)
        rows = torch.arange(a.seqs, dtype=torch.int32)
        t_q = best(lambda: paged_prefill_varlen(q, view, rows, cu, ctx, tiled=False))  # noqa: B023
        t_t = best(lambda: paged_prefill_varlen(q, view, rows, cu, ctx))  # noqa: B023
        print(f"{profile.value:>18}: {sum(n)} queries over ctx {a.ctx} (H={a.heads}, GQA 4, "
              f"D={a.dim}): per-query {t_q * 1e3:8.1f} ms, tiled {t_t * 1e3:8.1f} ms, "
              f"speedup {t_q / t_t:5.2f}x")


if __name__ == "__main__":
    main()
