"""The transfer's packed pages are the host tier's layout (§5.3) for every profile and both
plane orders, and unpacking them restores the page groups byte for byte."""

from __future__ import annotations

import pytest
import torch

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig
from ninfer_kv.dist.packing import copy_pages, zero_tail
from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.layout import Profile
from ninfer_kv.kernels.copy import pack_pages


@pytest.mark.parametrize("profile", list(Profile))
def test_packed_pages_match_the_host_layout(profile: Profile) -> None:
    store = KVStore.open(StoreConfig(
        model=ModelGeometry(layers=2, kv_heads=2, head_dim=64, profile=profile,
                            draft_layers=1, draft_kv_heads=2, draft_head_dim=64),
        serving=ServingConfig(max_context=256, max_concurrency=2, backend=Backend.DFLASH),
        kv_tokens=8 * 64))
    assert "draft_full" in store.pools  # head-major planes are covered too
    for pool in store.pools:
        planes = store.device.planes(pool)
        order = store.device.pools[pool].geometry.order
        for t in planes:
            t.view(torch.uint8).random_(0, 256)
        pb = next(s.page_bytes for s in store.state.pool_specs if s.name == pool)
        for ids in ([1, 2, 3], [5, 0, 3, 7, 2, 6]):  # one run; scattered (gather path)
            want = torch.empty(len(ids), pb, dtype=torch.uint8)
            got = torch.empty_like(want)
            pack_pages(planes, order, ids, want)
            copy_pages(planes, order, ids, got, into_planes=False)
            assert torch.equal(got, want), (profile, pool, ids)
            before = [t.clone() for t in planes]
            for t in planes:
                t.zero_()
            copy_pages(planes, order, ids, got, into_planes=True)
            again = torch.empty_like(got)
            pack_pages(planes, order, ids, again)
            assert torch.equal(again, want)
            assert any(not torch.equal(a, b) for a, b in zip(planes, before, strict=True))
            for t, b in zip(planes, before, strict=True):
                t.copy_(b)
        page = want[0].clone()
        zero_tail(page, planes, order, 10)
        assert not torch.equal(page, want[0]) and page.count_nonzero() > 0
    store.close()
