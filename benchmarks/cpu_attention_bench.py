"""CPU paged decode vs torch (gather pages to contiguous, then scaled_dot_product_attention),
on the same data: BF16 and FP8, batch 16, context 4096, 8 KV heads, head dim 128, GQA 4.
Prints both times, the ratio, and achieved GB/s next to this machine's memcpy bandwidth
measured in the same run. Asserts nothing.

    python benchmarks/cpu_attention_bench.py [--batch 16] [--context 4096]
"""

from __future__ import annotations

import argparse

import torch
from timing import best_of, memcpy_gbps

from ninfer_kv.engine.layout import PoolKind, Profile, bytes_per_token_head, pool_geometry
from ninfer_kv.engine.views import PagedKVBatchLayerView
from ninfer_kv.kernels.attention import paged_decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args()
    b, ctx, heads, d, gqa = a.batch, a.context, 8, 128, 4
    logical = ctx // 64
    bw = memcpy_gbps()
    print(f"memcpy (numpy copyto, 256 MiB): {bw:.1f} GB/s copied; threads={torch.get_num_threads()}")
    for profile in (Profile.BF16, Profile.FP8_ROW256):
        g = pool_geometry(PoolKind.MAIN, profile, 1, heads, d, b * logical)
        planes = {}
        for k, p in g.layer_planes(0).items():
            if p.dtype == torch.uint16 and p.role == "code":  # bf16 codes of unit normals
                planes[k] = torch.randn(g.shape(p)).bfloat16().view(torch.uint16)
            elif p.role == "code":                             # e4m3 codes in [-8, 8]
                planes[k] = (torch.randn(g.shape(p)) * 2).to(torch.float8_e4m3fn).view(
                    torch.uint8)
            else:                                              # bf16 scale 0.01
                planes[k] = torch.full(g.shape(p), 0x3C24, dtype=torch.uint16)
        perm = torch.randperm(b * logical).view(b, logical).to(torch.int32)
        view = PagedKVBatchLayerView(planes["k_code"], planes["v_code"], planes.get("k_scale"),
                                     planes.get("v_scale"), perm, d, heads, profile, g.order)
        q = torch.randn(b, heads * gqa, d)
        rows = torch.arange(b, dtype=torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        t_paged = best_of(lambda v=view: paged_decode(q, v, rows, lens))
        kb, vb = bytes_per_token_head(profile, d)
        nbytes = b * ctx * heads * (kb + vb)

        # torch baseline on the same data: gather to contiguous (dequantize), then SDPA
        def torch_ref(v=view) -> torch.Tensor:  # noqa: ANN001
            idx = v.block_tables.long()
            if profile is Profile.BF16:
                kc = v.k_pages.view(torch.bfloat16)[idx].float()
                vc = v.v_pages.view(torch.bfloat16)[idx].float()
            else:
                kc = v.k_pages.view(torch.float8_e4m3fn)[idx].float() * \
                    v.k_scale_pages.view(torch.bfloat16)[idx].float()
                vc = v.v_pages.view(torch.float8_e4m3fn)[idx].float() * \
                    v.v_scale_pages.view(torch.bfloat16)[idx].float()
            kc = kc.permute(0, 2, 1, 3, 4).reshape(b, heads, ctx, d)
            vc = vc.permute(0, 2, 1, 3, 4).reshape(b, heads, ctx, d)
            return torch.nn.functional.scaled_dot_product_attention(
                q.view(b, heads * gqa, 1, d), kc, vc, enable_gqa=True)

        t_torch = best_of(torch_ref)
        err = (paged_decode(q, view, rows, lens) - torch_ref().view(b, heads * gqa, d)).abs().max()
        print(f"{profile.value:18s} paged {t_paged * 1e3:7.1f} ms | torch gather+SDPA "
              f"{t_torch * 1e3:7.1f} ms | ratio {t_torch / t_paged:4.2f}x | paged reads "
              f"{nbytes / t_paged / 1e9:5.2f} GB/s = {nbytes / t_paged / 1e9 / bw:4.0%} of "
              f"memcpy | max diff {err:.1e}")


if __name__ == "__main__":
    main()
