"""End-to-end store check on a device: the same script of commands on a ``cuda`` store and a
``cpu`` store — activate, map, append through published tables, decode, retain, offload,
drop device replicas, continue (H2D restore + COW), decode again — must give the same
attention outputs and the same state digest. Prints; asserts nothing.

    python benchmarks/gpu_store_check.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

if not hasattr(np, "row_stack"):  # numba-cuda 0.2x on numpy >= 2.5 (the lent GPU machine)
    np.row_stack = np.vstack

from ninfer_kv.engine.capacity import Backend, ModelGeometry, ServingConfig  # noqa: E402
from ninfer_kv.engine.layout import Profile  # noqa: E402
from ninfer_kv.engine.store import KVStore, StoreConfig  # noqa: E402
from ninfer_kv.kernels.append import append_kv  # noqa: E402
from ninfer_kv.kernels.attention import paged_decode  # noqa: E402


def script(device: str, profile: Profile) -> tuple[list[torch.Tensor], str]:
    store = KVStore.open(StoreConfig(
        model=ModelGeometry(layers=2, kv_heads=2, head_dim=128, profile=profile),
        serving=ServingConfig(max_context=4096, max_concurrency=4, backend=Backend.MTP),
        kv_tokens=4096 * 2, device=device, host_bytes=64 << 20))
    gen = torch.Generator().manual_seed(0)
    outs = []

    def append(seq: int, start: int, end: int) -> None:
        n = end - start
        rows = store.table_rows("main", [seq] * n)
        for layer in range(2):
            k = torch.randn(n, 2, 128, generator=gen).to(device)
            v = torch.randn(n, 2, 128, generator=gen).to(device)
            append_kv(store.batch_view("main", layer), rows,
                      torch.arange(start, end, device=device), k, v)

    def decode(seqs: list[int]) -> None:
        q = torch.randn(len(seqs), 8, 128, generator=gen).to(device)
        lens = torch.tensor([store.space(s).committed for s in seqs], device=device)
        for layer in range(2):
            outs.append(paged_decode(q, store.batch_view("main", layer),
                                     store.table_rows("main", seqs), lens).cpu())

    a = store.activate(1000, 200)
    for pool in store.pools:
        store.ensure_mapped(a, pool, 1000)
    with store.boundary():
        append(a, 0, 1000)
    for pool in store.pools:
        store.commit(a, pool, 1000)
    decode([a])
    ck = store.finish(a, retain=True)
    store.offload(ck)
    with store.boundary():
        pass
    store.drop_device(ck)
    with store.boundary():
        pass
    b = store.activate_from(ck, 1000, 1000, 100)  # H2D restore, then COW of the 40-col tail
    store.ensure_mapped(b, "main", 1010)
    with store.boundary():
        append(b, 1000, 1010)
    store.commit(b, "main", 1010)
    decode([b])
    store.check_invariants()
    return outs, store.digest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        sys.exit(0)
    for profile in (Profile.BF16, Profile.K8V4):
        dev_out, dev_digest = script(a.device, profile)
        cpu_out, cpu_digest = script("cpu", profile)
        err = max((x - y).abs().max().item() for x, y in zip(dev_out, cpu_out, strict=True))
        print(f"store on {a.device} vs cpu, {profile.value}: digests equal "
              f"{dev_digest == cpu_digest}, decode outputs max |diff| {err:.2e} "
              f"(after offload -> drop device -> restore -> COW)", flush=True)


if __name__ == "__main__":
    main()
