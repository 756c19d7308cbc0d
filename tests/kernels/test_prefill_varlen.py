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
    got = paged_prefill_varlen(q, view, rows, cu, torch.tensor(ctx, dtype=torch.int32))
    want = torch.cat([
        paged_prefill(q[int(cu[i]):int(cu[i + 1])].unsqueeze(0), view, rows[i:i + 1],
                      torch.tensor([ctx[i] - n[i]], dtype=torch.int32))[0]
        for i in range(3)])
    assert torch.equal(got, want)


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
    with pytest.raises(InvalidArgument, match="must be an integer tensor"):
        paged_prefill_varlen(q, view, rows, torch.tensor([0.0, 1.0, 4.0]), ctx)
