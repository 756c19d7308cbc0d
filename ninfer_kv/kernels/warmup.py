"""Compile the CPU kernels at start-up instead of on the first request.

``warmup(profiles)`` runs ``append_kv``, ``paged_decode``, ``paged_prefill``,
``paged_prefill_varlen`` and a page copy once on a one-page store of each profile, and once
on head-major planes (a DFlash draft pool's), each kernel's parallel loop and its serial twin
(``jit.SERIAL_BELOW``): the first
process on a machine compiles them (6-9 s per profile) and caches the machine code
(kernels/jit.py); every later process loads it in a fraction of a second. An engine calls it
before serving so no request waits for the JIT.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.config import StoreConfig
from ninfer_kv.engine.layout import PlaneOrder, Profile
from ninfer_kv.engine.store import KVStore
from ninfer_kv.engine.views import PagedKVBatchLayerView
from ninfer_kv.kernels import jit
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode, paged_prefill
from ninfer_kv.kernels.copy import copy_tail
from ninfer_kv.kernels.prefill import paged_prefill_varlen


def warm_profile(profile: Profile | str) -> None:
    """Every CPU kernel once, on the planes of ``profile``."""
    prof = Profile.parse(profile)
    store = KVStore.open(StoreConfig(
        model=ModelGeometry(layers=1, kv_heads=1, head_dim=64, profile=prof),
        serving=ServingConfig(max_context=128, max_concurrency=1), kv_tokens=2 * 64))
    try:
        a = store.activate(2, 1)
        store.ensure_mapped(a, "main", 2)
        with store.boundary():
            view = store.batch_view("main", 0)
            rows = store.table_rows("main", [a])
            kv = torch.zeros(2, 1, 64)
            append_kv(view, rows.repeat(2), torch.arange(2, dtype=torch.int32), kv, kv)
            paged_decode(torch.zeros(1, 1, 64), view, rows, torch.tensor([2], dtype=torch.int32))
            paged_prefill(torch.zeros(1, 2, 1, 64), view, rows,
                          torch.tensor([0], dtype=torch.int32))
            paged_prefill_varlen(torch.zeros(2, 1, 64), view, rows,
                                 torch.tensor([0, 2], dtype=torch.int32),
                                 torch.tensor([2], dtype=torch.int32))
        page = store.state.pools["main"].pages[store.space(a).members[0]]
        assert page is not None
        free = store.state.pools["main"].free_pages.first()
        store.device.copy_tails("main", [page.device], [free], [2])  # a free page: no owner
    finally:
        store.close()


def warm_head_major() -> None:
    """The head-major variants (a DFlash draft pool's BF16 planes, §4.3): the kernels get
    them as [N, H, P, X] views that are not contiguous, which numba compiles apart (two
    heads: with one the view would pass for contiguous)."""
    planes = [torch.zeros(2, 2, 64, 64, dtype=torch.uint16) for _ in range(2)]
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    view = PagedKVBatchLayerView(planes[0], planes[1], None, None, tables, 64, 2, Profile.BF16,
                                 PlaneOrder.HEAD_MAJOR)
    rows, kv = torch.zeros(2, dtype=torch.int32), torch.zeros(2, 2, 64)
    append_kv(view, rows, torch.arange(2, dtype=torch.int32), kv, kv)
    paged_decode(torch.zeros(1, 2, 64), view, rows[:1], torch.tensor([2], dtype=torch.int32))
    paged_prefill_varlen(torch.zeros(2, 2, 64), view, rows[:1],
                         torch.tensor([0, 2], dtype=torch.int32),
                         torch.tensor([2], dtype=torch.int32))
    copy_tail(planes, PlaneOrder.HEAD_MAJOR, 0, 1, 2)


def warmup(profiles: Iterable[Profile | str] = (Profile.BF16,)) -> dict[str, float]:
    """Warm every kernel for each profile; returns the seconds each profile took (a compile
    the first time on this machine, a cache load after)."""
    out: dict[str, float] = {}
    for p in profiles:
        t0 = time.perf_counter()
        for parallel in (True, False):  # both twins: small work runs serially (jit.py)
            with jit.forcing(parallel):
                warm_profile(p)
        out[Profile.parse(p).value] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for parallel in (True, False):
        with jit.forcing(parallel):
            warm_head_major()
    out["head-major"] = time.perf_counter() - t0
    return out
