"""paged_prefill_varlen: a ragged batch (different query counts and contexts per sequence,
decode rows included) equals paged_prefill run per sequence, bit for bit; bad ragged
descriptions are typed refusals."""

from __future__ import annotations

import pytest
import torch

from ninfer_kv import paged_prefill, paged_prefill_varlen
from ninfer_kv.engine.layout import Profile
from ninfer_kv.errors import InvalidArgument
from tests.kernels.helpers import make_view

HKV, HQ, D = 2, 4, 64


def filled_view(profile: Profile = Profile.BF16):  # noqa: ANN201
    view = make_view(profile, HKV, D, pages=64, rows=4, logical=8, seed=3)
    gen = torch.Generator().manual_seed(0)
    for t in (view.k_pages, view.v_pages):  # any bytes are valid codes for this test
        t.copy_(torch.randint(0, 120, t.shape, generator=gen).to(t.dtype))
    for t in (view.k_scale_pages, view.v_scale_pages):
        if t is not None:
            t.copy_(torch.randint(1, 60, t.shape, generator=gen).to(t.dtype))
    return view


@pytest.mark.parametrize("profile", [Profile.BF16, Profile.K8V4])
def test_ragged_equals_per_sequence_prefill(profile: Profile) -> None:
    view = filled_view(profile)
    rows = torch.tensor([2, 0, 3], dtype=torch.int32)
    n = [3, 64, 1]            # a short chunk, a whole page of prompt, a decode row
    ctx = [70, 130, 5]
    q = torch.randn(sum(n), HQ, D, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 3, 67, 68], dtype=torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    per_query = paged_prefill_varlen(q, view, rows, cu, ctx_t, tiled=False)
    want = torch.cat([
        paged_prefill(q[int(cu[i]):int(cu[i + 1])].unsqueeze(0), view, rows[i:i + 1],
                      torch.tensor([ctx[i] - n[i]], dtype=torch.int32))[0]
        for i in range(3)])
    assert torch.equal(per_query, want)  # the same kernel, the same queries: bit for bit
    tiled = paged_prefill_varlen(q, view, rows, cu, ctx_t)  # each K/V row once per tile
    assert torch.allclose(tiled, want, rtol=1e-5, atol=1e-5), (tiled - want).abs().max()


def test_tiled_prefill_matches_a_float64_reference() -> None:
    """The tiled path against plain softmax attention over the dequantized K/V."""
    from tests.kernels.helpers import read_kv

    view = filled_view(Profile.BF16)
    rows = torch.tensor([1, 2], dtype=torch.int32)
    n, ctx = [20, 2], [90, 40]
    q = torch.randn(sum(n), HQ, D, generator=torch.Generator().manual_seed(2))
    out = paged_prefill_varlen(q, view, rows, torch.tensor([0, 20, 22], dtype=torch.int32),
                               torch.tensor(ctx, dtype=torch.int32))
    start = 0
    for b in range(2):
        k, v = (t.double().repeat_interleave(HQ // HKV, 1) for t in read_kv(view, int(rows[b]),
                                                                             ctx[b]))
        for i in range(n[b]):
            lim = ctx[b] - n[b] + i + 1
            w = torch.softmax(torch.einsum("hd,thd->ht", q[start + i].double(), k[:lim])
                              / D ** 0.5, -1)
            want = torch.einsum("ht,thd->hd", w, v[:lim])
            assert torch.allclose(out[start + i].double(), want, atol=2e-5), (b, i)
        start += n[b]


