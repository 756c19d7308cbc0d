"""Every check the kernel wrappers make before a launch (kernels/checks.py, spec §12.4) refuses
its bad input with InvalidArgument — one case per rule, so that removing any rule fails here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer_kv.engine.layout import Profile
from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode
from tests.kernels.helpers import make_view

H, D = 2, 64


@pytest.fixture
def bf16():  # noqa: ANN201
    return make_view(Profile.BF16, H, D, pages=16, rows=2, logical=4)


@pytest.fixture
def int8():  # noqa: ANN201
    return make_view(Profile.INT8_G64, H, D, pages=16, rows=2, logical=4)


def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, H, D), torch.randn(n, H, D)


ROWS = torch.tensor([0], dtype=torch.int32)


def test_append_batch_sizes_must_agree(bf16) -> None:  # noqa: ANN001
    k, v = kv(2)
    with pytest.raises(InvalidArgument, match="disagree"):
        append_kv(bf16, ROWS, torch.tensor([0]), k, v)


def test_values_must_be_tensors(bf16) -> None:  # noqa: ANN001
    k, _ = kv(1)
    with pytest.raises(InvalidArgument, match="v must be a torch.Tensor"):
        append_kv(bf16, ROWS, torch.tensor([0]), k, [[0.0]])


@pytest.mark.parametrize("change,pattern", [
    (lambda v: dataclasses.replace(v, block_tables=v.block_tables.long()), "must be int32"),
    (lambda v: dataclasses.replace(v, k_scale_pages=v.k_pages.clone()), "has no k_scale plane"),
    (lambda v: dataclasses.replace(v, k_pages=v.k_pages[0]), "must be 4-D"),
    (lambda v: dataclasses.replace(v, k_pages=v.k_pages[:, :1]), "does not hold H=2"),
    (lambda v: dataclasses.replace(v, v_pages=v.v_pages[:8]), "disagree on the page count"),
])
def test_bf16_view_geometry(bf16, change, pattern: str) -> None:  # noqa: ANN001
    k, v = kv(1)
    with pytest.raises(InvalidArgument, match=pattern):
        append_kv(change(bf16), ROWS, torch.tensor([0]), k, v)


def test_a_quantized_view_needs_its_scale_planes(int8) -> None:  # noqa: ANN001
    k, v = kv(1)
    with pytest.raises(InvalidArgument, match="needs a v_scale plane"):
        append_kv(dataclasses.replace(int8, v_scale_pages=None), ROWS, torch.tensor([0]), k, v)


def test_decode_refuses_a_context_past_the_mapped_blocks(bf16) -> None:  # noqa: ANN001
    tables = bf16.block_tables.clone()
    tables[0, 2:] = -1  # row 0 maps two blocks (128 tokens)
    view = dataclasses.replace(bf16, block_tables=tables)
    q = torch.randn(1, H, D)
    paged_decode(q, view, ROWS, torch.tensor([128]))
    with pytest.raises(InvalidArgument, match="reads block 2 below its context 129"):
        paged_decode(q, view, ROWS, torch.tensor([129]))


def test_decode_rows_and_lengths_must_match_the_queries(bf16) -> None:  # noqa: ANN001
    q = torch.randn(2, H, D)
    with pytest.raises(InvalidArgument, match="table_rows and context_lens must be"):
        paged_decode(q, bf16, torch.tensor([0]), torch.tensor([5, 5]))
    with pytest.raises(InvalidArgument, match="table_rows and context_lens must be"):
        paged_decode(q, bf16, torch.tensor([0, 1]), torch.tensor([5]))
