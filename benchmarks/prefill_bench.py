"""Ragged prefill on the CPU: the query-tiled kernel against the per-query path (each query
re-reads its whole context) and against torch (gather the pages to contiguous K/V, dequantize,
causal scaled_dot_product_attention per sequence), on the same inputs in the same run. Prints
ms and the ratios; asserts nothing.

    python benchmarks/prefill_bench.py [--ctx 4096] [--chunk 512] [--seqs 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ninfer_kv.engine.layout import PoolKind, Profile, pool_geometry
from ninfer_kv.engine.views import PagedKVBatchLayerView, typed_planes
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


def gather_sdpa(q: torch.Tensor, view: PagedKVBatchLayerView, rows: torch.Tensor,
                n: list[int], ctx: torch.Tensor) -> torch.Tensor:
    """The torch baseline: per sequence, gather and dequantize its pages, then causal SDPA."""
    typed = typed_planes(view)
    outs, start = [], 0
    for b, nb in enumerate(n):
        c = int(ctx[b])
        pages = view.block_tables[int(rows[b]), : -(-c // 64)].long()
        sides = []
        for code, scale in ((typed.k, typed.k_scale), (typed.v, typed.v_scale)):
            x = code[pages].float()                               # [pages, H, 64, D]
            if scale is not None:
                x = x * scale[pages].float()
            sides.append(x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :c])
        qb = q[start:start + nb].transpose(0, 1)                  # [Hq, n, D]
        seen = torch.arange(c) <= (c - nb + torch.arange(nb)).unsqueeze(1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qb, sides[0], sides[1], attn_mask=seen, enable_gqa=True).transpose(0, 1))
        start += nb
    return torch.cat(outs)


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
        typed = typed_planes(view)                 # realistic values, stored by dtype
        for t in (typed.k, typed.v):
            t.copy_(torch.randn(t.shape))
        for t in (typed.k_scale, typed.v_scale):
            if t is not None:
                t.copy_(torch.rand(t.shape) * 0.01 + 0.005)
        # a ragged batch: one prefill chunk per sequence except the last, a decode row
        n = [a.chunk] * (a.seqs - 1) + [1]
        cu = torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
        ctx = torch.full((a.seqs,), a.ctx, dtype=torch.int32)
        q = torch.randn(sum(n), a.heads * 4, a.dim)
        rows = torch.arange(a.seqs, dtype=torch.int32)
        t_q = best(lambda: paged_prefill_varlen(q, view, rows, cu, ctx, tiled=False))  # noqa: B023
        t_t = best(lambda: paged_prefill_varlen(q, view, rows, cu, ctx))  # noqa: B023
        t_s = best(lambda: gather_sdpa(q, view, rows, n, ctx))  # noqa: B023
        err = (paged_prefill_varlen(q, view, rows, cu, ctx) -
               gather_sdpa(q, view, rows, n, ctx)).abs().max()
        print(f"{profile.value:>18}: {sum(n)} queries over ctx {a.ctx} (H={a.heads}, GQA 4, "
              f"D={a.dim}): per-query {t_q * 1e3:8.1f} ms, tiled {t_t * 1e3:8.1f} ms "
              f"(speedup {t_q / t_t:5.2f}x), torch gather+SDPA {t_s * 1e3:8.1f} ms "
              f"(torch/tiled {t_s / t_t:4.2f}), max diff {err:.1e}")


if __name__ == "__main__":
    main()