def test_ragged_refusals() -> None:
    view = filled_view()
    q = torch.randn(4, HQ, D)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    ctx = torch.tensor([10, 10], dtype=torch.int32)

    def call(cu: list[int], c: torch.Tensor = ctx, r: torch.Tensor = rows) -> None:
        paged_prefill_varlen(q, view, r, torch.tensor(cu, dtype=torch.int32), c)

    with pytest.raises(InvalidArgument, match="must rise from 0 to the 4 queries"):
        call([1, 2, 4])
    with pytest.raises(InvalidArgument, match="must rise from 0 to the 4 queries"):
        call([0, 3, 2])
    with pytest.raises(InvalidArgument, match="must rise from 0 to the 4 queries"):
        call([0, 1, 3])
    with pytest.raises(InvalidArgument, match="want \\[B\\], \\[B \\+ 1\\], \\[B\\]"):
        call([0, 4])
    with pytest.raises(InvalidArgument, match="sequence 1 has 3 queries but context_lens=2"):
        call([0, 1, 4], torch.tensor([10, 2], dtype=torch.int32))
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    for bad in (torch.randn(4, 3, D), torch.randn(4, HQ, 32)):  # Hq % H != 0; another D
        with pytest.raises(InvalidArgument, match="vs view heads=2 head_dim=64"):
            paged_prefill_varlen(bad, view, rows, cu, ctx)
    with pytest.raises(InvalidArgument, match="must be an integer tensor"):
        paged_prefill_varlen(q, view, rows, torch.tensor([0.0, 1.0, 4.0]), ctx)


@pytest.mark.parametrize(("profile", "hq", "n", "ctx"), [
    (Profile.NVFP4_G16, 4, [9, 1], [12, 3]),    # 2 heads per block: tiles of 8 queries
    (Profile.K8V4, 16, [3, 1], [5, 2])])         # 8 heads per block: tiles of 2 queries
def test_cuda_tiled_kernel_in_the_simulator(profile: Profile, hq: int, n: list[int],
                                           ctx: list[int]) -> None:
    """The CUDA kernel (numba's simulator) against the CPU tiled kernel: tiles that split a
    sequence's queries (more queries than a tile), a decode row, and GQA groups of 2 to 8
    heads per block (16 query heads -> one chunk of 8 per KV head)."""
    import numba

    assert numba.config.ENABLE_CUDASIM, "tests/conftest.py runs the CUDA kernels simulated"
    from ninfer_kv import typed_planes

    view = filled_view(profile)
    typed = typed_planes(view)                 # realistic values (random bits are denormals)
    for t in (typed.k, typed.v):
        if t.dtype != torch.float4_e2m1fn_x2:  # (any byte is a valid pair of FP4 codes)
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(6)))
    for t in (typed.k_scale, typed.v_scale):
        if t is not None:
            t.copy_(torch.rand(t.shape, generator=torch.Generator().manual_seed(7)) * 0.1 + 0.05)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    q = torch.randn(sum(n), hq, D, generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    cpu = paged_prefill_varlen(q, view, rows, cu, ctx_t)
    sim = paged_prefill_varlen(q, view, rows, cu, ctx_t, force_cuda_sim=True)
    assert torch.allclose(sim, cpu, rtol=1e-5, atol=1e-5), (sim - cpu).abs().max()
    assert not torch.equal(sim[0], sim[1])  # causal limits differ per query


def test_cuda_refuses_a_head_dim_whose_lanes_straddle_scale_groups() -> None:
    """Regression: D=96/192 passed D % 32 == 0, but a lane's D/32 = 3 or 6 elements cross a
    scale group (wrong scales) or overrun its registers (NVFP4 pairs)."""
    view = make_view(Profile.NVFP4_G16, 1, 96, pages=2, rows=1, logical=2)
    q = torch.randn(1, 1, 96)
    one = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(InvalidArgument, match="head_dim=96 on CUDA"):
        paged_prefill_varlen(q, view, one, torch.tensor([0, 1]), torch.tensor([1]),
                             force_cuda_sim=True)
    from ninfer_kv import paged_decode

    with pytest.raises(InvalidArgument, match="head_dim=96 on CUDA"):
        paged_decode(q, view, one, torch.tensor([1]), force_cuda_sim=True)
