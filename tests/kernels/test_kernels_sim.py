"""The CUDA kernels themselves, run by numba's CUDA simulator on small shapes (CI has no GPU):
append must be bit-identical to the CPU kernel, attention must agree with it, copies exact."""

from __future__ import annotations

import numba
import pytest
import torch

from ninfer_kv.engine.layout import PlaneOrder, Profile
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode
from ninfer_kv.kernels.copy import (
    copy_pages,
    copy_tail,
    copy_tails,
    host_page_bytes,
    pack_pages,
    unpack_pages,
)
from tests.kernels.helpers import make_view

pytestmark = pytest.mark.skipif(not numba.config.ENABLE_CUDASIM,
                                reason="simulator tests run with NUMBA_ENABLE_CUDASIM=1 (CI)")


def _append_both(profile: Profile, order: PlaneOrder, n: int = 70):
    cpu = make_view(profile, 1, 64, pages=4, rows=2, logical=2, order=order)
    sim = make_view(profile, 1, 64, pages=4, rows=2, logical=2, order=order)
    gen = torch.Generator().manual_seed(11)
    k, v = torch.randn(n, 1, 64, generator=gen), torch.randn(n, 1, 64, generator=gen)
    rows, pos = torch.ones(n, dtype=torch.int32), torch.arange(n)
    append_kv(cpu, rows, pos, k, v)
    append_kv(sim, rows, pos, k, v, force_cuda_sim=True)
    return cpu, sim


@pytest.mark.parametrize("profile", list(Profile))
def test_sim_append_bit_identical_and_decode_agrees(profile: Profile) -> None:
    cpu, sim = _append_both(profile, PlaneOrder.PAGE_MAJOR)
    for a, b in ((cpu.k_pages, sim.k_pages), (cpu.v_pages, sim.v_pages),
                 (cpu.k_scale_pages, sim.k_scale_pages), (cpu.v_scale_pages, sim.v_scale_pages)):
        if a is not None:
            assert torch.equal(a, b)
    q = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(2))
    want = paged_decode(q, cpu, torch.tensor([1]), torch.tensor([70]))
    got = paged_decode(q, sim, torch.tensor([1]), torch.tensor([70]), n_split=2,
                       force_cuda_sim=True)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("profile", list(Profile))
@pytest.mark.parametrize("gqa,n", [(1, 64), (4, 37)])  # frontier on / inside a page
def test_sim_decode_vs_float64_reference(profile: Profile, gqa: int, n: int) -> None:
    """The CUDA decode kernel itself against the float64 reference (small shapes)."""
    from tests.kernels import reference as ref
    from tests.kernels.helpers import read_kv

    view = make_view(profile, 1, 64, pages=6, rows=2, logical=2, seed=gqa)
    gen = torch.Generator().manual_seed(n)
    k, v = torch.randn(n, 1, 64, generator=gen), torch.randn(n, 1, 64, generator=gen)
    append_kv(view, torch.ones(n, dtype=torch.int32), torch.arange(n), k, v,
              force_cuda_sim=True)
    q = torch.randn(1, gqa, 64, generator=gen)
    out = paged_decode(q, view, torch.tensor([1]), torch.tensor([n]), force_cuda_sim=True)
    kq, vq = read_kv(view, 1, n)
    want = ref.attention_ref(q[0], kq, vq)
    assert (out[0].double() - want).abs().max().item() <= 2e-5 * vq.abs().max().item()


def test_sim_head_major_draft_pool() -> None:
    cpu, sim = _append_both(Profile.BF16, PlaneOrder.HEAD_MAJOR, n=40)
    assert torch.equal(cpu.k_pages, sim.k_pages)
    q = torch.randn(1, 1, 64)
    want = paged_decode(q, cpu, torch.tensor([1]), torch.tensor([40]))
    got = paged_decode(q, sim, torch.tensor([1]), torch.tensor([40]), force_cuda_sim=True)
    assert (got - want).abs().max().item() < 1e-5


def random_planes(order: PlaneOrder, pages: int, seed: int) -> list[torch.Tensor]:
    """Every plane of a pool (BF16 head-major, or K8V4 page-major: scale planes of other
    shapes too), filled with random bytes."""
    profile = Profile.BF16 if order is PlaneOrder.HEAD_MAJOR else Profile.K8V4
    view = make_view(profile, 2, 64, pages=pages, rows=1, logical=2, order=order)
    planes = [t for t in (view.k_pages, view.v_pages, view.k_scale_pages, view.v_scale_pages)
              if t is not None]
    gen = torch.Generator().manual_seed(seed)
    for t in planes:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                dtype=torch.uint8))
    return planes


