"""Append and attention kernels on the CPU target, against independent references; the CUDA
kernels run the same checks under the simulator on small shapes (test_kernels_sim.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer_kv.engine.layout import PlaneOrder, Profile
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode, paged_prefill
from tests.kernels import reference as ref
from tests.kernels.helpers import make_view, read_kv

PROFILE_OF = {"bf16": Profile.BF16, "int8-g64": Profile.INT8_G64,
              "fp8-e4m3fn-row256": Profile.FP8_ROW256, "nvfp4-g16": Profile.NVFP4_G16}

# Error bounds vs float64 attention over the SAME dequantized K/V (the kernels' only error is
# fp32 accumulation/online softmax), relative to max |v|, per profile:
BOUND_DEQUANT = {p: 2e-5 for p in Profile}
# ... and vs the unquantized K/V (quantization error, unit-normal data), per profile:
BOUND_RAW = {Profile.BF16: 0.02, Profile.INT8_G64: 0.03, Profile.FP8_ROW256: 0.12,
             Profile.NVFP4_G16: 0.35, Profile.K8V4: 0.35}


def encode_rows_cpu(codec: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Encode rows x[n, D] through the append kernel; returns K (codes, scales) per row."""
    n, d = x.shape
    view = make_view(PROFILE_OF[codec], 1, d, pages=max(1, -(-n // 64)), rows=1,
                     logical=max(1, -(-n // 64)))
    kv = torch.from_numpy(x).view(n, 1, d)
    append_kv(view, torch.zeros(n, dtype=torch.int32), torch.arange(n), kv, kv)
    codes, scales = [], []
    for p in range(n):
        g = int(view.block_tables[0, p // 64])
        codes.append(view.k_pages[g, 0, p % 64].numpy().copy())
        scales.append(None if view.k_scale_pages is None else
                      view.k_scale_pages[g, 0, p % 64].numpy().copy())
    return np.stack(codes), None if scales[0] is None else np.stack(scales)


def fill(view, rows: list[int], lens: list[int], seed: int = 0, dtype=torch.float32):  # noqa: ANN001
    """Append random K/V for positions [0, len) of each row; returns the raw K/V per row."""
    gen = torch.Generator().manual_seed(seed)
    raw = []
    for r, n in zip(rows, lens, strict=True):
        k = torch.randn(n, view.num_kv_heads, view.head_dim, generator=gen).to(dtype)
        v = torch.randn(n, view.num_kv_heads, view.head_dim, generator=gen).to(dtype)
        # two appends: the second starts inside a page
        cut = n // 2 + 3 if n > 8 else n
        for a, b in ((0, cut), (cut, n)):
            if b > a:
                append_kv(view, torch.full((b - a,), r, dtype=torch.int32),
                          torch.arange(a, b), k[a:b], v[a:b])
        raw.append((k.float(), v.float()))
    return raw


# head-major (Draft Full) is BF16 only (spec §3.1)
@pytest.mark.parametrize("profile,order", [(p, PlaneOrder.PAGE_MAJOR) for p in Profile]
                         + [(Profile.BF16, PlaneOrder.HEAD_MAJOR)])
def test_append_matches_reference_encoding(profile: Profile, order: PlaneOrder) -> None:
    view = make_view(profile, 2, 128, pages=12, rows=2, logical=4, order=order)
    raw = fill(view, [1], [200], seed=3)
    k_codec, v_codec = (c.value for c in profile.codecs)
    kraw, vraw = raw[0]
    for pos in (0, 63, 64, 130, 199):
        g = int(view.block_tables[1, pos // 64])
        for h in range(2):
            for side, codec, x, code_t, scale_t in (
                    ("k", k_codec, kraw, view.k_pages, view.k_scale_pages),
                    ("v", v_codec, vraw, view.v_pages, view.v_scale_pages)):
                idx = (g, h, pos % 64) if order is PlaneOrder.PAGE_MAJOR else (h, g, pos % 64)
                code, scale = ref.encode_row(codec, x[pos, h].numpy())
                assert np.array_equal(code_t[idx].numpy(), code), (side, pos, h)
                if scale is not None:
                    assert np.array_equal(scale_t[idx].numpy(), scale), (side, pos, h)


CASES = [(p, d, g, f) for p in Profile for d in (64, 128, 256) for g in (1, 4, 8)
         for f in ("inside", "boundary")]


@pytest.mark.parametrize("profile,head_dim,gqa,frontier", CASES)
def test_decode_vs_float64_reference(profile: Profile, head_dim: int, gqa: int,
                                     frontier: str) -> None:
    heads = 2
    lens = [150, 37, 200] if frontier == "inside" else [128, 64, 192]
    view = make_view(profile, heads, head_dim, pages=16, rows=4, logical=4, seed=len(CASES))
    rows = [2, 0, 3]
    raw = fill(view, rows, lens, seed=head_dim + gqa)
    q = torch.randn(len(rows), heads * gqa, head_dim, generator=torch.Generator().manual_seed(1))
    out = paged_decode(q, view, torch.tensor(rows), torch.tensor(lens))
    for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
        kq, vq = read_kv(view, r, n)
        want = ref.attention_ref(q[i], kq, vq)
        vmax = vq.abs().max().item()
        err = (out[i].double() - want).abs().max().item()
        assert err <= BOUND_DEQUANT[profile] * vmax, (err, vmax)
        err_raw = (out[i].double() - ref.attention_ref(q[i], *raw[i])).abs().max().item()
        assert err_raw <= BOUND_RAW[profile], err_raw


@pytest.mark.parametrize("profile", [Profile.BF16, Profile.K8V4])
def test_decode_split_k_and_bf16_io(profile: Profile) -> None:
    view = make_view(profile, 1, 64, pages=40, rows=1, logical=40)
    fill(view, [0], [2000], seed=5, dtype=torch.bfloat16)
    q = torch.randn(1, 4, 64).to(torch.bfloat16)
    outs = [paged_decode(q, view, torch.tensor([0]), torch.tensor([2000]), n_split=s)
            for s in (1, 3, 8)]
    assert all(o.dtype == torch.bfloat16 for o in outs)
    for o in outs[1:]:
        assert (o.float() - outs[0].float()).abs().max().item() < 1e-2


def test_prefill_is_causal_over_context_and_chunk() -> None:
    view = make_view(Profile.FP8_ROW256, 2, 64, pages=8, rows=2, logical=4)
    raw = fill(view, [0, 1], [100, 75], seed=9)
    q = torch.randn(2, 5, 4, 64)
    start = torch.tensor([95, 70])  # the last 5 positions of each row are the chunk
    out = paged_prefill(q, view, torch.tensor([0, 1]), start)
    for b, r in enumerate((0, 1)):
        kq, vq = read_kv(view, r, int(start[b]) + 5)
        for t in range(5):
            n = int(start[b]) + t + 1
            want = ref.attention_ref(q[b, t], kq[:n], vq[:n])
            assert (out[b, t].double() - want).abs().max().item() < 1e-4
    del raw


def test_kernels_reject_bad_geometry() -> None:
    view = make_view(Profile.BF16, 2, 64, pages=2, rows=1, logical=2)
    with pytest.raises(ValueError, match="heads"):
        append_kv(view, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                  torch.zeros(1, 3, 64), torch.zeros(1, 3, 64))
    with pytest.raises(ValueError, match="Hq a positive multiple of H"):
        paged_decode(torch.zeros(1, 3, 64), view, torch.tensor([0]), torch.tensor([1]))
