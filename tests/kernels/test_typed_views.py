"""The vLLM/FlashInfer forms of our data: ``slot_mapping`` addresses exactly the column
append_kv wrote; ``typed_planes`` are the same bytes in torch's dtypes."""

from __future__ import annotations

import pytest
import torch

from ninfer_kv import append_kv, slot_mapping, typed_planes
from ninfer_kv.engine.layout import Profile
from tests.kernels.helpers import make_view, read_token

H, D = 2, 64


def written(profile: Profile):  # noqa: ANN201
    view = make_view(profile, H, D, pages=8, rows=2, logical=3, seed=7)
    view.block_tables[1, 2] = -1                      # an unmapped page
    gen = torch.Generator().manual_seed(3)
    rows = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    pos = torch.tensor([0, 130, 63, 64])
    k, v = torch.randn(2, 4, H, D, generator=gen)
    append_kv(view, rows, pos, k, v)
    return view, rows, pos, k, v


def test_slot_mapping_addresses_the_written_column() -> None:
    view, rows, pos, k, v = written(Profile.BF16)
    slots = slot_mapping(view, rows, pos)
    typed = typed_planes(view)
    for i, s in enumerate(slots.tolist()):
        assert typed.k[s // 64, :, s % 64].float().equal(k[i].bfloat16().float())
        assert typed.v[s // 64, :, s % 64].float().equal(v[i].bfloat16().float())
    assert int(view.block_tables[int(rows[1]), 2]) * 64 + 130 % 64 == slots[1]
    unmapped = slot_mapping(view, torch.tensor([1]), torch.tensor([129]))
    assert unmapped.tolist() == [-1]


@pytest.mark.parametrize("profile", [Profile.FP8_ROW256, Profile.INT8_G64, Profile.NVFP4_G16])
def test_typed_planes_decode_like_the_reference(profile: Profile) -> None:
    view, rows, pos, k, _ = written(profile)
    typed = typed_planes(view)
    assert typed.k.untyped_storage().data_ptr() == view.k_pages.untyped_storage().data_ptr()
    s = int(slot_mapping(view, rows[:1], pos[:1])[0])
    want = torch.from_numpy(read_token(view, 0, 0, "k"))        # [H, D], reference decoder
    code = typed.k[s // 64, :, s % 64]
    scale = typed.k_scale[s // 64, :, s % 64].float()
    if profile is Profile.NVFP4_G16:
        got = torch.from_numpy(_fp4(code.view(torch.uint8))) * scale.repeat_interleave(16, -1)
    elif profile is Profile.INT8_G64:
        got = code.float() * scale.repeat_interleave(64, -1)
    else:
        got = code.float() * scale
    assert torch.equal(got, want)


def _fp4(code: torch.Tensor):  # noqa: ANN202
    from tests.kernels import reference as ref

    nib = torch.stack([code & 15, code >> 4], -1).reshape(*code.shape[:-1], -1)
    return ref.fp4_val(nib.numpy())


def test_slot_mapping_refuses_padding_and_out_of_range() -> None:
    """Regression: -1 rows/positions wrapped around to another sequence's live slots."""
    from ninfer_kv.errors import InvalidArgument

    view, *_ = written(Profile.BF16)
    for rows, pos in (([0], [-1]), ([-1], [5]), ([0], [192]), ([2], [0])):
        with pytest.raises(InvalidArgument, match="slot_mapping"):
            slot_mapping(view, torch.tensor(rows), torch.tensor(pos))
