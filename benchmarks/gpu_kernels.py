"""GPU check, ready for a lent GPU: correctness of every CUDA kernel against the CPU kernels,
then decode-attention bandwidth (B=64, context 8192, BF16 / FP8 / NVFP4) as a fraction of
4.8 TB/s, and page-copy bandwidth. Finishes in a few minutes; prints, asserts nothing.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

if not hasattr(np, "row_stack"):  # numba-cuda 0.2x on numpy >= 2.5 (the lent GPU machine)
    np.row_stack = np.vstack

from ninfer_kv.engine.layout import PlaneOrder, PoolKind, Profile, bytes_per_token_head, pool_geometry
from ninfer_kv.engine.views import PagedKVBatchLayerView
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode, paged_prefill
from ninfer_kv.kernels.copy import copy_pages, copy_tail, host_page_bytes, pack_pages, unpack_pages

PEAK = 4.8e12


def make_view(profile: Profile, heads: int, d: int, pages: int, rows: int, logical: int,
              device: str, order: PlaneOrder = PlaneOrder.PAGE_MAJOR,
              seed: int = 0) -> PagedKVBatchLayerView:
    kind = PoolKind.DRAFT_FULL if order is PlaneOrder.HEAD_MAJOR else PoolKind.MAIN
    g = pool_geometry(kind, profile, 1, heads, d, pages)
    planes = {k: torch.zeros(g.shape(p), dtype=p.dtype, device=device)
              for k, p in g.layer_planes(0).items()}
    perm = np.random.default_rng(seed).permutation(pages)[: rows * logical]
    tables = torch.from_numpy(perm.reshape(rows, logical).astype(np.int32)).to(device)
    return PagedKVBatchLayerView(planes["k_code"], planes["v_code"], planes.get("k_scale"),
                                 planes.get("v_scale"), tables, d, heads, profile, g.order)


def planes_of(v: PagedKVBatchLayerView) -> list[torch.Tensor]:
    return [t for t in (v.k_pages, v.v_pages, v.k_scale_pages, v.v_scale_pages) if t is not None]


def section(name: str, fn: Callable[[], None]) -> bool:
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        fn()
        print(f"   ok ({time.perf_counter() - t0:.1f} s)", flush=True)
        return True
    except Exception:  # noqa: BLE001 - report and go on to the next section
        traceback.print_exc()
        print(f"   FAILED ({time.perf_counter() - t0:.1f} s)", flush=True)
        return False


def correctness() -> None:
    gen = torch.Generator().manual_seed(0)
    for profile in Profile:
        for d, gqa in ((64, 1), (128, 4), (256, 8)):
            heads, n = 2, 300
            cpu = make_view(profile, heads, d, 16, 2, 8, "cpu")
            gpu = make_view(profile, heads, d, 16, 2, 8, "cuda")
            k = torch.randn(n, heads, d, generator=gen)
            v = torch.randn(n, heads, d, generator=gen)
            rows = torch.ones(n, dtype=torch.int32)
            pos = torch.arange(n)
            append_kv(cpu, rows, pos, k, v)
            append_kv(gpu, rows.cuda(), pos.cuda(), k.cuda(), v.cuda())
            torch.cuda.synchronize()
            same = all(torch.equal(a, b.cpu()) for a, b in zip(planes_of(cpu), planes_of(gpu),
                                                                strict=True))
            q = torch.randn(1, heads * gqa, d, generator=gen)
            oc = paged_decode(q, cpu, torch.tensor([1]), torch.tensor([n - 7]))
            og = paged_decode(q.cuda(), gpu, torch.tensor([1]).cuda(),
                              torch.tensor([n - 7]).cuda())
            qp = torch.randn(1, 5, heads * gqa, d, generator=gen)
            pc = paged_prefill(qp, cpu, torch.tensor([1]), torch.tensor([n - 5]))
            pg = paged_prefill(qp.cuda(), gpu, torch.tensor([1]).cuda(),
                               torch.tensor([n - 5]).cuda())
            err = (oc - og.cpu()).abs().max().item()
            perr = (pc - pg.cpu()).abs().max().item()
            print(f"   {profile.value:18s} D={d:3d} GQA={gqa}: append bit-identical={same} "
                  f"decode max|gpu-cpu|={err:.2e} prefill={perr:.2e}", flush=True)
            assert same and err < 1e-4 and perr < 1e-4
    # head-major Draft Full
    cpu = make_view(Profile.BF16, 2, 128, 8, 1, 8, "cpu", PlaneOrder.HEAD_MAJOR)
    gpu = make_view(Profile.BF16, 2, 128, 8, 1, 8, "cuda", PlaneOrder.HEAD_MAJOR)
    k, v = torch.randn(200, 2, 128), torch.randn(200, 2, 128)
    z, p = torch.zeros(200, dtype=torch.int32), torch.arange(200)
    append_kv(cpu, z, p, k, v)
    append_kv(gpu, z.cuda(), p.cuda(), k.cuda(), v.cuda())
    q = torch.randn(1, 4, 128)
    e = (paged_decode(q, cpu, torch.tensor([0]), torch.tensor([200]))
         - paged_decode(q.cuda(), gpu, torch.tensor([0]).cuda(),
                        torch.tensor([200]).cuda()).cpu()).abs().max().item()
    print(f"   head-major bf16: bit-identical={torch.equal(cpu.k_pages, gpu.k_pages.cpu())} "
          f"decode err {e:.2e}")
    assert e < 1e-4
    # copies
    for order, prof in ((PlaneOrder.PAGE_MAJOR, Profile.K8V4), (PlaneOrder.HEAD_MAJOR,
                                                                Profile.BF16)):
        cpu = make_view(prof, 2, 128, 12, 1, 4, "cpu", order)
        for t in planes_of(cpu):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8))
        gpu = make_view(prof, 2, 128, 12, 1, 4, "cuda", order)
        for a, b in zip(planes_of(cpu), planes_of(gpu), strict=True):
            b.copy_(a)
        for view, dev in ((cpu, "cpu"), (gpu, "cuda")):
            pl = planes_of(view)
            copy_pages(pl, order, [0, 5, 7], [11, 2, 3])
            copy_tail(pl, order, 4, 9, 37)
            host = torch.zeros(4, host_page_bytes(pl, order), dtype=torch.uint8,
                               pin_memory=dev == "cuda")
            pack_pages(pl, order, [1, 11, 9, 2], host)
            torch.cuda.synchronize()
            unpack_pages(pl, order, host, [6, 8, 10, 0])
            torch.cuda.synchronize()
        same = all(torch.equal(a, b.cpu()) for a, b in zip(planes_of(cpu), planes_of(gpu),
                                                            strict=True))
        print(f"   copies {order.value}: gpu == cpu: {same}")
        assert same


def cuda_time(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters / 1e3


def gather_sdpa(view: PagedKVBatchLayerView, q: torch.Tensor, ctx: int, gqa: int) -> torch.Tensor:
    b, hq, d = q.shape
    heads = hq // gqa
    idx = view.block_tables[:b].long()
    kc = view.k_pages.view(torch.bfloat16)[idx].permute(0, 2, 1, 3, 4).reshape(b, heads, ctx, d)
    vc = view.v_pages.view(torch.bfloat16)[idx].permute(0, 2, 1, 3, 4).reshape(b, heads, ctx, d)
    return torch.nn.functional.scaled_dot_product_attention(q.view(b, hq, 1, d), kc, vc,
                                                            enable_gqa=True)


def decode_bandwidth(quick: bool) -> None:
    b, ctx, heads, d, gqa = 64, 8192, 8, 128, 4
    if quick:
        b = 16
    logical = ctx // 64
    for profile in (Profile.BF16, Profile.FP8_ROW256, Profile.NVFP4_G16):
        view = make_view(profile, heads, d, b * logical, b, logical, "cuda", seed=1)
        for t in planes_of(view):  # random codes; keep floats finite
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8, device="cuda"))
        q = torch.randn(b, heads * gqa, d, device="cuda", dtype=torch.bfloat16)
        rows = torch.arange(b, dtype=torch.int32, device="cuda")
        lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        sec = cuda_time(functools.partial(paged_decode, q, view, rows, lens), 10)
        kb, vb = bytes_per_token_head(profile, d)
        nbytes = b * ctx * heads * (kb + vb)
        line = (f"   {profile.value:18s} B={b} ctx={ctx} H={heads} D={d} GQA={gqa}: "
                f"{sec * 1e3:7.3f} ms  {nbytes / sec / 1e9:7.1f} GB/s = "
                f"{nbytes / sec / PEAK:5.1%} of 4.8 TB/s")
        if profile is Profile.BF16:  # baseline: gather pages to contiguous, then SDPA
            tsec = cuda_time(functools.partial(gather_sdpa, view, q, ctx, gqa), 5)
            line += f"  | torch gather+SDPA {tsec * 1e3:.3f} ms (ratio {tsec / sec:.2f}x)"
        print(line, flush=True)
        del view
        torch.cuda.empty_cache()


def copy_bandwidth() -> None:
    view = make_view(Profile.BF16, 8, 128, 16384, 1, 1, "cuda")
    pl = planes_of(view)
    n = 4096
    perm = torch.randperm(16384)
    src, dst = perm[:n].tolist(), perm[n:2 * n].tolist()
    sec = cuda_time(lambda: copy_pages(pl, view.order, src, dst), 10)
    nbytes = 2 * n * host_page_bytes(pl, view.order)  # read + write
    ref = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    ref2 = torch.empty_like(ref)
    rsec = cuda_time(lambda: ref2.copy_(ref), 10)
    print(f"   copy_pages {n} random page groups x {host_page_bytes(pl, view.order)} B: "
          f"{sec * 1e3:.3f} ms, {nbytes / sec / 1e9:.1f} GB/s (read+write) = "
          f"{nbytes / sec / PEAK:.1%} of 4.8 TB/s; torch contiguous copy_ of the same bytes "
          f"{nbytes / rsec / 1e9:.1f} GB/s", flush=True)
    m = 512
    host = torch.empty(m, host_page_bytes(pl, view.order), dtype=torch.uint8, pin_memory=True)
    hsec = cuda_time(lambda: pack_pages(pl, view.order, src[:m], host), 3)
    print(f"   pack_pages (D2H via staging) {host.numel() / hsec / 1e9:.1f} GB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run tests for the simulator twins)")
        sys.exit(0)
    import numba
    from numba import cuda

    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | numba "
          f"{numba.__version__} | cuda available to numba: {cuda.is_available()}", flush=True)
    t0 = time.perf_counter()
    results = [section("correctness: CUDA kernels vs CPU kernels", correctness),
               section("decode attention bandwidth", lambda: decode_bandwidth(a.quick)),
               section("page copy bandwidth", copy_bandwidth)]
    print(f"sections ok: {sum(results)}/{len(results)} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
