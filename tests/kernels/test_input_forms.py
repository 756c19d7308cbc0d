"""Tensor forms the kernel wrappers' checks let through must work or be refused typed, and a
checked write counts only once its kernel ran.

From an outside review (2026-12-03): uint16/uint32 index tensors passed ``check_index`` and then
crashed ``paged_decode`` / ``paged_prefill`` with torch's NotImplementedError; sparse tensors
passed every check and failed inside torch; and checked mode recorded an ``append_kv`` write
before converting its inputs, so a write that then failed still let a checked commit publish
tokens never written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ninfer_kv import (
    KVStore,
    ModelGeometry,
    ServingConfig,
    StoreConfig,
    append_kv,
    paged_decode,
    paged_prefill,
    paged_prefill_varlen,
    slot_mapping,
)
from ninfer_kv.engine.layout import PlaneOrder, Profile
from ninfer_kv.engine.views import PagedKVBatchLayerView
from ninfer_kv.errors import InvalidArgument, WritePermissionError


def view() -> PagedKVBatchLayerView:
    planes = torch.zeros(2, 4, 2, 64, 64, dtype=torch.uint16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return PagedKVBatchLayerView(planes[0], planes[1], None, None, tables, 64, 2,
                                 Profile.BF16, PlaneOrder.PAGE_MAJOR)


ROWS = torch.tensor([0], dtype=torch.int32)
CALLS: dict[str, Callable[[Any], object]] = {
    "decode context_lens": lambda dt: paged_decode(torch.randn(1, 4, 64), view(), ROWS,
                                                   torch.tensor([5], dtype=dt)),
    "prefill start": lambda dt: paged_prefill(torch.randn(1, 2, 4, 64), view(), ROWS,
                                              torch.tensor([3], dtype=dt)),
    "append positions": lambda dt: append_kv(view(), ROWS, torch.tensor([3], dtype=dt),
                                             torch.randn(1, 2, 64), torch.randn(1, 2, 64)),
    "slot_mapping rows": lambda dt: slot_mapping(view(), ROWS.to(dt), torch.tensor([3])),
}


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_uint16_and_uint32_indices_work_as_int64(name: str, dtype: torch.dtype) -> None:
    """``torch.from_numpy`` of a numpy uint32 array: widened to int64 by the checks (torch has
    few operations on these dtypes: the default n_split's max() raised NotImplementedError)."""
    CALLS[name](dtype)


def test_uint16_and_uint32_give_the_answers_of_int64() -> None:
    rows, pos = torch.tensor([1, 0], dtype=torch.uint32), torch.tensor([70, 3], dtype=torch.uint16)
    assert torch.equal(slot_mapping(view(), rows, pos),
                       slot_mapping(view(), rows.to(torch.int64), pos.to(torch.int64)))
    q, lens = torch.randn(2, 4, 64), torch.tensor([5, 9])
    assert torch.equal(paged_decode(q, view(), rows.to(torch.int32), lens.to(torch.uint32)),
                       paged_decode(q, view(), rows.to(torch.int32), lens))


def odd_index(dtype: torch.dtype) -> torch.Tensor:
    """A one-element index tensor of a dtype torch can hardly build one of."""
    if dtype in (torch.qint8, torch.quint8, torch.qint32):
        return torch.quantize_per_tensor(torch.tensor([0.0]), 1.0, 0, dtype)
    if dtype == torch.bits8:
        return torch.zeros(1, dtype=torch.uint8).view(torch.bits8)
    return torch.zeros(1, dtype=dtype) if dtype == torch.uint64 else torch.empty(1, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.uint64, torch.uint4, torch.int4, torch.qint8,
                                   torch.quint8, torch.bits8], ids=str)
def test_other_integer_dtypes_are_refused_typed(dtype: torch.dtype) -> None:
    """A review: the sub-byte and quantized dtypes passed a deny-list and then failed inside
    torch (NotImplementedError, an internal assert). Indices are an allow-list now."""
    idx = odd_index(dtype)
    calls = [lambda: slot_mapping(view(), idx, torch.tensor([3])),
             lambda: slot_mapping(view(), ROWS, idx),
             lambda: paged_decode(torch.randn(1, 4, 64), view(), idx, torch.tensor([5])),
             lambda: paged_decode(torch.randn(1, 4, 64), view(), ROWS, idx)]
    for call in calls:
        with pytest.raises(InvalidArgument, match=r"integer tensor \(int8/16/32/64 or uint8"):
            call()


