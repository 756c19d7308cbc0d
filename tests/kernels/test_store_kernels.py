"""Append then attention through a store-built view equals attention over the same K/V kept
contiguously in a plain tensor (spec §12: consumers use paged views only)."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.layout import Profile
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode


@pytest.mark.parametrize("profile", [Profile.BF16, Profile.INT8_G64])
def test_store_view_append_then_decode_equals_contiguous(profile: Profile) -> None:
    store = KVStore.open(StoreConfig(
        model=ModelGeometry(layers=2, kv_heads=2, head_dim=64, profile=profile),
        serving=ServingConfig(max_context=1024, max_concurrency=4), kv_tokens=4096))
    seqs = [store.activate(100, 200) for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    keys: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    vals: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    frontier = dict.fromkeys(seqs, 0)
    for step, n in enumerate((100, 1, 1, 30, 1)):  # prefill, then decode and a chunk
        for s in seqs:
            store.ensure_mapped(s, "main", frontier[s] + n + step)
        with store.boundary():  # the GPU unit: append through the published tables
            for s in seqs:
                m = n + step
                k = torch.randn(m, 2, 64, generator=gen)
                v = torch.randn(m, 2, 64, generator=gen)
                # contiguous copy of what the cache holds: quantize via the same codec
                view = store.batch_view("main", 1)
                append_kv(view, store.table_rows("main", [s] * m),
                          torch.arange(frontier[s], frontier[s] + m), k, v)
                keys[s].append(k)
                vals[s].append(v)
        for s in seqs:
            frontier[s] += n + step
            store.commit(s, "main", frontier[s])
    store.check_invariants()
    view = store.batch_view("main", 1)
    q = torch.randn(3, 4, 64, generator=gen)
    out = paged_decode(q, view, store.table_rows("main", seqs),
                       torch.tensor([frontier[s] for s in seqs]))
    for i, s in enumerate(seqs):
        k = torch.cat(keys[s])
        v = torch.cat(vals[s])
        if profile is Profile.BF16:  # the cache holds bf16; compare on the same values
            k, v = k.bfloat16().float(), v.bfloat16().float()
        kk = k.repeat_interleave(2, 1).permute(1, 0, 2)
        vv = v.repeat_interleave(2, 1).permute(1, 0, 2)
        ref = torch.softmax(kk @ q[i].unsqueeze(-1) / math.sqrt(64), 1)
        want = (ref * vv).sum(1)
        tol = 1e-4 if profile is Profile.BF16 else 3e-2
        assert (out[i] - want).abs().max().item() < tol