def page_of(order: PlaneOrder, t: torch.Tensor, g: int) -> torch.Tensor:
    return t[g] if order is PlaneOrder.PAGE_MAJOR else t[:, g]


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "cuda-sim"])
@pytest.mark.parametrize("order", [PlaneOrder.PAGE_MAJOR, PlaneOrder.HEAD_MAJOR])
def test_copies_exact(sim: bool, order: PlaneOrder) -> None:
    planes = random_planes(order, 6, 4)
    before = [t.clone() for t in planes]

    def page(t: torch.Tensor, g: int) -> torch.Tensor:
        return page_of(order, t, g)

    copy_pages(planes, order, [0, 3], [5, 1], force_cuda_sim=sim)
    for t, b in zip(planes, before, strict=True):
        assert torch.equal(page(t, 5), page(b, 0)) and torch.equal(page(t, 1), page(b, 3))
        assert torch.equal(page(t, 2), page(b, 2))
    copy_tail(planes, order, 2, 4, 40, force_cuda_sim=sim)
    for t, b in zip(planes, before, strict=True):
        assert torch.equal(page(t, 4)[:, :40], page(b, 2)[:, :40])
        assert torch.equal(page(t, 4)[:, 40:], page(b, 4)[:, 40:])  # nothing past n columns
    host = torch.zeros(3, host_page_bytes(planes, order), dtype=torch.uint8)
    pack_pages(planes, order, [2, 0, 5], host, force_cuda_sim=sim)
    snapshot = [t.clone() for t in planes]
    for t in planes:
        t.zero_()
    unpack_pages(planes, order, host, [2, 0, 5], force_cuda_sim=sim)
    for t, s in zip(planes, snapshot, strict=True):
        for g in (2, 0, 5):
            assert torch.equal(page(t, g), page(s, g))
        assert not page(t, 1).any()


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "cuda-sim"])
@pytest.mark.parametrize("order", [PlaneOrder.PAGE_MAJOR, PlaneOrder.HEAD_MAJOR])
def test_batched_tail_copies_exact(sim: bool, order: PlaneOrder) -> None:
    """``copy_tails``: each pair gets its own column count, in every plane (scale planes
    too), and nothing past it; the pages no pair writes keep their bytes."""
    planes = random_planes(order, 8, 7)
    before = [t.clone() for t in planes]

    def page(t: torch.Tensor, g: int) -> torch.Tensor:
        return page_of(order, t, g)

    pairs = [(0, 5, 17), (1, 6, 63), (2, 7, 1), (3, 4, 0)]  # (src, dst, columns)
    copy_tails(planes, order, *map(list, zip(*pairs, strict=True)), force_cuda_sim=sim)
    for t, b in zip(planes, before, strict=True):
        for src, dst, n in pairs:
            assert torch.equal(page(t, dst)[:, :n], page(b, src)[:, :n])
            assert torch.equal(page(t, dst)[:, n:], page(b, dst)[:, n:])
        for g in range(4):
            assert torch.equal(page(t, g), page(b, g))


@pytest.mark.parametrize("profile", [p for p in Profile if p is not Profile.INT8_G64])
def test_sim_head_dim_32_equals_the_cpu_kernels(profile: Profile) -> None:  # (int8-g64's
    # 64-element groups need D >= 64: a geometry the store refuses, ConfigError)
    """Review finding: at D=32 a lane holds one element, and the NVFP4 lane loader read a
    pair (out[1] past its one-element array; odd lanes took their neighbour's nibble), so
    CUDA decode and prefill of nvfp4-g16 and k8v4 were wrong."""
    from ninfer_kv.kernels.prefill import paged_prefill_varlen

    view = make_view(profile, 1, 32, pages=4, rows=2, logical=2)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, 1, 32, generator=gen)
    append_kv(view, torch.ones(70, dtype=torch.int32), torch.arange(70), x, x)
    q = torch.randn(1, 2, 32, generator=gen)
    r, c = torch.tensor([1]), torch.tensor([70])
    want = paged_decode(q, view, r, c)
    assert (paged_decode(q, view, r, c, force_cuda_sim=True) - want).abs().max() < 1e-5
    got = paged_prefill_varlen(q, view, r, torch.tensor([0, 1]), c, force_cuda_sim=True)
    assert (got - want).abs().max() < 1e-5


def test_sim_kernels_skip_what_no_host_check_saw(monkeypatch: pytest.MonkeyPatch) -> None:
    """For CUDA tensors the wrappers check nothing on the host; the kernels must skip an
    unmapped entry, a row outside the table and a position past int32 — review finding: the
    CUDA decode and prefill kernels read entry -1 as the pool's last page (another request's
    KV), append and decode took row -1 as the last row, and position 2**32 wrapped to 0 (a
    committed token overwritten). The simulator runs them with the host checks off."""
    import dataclasses

    import ninfer_kv.kernels.append as app
    import ninfer_kv.kernels.attention as att
    import ninfer_kv.kernels.prefill as pre

    view = make_view(Profile.BF16, 1, 32, pages=4, rows=2, logical=2)
    view = dataclasses.replace(view, block_tables=torch.tensor([[0, -1], [1, 3]],
                                                               dtype=torch.int32))
    one = torch.ones(64, 1, 32)
    append_kv(view, torch.zeros(64, dtype=torch.int32), torch.arange(64), one, one)  # row 0
    append_kv(view, torch.ones(64, dtype=torch.int32), torch.arange(64, 128), one, 1000 * one)
    for mod, name in ((app, "check_mapped"), (att, "check_read_domain"),
                      (pre, "check_read_domain")):
        monkeypatch.setattr(mod, name, lambda *a: None)  # as for CUDA tensors
    before = view.v_pages.clone()
    for rows, pos in (([0], [64]), ([-1], [64]), ([0], [2**32])):
        app.append_kv(view, torch.tensor(rows), torch.tensor(pos), one[:1], -5 * one[:1],
                      force_cuda_sim=True)
        assert torch.equal(view.v_pages, before), (rows, pos)
    q = torch.zeros(1, 1, 32)
    out = att.paged_decode(q, view, torch.tensor([0]), torch.tensor([65]), force_cuda_sim=True)
    assert torch.allclose(out, torch.ones_like(out))  # block 1 skipped, not page 3's 1000s
    out = pre.paged_prefill_varlen(q, view, torch.tensor([0]), torch.tensor([0, 1]),
                                   torch.tensor([65]), force_cuda_sim=True)
    assert torch.allclose(out, torch.ones_like(out))
    out = att.paged_decode(q, view, torch.tensor([-1]), torch.tensor([65]), force_cuda_sim=True)
    assert torch.equal(out, torch.zeros_like(out))  # no row: attends to nothing