SPARSE: dict[str, Callable[[], object]] = {
    "decode q": lambda: paged_decode(torch.randn(1, 4, 64).to_sparse(), view(), ROWS,
                                     torch.tensor([5])),
    "decode rows": lambda: paged_decode(torch.randn(1, 4, 64), view(), ROWS.to_sparse(),
                                        torch.tensor([5])),
    "append k": lambda: append_kv(view(), ROWS, torch.tensor([3]),
                                  torch.randn(1, 2, 64).to_sparse(), torch.randn(1, 2, 64)),
    "slot_mapping rows": lambda: slot_mapping(view(), ROWS.to_sparse(), torch.tensor([3])),
    "decode nested q": lambda: paged_decode(torch.nested.nested_tensor([torch.randn(4, 64)]),
                                            view(), ROWS, torch.tensor([5])),
}


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_sparse_tensors_are_refused_typed(name: str) -> None:
    with pytest.raises(InvalidArgument, match="dense"):
        SPARSE[name]()  # old code: torch's RuntimeError / NotImplementedError


def test_a_checked_write_whose_kernel_failed_is_no_write(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from ninfer_kv.kernels import append

    s = KVStore.open(StoreConfig(model=ModelGeometry(layers=1, kv_heads=2, head_dim=64),
                                 serving=ServingConfig(max_context=1024, max_concurrency=2),
                                 kv_tokens=16 * 64, checked=True))
    a = s.activate(10, 10)
    s.ensure_mapped(a, "main", 10)
    k = torch.randn(10, 2, 64)

    def interrupted(*args: object) -> None:  # a kernel that never ran (an interrupt, a
        raise KeyboardInterrupt              # conversion that failed after the checks)

    with s.boundary():
        rows = s.table_rows("main", [a]).repeat(10)
        with monkeypatch.context() as m:
            m.setattr(append, "_append_serial", interrupted)
            m.setattr(append, "_append_cpu", interrupted)
            with pytest.raises(KeyboardInterrupt):
                append_kv(s.batch_view("main", 0), rows[:2], torch.arange(2), k[:2], k[:2])
        append_kv(s.batch_view("main", 0), rows[2:], torch.arange(2, 10), k[2:], k[2:])
    before = s.digest()
    with pytest.raises(WritePermissionError, match="never wrote"):
        s.commit(a, "main", 10)  # old code: accepted, tokens 0 and 1 never written
    assert s.digest() == before
    s.close()


def test_zero_query_heads_are_refused_typed() -> None:
    """Review: the tiled varlen path raised a bare ValueError (max() of nothing) for q with no
    head; decode and the untiled path returned an empty answer. All refuse it now."""
    rows = torch.tensor([0], dtype=torch.int32)
    q = torch.randn(3, 0, 64)
    calls = [lambda: paged_decode(q, view(), rows.repeat(3), torch.tensor([1, 2, 3])),
             lambda: paged_prefill_varlen(q, view(), rows, torch.tensor([0, 3]),
                                          torch.tensor([3]), tiled=False),
             lambda: paged_prefill_varlen(q, view(), rows, torch.tensor([0, 3]),
                                          torch.tensor([3]))]
    for call in calls:
        with pytest.raises(InvalidArgument, match="Hq a positive multiple of H"):
            call()


def test_typed_planes_checks_its_view() -> None:
    """Review: typed_planes(None) raised AttributeError, and float32 planes under BF16 were
    reinterpreted silently as bfloat16 of twice the width."""
    from ninfer_kv import typed_planes

    with pytest.raises(InvalidArgument):
        typed_planes(None)  # type: ignore[arg-type]
    planes = torch.zeros(2, 4, 2, 64, 64, dtype=torch.float32)
    bad = PagedKVBatchLayerView(planes[0], planes[1], None, None,
                                torch.zeros(2, 4, dtype=torch.int32), 64, 2, Profile.BF16,
                                PlaneOrder.PAGE_MAJOR)
    with pytest.raises(InvalidArgument):
        typed_planes(bad)
    with pytest.raises(InvalidArgument):
        typed_planes(bad.row_view(0))
    good = view()
    assert typed_planes(good).k.dtype == torch.bfloat16
    assert typed_planes(good.row_view(1)).v.shape == good.v_pages.shape


def test_row_view_takes_only_a_row_of_the_table() -> None:
    """Review: row_view(-1) gave the last row's table (another sequence's pages), a row past C
    a bare IndexError, and True was taken for row 1."""
    v = view()
    for bad in (-1, 2, True, 0.0):
        with pytest.raises(InvalidArgument):
            v.row_view(bad)  # type: ignore[arg-type]
    assert torch.equal(v.row_view(1).block_table, v.block_tables[1])
