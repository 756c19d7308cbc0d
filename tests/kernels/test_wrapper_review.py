"""Findings of an outside review of the kernel wrappers (2026-12-03), each a rule of §12.4 the
wrappers did not hold: checked mode's host check of reads on CUDA, closed strides and planes
of their own, one writer per token slot, no host read when the caller sizes the split,
bounds on the page copies, slot_mapping within the pool, and typed refusals (devices, view
fields) naming the function and the values."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ninfer_kv import KVStore, ModelGeometry, ServingConfig, StoreConfig, append_kv, paged_decode
from ninfer_kv.engine.layout import PlaneOrder, Profile
from ninfer_kv.engine.views import PagedKVBatchLayerView, slot_mapping
from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels import attention
from ninfer_kv.kernels.attention import paged_prefill
from ninfer_kv.kernels.checks import check_mapped, check_read_domain
from ninfer_kv.kernels.copy import copy_pages, copy_tail, host_page_bytes, pack_pages, unpack_pages
from ninfer_kv.kernels.prefill import paged_prefill_varlen


def bf16_view(n: int = 4, heads: int = 1, tables: list[list[int]] | None = None,
              k: torch.Tensor | None = None, v: torch.Tensor | None = None,
              **fields: Any) -> PagedKVBatchLayerView:
    """A page-major BF16 view over ``n`` page groups (rows map pages 0 and 1 by default)."""
    plane = lambda: torch.zeros(n, heads, 64, 64, dtype=torch.uint16)  # noqa: E731
    kw = dict(head_dim=64, num_kv_heads=heads, storage=Profile.BF16,
              order=PlaneOrder.PAGE_MAJOR)
    kw.update(fields)
    return PagedKVBatchLayerView(plane() if k is None else k, plane() if v is None else v,
                                 None, None,
                                 torch.tensor(tables or [[0], [1]], dtype=torch.int32), **kw)


def one(b: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((b, 1, 64), value)


class OnCuda:
    """What the checks read of a CUDA tensor (no GPU here): ``is_cuda``, and ``cpu()``."""

    is_cuda = True

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def cpu(self) -> torch.Tensor:
        return self.t


# --- 1. checked mode checks reads and writes on CUDA too ---------------------------------------
@pytest.mark.parametrize("checked", [True, False])
def test_checked_mode_checks_cuda_reads_on_the_host(checked: bool) -> None:
    """A context of 300 over 2 mapped blocks: the host check refuses it on the CPU always,
    and for CUDA tensors in checked mode (the docs' promise; it returned early, and the
    kernel skipped the unmapped blocks: attention over fewer tokens, no error). Without
    checked mode a CUDA launch takes no host sync: nothing is checked there."""
    table = torch.full((1, 8), -1, dtype=torch.int32)
    table[0, :2] = torch.tensor([0, 1])
    view = SimpleNamespace(block_tables=OnCuda(table), k_pages=torch.zeros(4, 1, 64, 64),
                           order=PlaneOrder.PAGE_MAJOR,
                           guard=(lambda rows, pos: None) if checked else None)
    rows, ctx = OnCuda(torch.tensor([0])), OnCuda(torch.tensor([300]))
    if checked:
        with pytest.raises(InvalidArgument, match="reads block 2 below its context 300"):
            check_read_domain(view, rows, ctx, "paged_decode")
        with pytest.raises(InvalidArgument, match="maps page group -1: not mapped"):
            check_mapped(view, rows, OnCuda(torch.tensor([200])), "append_kv")
    else:
        check_read_domain(view, rows, ctx, "paged_decode")
        check_mapped(view, rows, OnCuda(torch.tensor([200])), "append_kv")


# --- 2. closed strides, planes of their own --------------------------------------------------
def test_a_plane_with_a_zero_stride_is_refused() -> None:
    """Review repro: a plane expanded over pages (stride 0) made page 1's write page 0's:
    row 0 then read V = 7.0 written for row 1."""
    expanded = lambda: torch.zeros(1, 1, 64, 64, dtype=torch.uint16).expand(4, 1, 64, 64)  # noqa: E731
    view = bf16_view(k=expanded(), v=expanded())
    with pytest.raises(InvalidArgument, match="k_code plane .* not the closed strides"):
        append_kv(view, torch.tensor([1]), torch.tensor([0]), one(1, 7.0), one(1, 7.0))


def test_a_sliced_plane_is_refused() -> None:
    """Not overlapping, but not closed either: the page copies reshape such a plane into a
    temporary and would copy into it."""
    both = torch.zeros(4, 2, 1, 64, 64, dtype=torch.uint16)
    view = bf16_view(k=both[:, 0], v=both[:, 1])
    with pytest.raises(InvalidArgument, match="not the closed strides"):
        paged_decode(torch.zeros(1, 1, 64), view, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(InvalidArgument, match="not contiguous"):
        copy_pages([both[:, 0]], PlaneOrder.PAGE_MAJOR, [0], [1])


@pytest.mark.parametrize("how", ["same tensor", "V inside K's memory", "table in a plane"])
def test_planes_that_share_memory_are_refused(how: str) -> None:
    """Review repro: ``k_pages is v_pages`` stored V over K (wrote K 3.0, read 5.0)."""
    if how == "same tensor":
        t = torch.zeros(4, 1, 64, 64, dtype=torch.uint16)
        view = bf16_view(k=t, v=t)
    elif how == "V inside K's memory":
        big = torch.zeros(8, 1, 64, 64, dtype=torch.uint16)
        view = bf16_view(k=big[:4], v=big[3:7])
    else:
        t = torch.zeros(4, 1, 64, 64, dtype=torch.uint16)
        view = bf16_view(k=t)
        view = PagedKVBatchLayerView(view.k_pages, view.v_pages, None, None,
                                     t.view(torch.int32).view(-1)[:2].view(1, 2), 64, 1,
                                     Profile.BF16, PlaneOrder.PAGE_MAJOR)
    with pytest.raises(InvalidArgument, match="share memory"):
        append_kv(view, torch.tensor([0]), torch.tensor([0]), one(1, 3.0), one(1, 5.0))


def test_planes_next_to_each_other_in_one_allocation_are_accepted() -> None:
    """K and V as two halves of one buffer share no byte: accepted, each write its own."""
    both = torch.zeros(8, 1, 64, 64, dtype=torch.uint16)
    view = bf16_view(k=both[:4], v=both[4:])
    append_kv(view, torch.tensor([0]), torch.tensor([0]), one(1, 3.0), one(1, 5.0))
    out = paged_decode(torch.zeros(1, 1, 64), view, torch.tensor([0]), torch.tensor([1]))
    assert out[0, 0, 0].item() == 5.0


# --- 3. one writer per token slot ---------------------------------------------------------------
def test_two_rows_writing_one_slot_of_a_shared_page_are_refused() -> None:
    """Rows 0 and 1 both map page 0 (a fork's shared prefix): writing column 3 through each
    in one call races as a repeated (row, position) does, which was already refused."""
    view = bf16_view(tables=[[0], [0]])
    with pytest.raises(InvalidArgument, match="both write column 3 of page group 0"):
        append_kv(view, torch.tensor([0, 1]), torch.tensor([3, 3]), one(2), one(2))
    append_kv(view, torch.tensor([0, 1]), torch.tensor([3, 4]), one(2), one(2))  # distinct


# --- 4. no host read when the caller chose the split -------------------------------------------
def test_paged_decode_reads_no_context_length_when_n_split_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading ``context_lens.max()`` is a device sync on CUDA that a CUDA graph cannot
    replay (§13); only ``choose_splits`` needs it, so with ``n_split`` nothing reads it."""
    reads: list[str] = []
    real_max = torch.Tensor.max

    def spy_max(t: torch.Tensor, *a: Any, **kw: Any) -> Any:  # noqa: ANN401
        if t.dtype in (torch.int32, torch.int64) and t.dim() == 1 and t.numel() == 2:
            reads.append("max")
        return real_max(t, *a, **kw)

    view = bf16_view()
    append_kv(view, torch.tensor([0, 1]), torch.tensor([0, 0]), one(2), one(2))
    monkeypatch.setattr(torch.Tensor, "max", spy_max)
    ctx = torch.tensor([1, 1])
    paged_decode(torch.zeros(2, 1, 64), view, torch.tensor([0, 1]), ctx, n_split=2)
    assert reads == []
    paged_decode(torch.zeros(2, 1, 64), view, torch.tensor([0, 1]), ctx)
    assert reads == ["max"]  # the spy sees the read when the split is chosen
    assert attention.choose_splits(2, 1, 1, False) >= 1


# --- 5. page copies stay in the pool -----------------------------------------------------------
def test_page_copies_refuse_ids_outside_the_pool() -> None:
    """Review repro: ``copy_pages`` to page 4 of 4, ``copy_tail`` of 128 columns and a pack
    of two pages into a one-page host buffer each wrote 512 elements of the neighbouring
    memory; -1 wrapped to the last page."""
    planes = [torch.zeros(4, 1, 64, 64, dtype=torch.uint16)]
    order = PlaneOrder.PAGE_MAJOR
    for src, dst in (([0], [4]), ([0], [-1]), ([5], [0]), ([0, 1], [2])):
        with pytest.raises(InvalidArgument):
            copy_pages(planes, order, src, dst)
    with pytest.raises(InvalidArgument, match="columns"):
        copy_tail(planes, order, 0, 1, 128)
    with pytest.raises(InvalidArgument, match="dst_page"):
        copy_tail(planes, order, 0, 4, 3)
    host = torch.zeros(1, host_page_bytes(planes, order), dtype=torch.uint8)
    with pytest.raises(InvalidArgument, match="host pages"):
        pack_pages(planes, order, [0, 1], host)
    with pytest.raises(InvalidArgument, match="host pages"):
        unpack_pages(planes, order, host, [0, 1])
    with pytest.raises(InvalidArgument, match="page_ids"):
        pack_pages(planes, order, [7], host)
    planes[0][1] = 9
    copy_pages(planes, order, [1], [3])  # within the pool: copied
    assert bool((planes[0][3] == 9).all())


# --- 6. slot_mapping within the pool -------------------------------------------------------------
def test_slot_mapping_refuses_a_table_entry_past_the_pool() -> None:
    """Review repro: an entry of 99 in a 4-group pool gave slot 6342; append_kv refuses the
    same entry."""
    view = bf16_view(tables=[[0], [99]])
    assert slot_mapping(view, torch.tensor([0]), torch.tensor([5])).tolist() == [5]
    with pytest.raises(InvalidArgument, match="maps page group 99, outside the 4"):
        slot_mapping(view, torch.tensor([0, 1]), torch.tensor([5, 6]))


# --- 7. typed refusals ---------------------------------------------------------------------------
def test_inputs_on_another_device_are_refused_by_name() -> None:
    view = bf16_view()
    meta = torch.zeros(1, 1, 64, device="meta")
    with pytest.raises(InvalidArgument, match="q is on meta"):
        paged_decode(meta, view, torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(InvalidArgument, match="context_lens is on meta"):
        paged_decode(torch.zeros(1, 1, 64), view, torch.tensor([0]),
                     torch.tensor([1], device="meta"))
    with pytest.raises(InvalidArgument, match="k is on meta"):
        append_kv(view, torch.tensor([0]), torch.tensor([0]), meta, one(1))


@pytest.mark.parametrize("field,value", [("num_kv_heads", 0), ("head_dim", 0),
                                         ("storage", "bf16"), ("order", "page-major")])
def test_a_view_with_a_bad_field_is_refused(field: str, value: Any) -> None:  # noqa: ANN401
    view = bf16_view(**{field: value})
    with pytest.raises(InvalidArgument, match=field if field in ("num_kv_heads", "head_dim")
                       else "must be a Profile"):
        paged_decode(torch.zeros(1, 1, 64), view, torch.tensor([0]), torch.tensor([1]))


def test_slot_mapping_of_no_view_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="slot_mapping: takes a batch view"):
        slot_mapping(None, torch.tensor([0]), torch.tensor([0]))  # type: ignore[arg-type]


def test_batch_size_refusals_name_their_function_and_shapes() -> None:
    view = bf16_view()
    with pytest.raises(InvalidArgument, match=r"paged_prefill: table_rows \(2,\) must be "
                                              r"\[B=1\]"):
        paged_prefill(torch.zeros(1, 2, 1, 64), view, torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(InvalidArgument, match=r"paged_decode: table_rows \(1,\) and "
                                              r"context_lens \(2,\) must be \[B=1\]"):
        paged_decode(torch.zeros(1, 1, 64), view, torch.tensor([0]), torch.tensor([1, 1]))


def test_the_store_views_pass_every_check() -> None:
    """The store's own views (contiguous planes, each its own memory) are accepted."""
    store = KVStore.open(StoreConfig(model=ModelGeometry(layers=1, kv_heads=2, head_dim=64),
                                     serving=ServingConfig(max_context=256, max_concurrency=2),
                                     kv_tokens=64 * 8, checked=True))
    try:
        a = store.activate(70, 10)
        store.ensure_mapped(a, "main", 70)
        with store.boundary():
            view, rows = store.batch_view("main", 0), store.table_rows("main", [a])
            kv = torch.ones(70, 2, 64)
            append_kv(view, rows.repeat(70), torch.arange(70), kv, kv)
        store.commit(a, "main", 70)
        out = paged_decode(torch.zeros(1, 2, 64), view, rows, torch.tensor([70]))
        assert torch.allclose(out, torch.ones_like(out))
    finally:
        store.close()


# --- a second review, of the fixes above ---------------------------------------------------------
def test_every_input_and_plane_is_on_the_planes_device() -> None:
    """Each named input, and the v plane, on another device than the k plane: refused by
    name (the v plane reached numpy as a TypeError; a CUDA context_lens with CPU planes made
    paged_prefill_varlen skip its read check, and the CPU kernel read another row's page
    through a -1 entry)."""
    view = bf16_view()
    meta = lambda t: t.to("meta")  # noqa: E731
    r, p = torch.tensor([0]), torch.tensor([0])
    for args, name in (((meta(r), p), "table_rows"), ((r, meta(p)), "positions")):
        with pytest.raises(InvalidArgument, match=f"append_kv: {name} is on meta"):
            append_kv(view, *args, one(1), one(1))
    with pytest.raises(InvalidArgument, match="slot_mapping: table_rows is on meta"):
        slot_mapping(view, meta(r), p)
    split = bf16_view(v=torch.zeros(4, 1, 64, 64, dtype=torch.uint16, device="meta"))
    with pytest.raises(InvalidArgument, match="v_code plane is on meta"):
        paged_decode(torch.zeros(1, 1, 64), split, r, torch.tensor([1]))
    cu, ctx = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    for args, name in (((meta(cu), ctx), "cu_seqlens"), ((cu, meta(ctx)), "context_lens")):
        with pytest.raises(InvalidArgument, match=f"paged_prefill_varlen: {name} is on meta"):
            paged_prefill_varlen(torch.zeros(1, 1, 64), view, r, *args)
    with pytest.raises(InvalidArgument, match="paged_prefill: start is on meta"):
        paged_prefill(torch.zeros(1, 1, 1, 64), view, r, meta(torch.tensor([0])))


def test_a_strided_table_is_refused() -> None:
    """A table whose rows are strided apart (here its row 1 inside the K plane) is one
    memory range only when contiguous: the overlap check needs that."""
    k = torch.zeros(4, 1, 64, 64, dtype=torch.uint16)
    table = k.view(torch.int32).view(-1).as_strided((2, 1), (116, 1))
    view = PagedKVBatchLayerView(k, torch.zeros_like(k), None, None, table, 64, 1,
                                 Profile.BF16, PlaneOrder.PAGE_MAJOR)
    with pytest.raises(InvalidArgument, match="block table .* not the closed strides"):
        append_kv(view, torch.tensor([0]), torch.tensor([3]), one(1), one(1))


def test_page_copies_check_every_plane_and_their_arguments() -> None:
    """The copies write every plane: a second plane of 2 pages beside a first of 4 was
    written past its end (heap corruption). The order given as a string copied along the
    head axis; ids as a 0-d tensor, a numpy scalar or past int64 escaped untyped."""
    import numpy as np

    order = PlaneOrder.PAGE_MAJOR
    planes = [torch.zeros(4, 1, 64, 64, dtype=torch.uint16),
              torch.zeros(2, 1, 64, 64, dtype=torch.uint16)]
    with pytest.raises(InvalidArgument, match=r"the planes hold \[2, 4\] page groups"):
        copy_pages(planes, order, [0], [3])
    with pytest.raises(InvalidArgument, match="page groups"):
        copy_tail(planes, order, 0, 3, 5)
    one_plane = planes[:1]
    with pytest.raises(InvalidArgument, match="order must be a PlaneOrder"):
        copy_pages(one_plane, "page-major", [0], [1])  # type: ignore[arg-type]
    for ids in (torch.tensor(1), np.int64(1), [2**70]):
        with pytest.raises(InvalidArgument, match="copy_pages: dst"):
            copy_pages(one_plane, order, [0], ids)  # type: ignore[arg-type]
    host = torch.zeros(2, host_page_bytes(one_plane, order), dtype=torch.uint8)
    pack_pages(one_plane, order, np.array([], np.int64), host)  # nothing to copy
    pack_pages(one_plane, order, np.array([1, 2]), host)  # numpy ids: accepted


def test_the_transformers_unit_puts_its_index_tensors_on_the_planes_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: the integration built positions, cu_seqlens and context lengths on
    the CPU whatever the store's device; with the device check a CUDA store's own forward
    was refused. Stand-in: ``table_rows`` on meta plays the CUDA device."""
    from ninfer_kv.integrations.transformers import _Unit

    store = KVStore.open(StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                                     serving=ServingConfig(max_context=256, max_concurrency=2),
                                     kv_tokens=64 * 8))
    try:
        seqs = [store.activate(10, 10), store.activate(5, 10)]
        real = torch.tensor([[True, True], [True, False]])
        rows = store.table_rows("main", seqs)
        monkeypatch.setattr(store, "table_rows", lambda pool, s: rows.to("meta"))
        unit = _Unit.plan(store, "main", seqs, real, torch.tensor([0, 0]), torch.tensor([2, 1]))
        for name in ("flat_rows", "positions", "cu", "active", "ctx"):
            assert getattr(unit, name).device.type == "meta", name
        assert unit.end.device.type == "cpu"  # the host's bookkeeping stays there
    finally:
        store.close()


def test_page_copies_refuse_ids_that_are_not_integers_and_a_wrong_host_buffer() -> None:
    """The copies' argument rules not covered above: ids as floats, bools or a matrix, and a
    host buffer that is not a contiguous uint8 [n, page bytes] tensor."""
    order = PlaneOrder.PAGE_MAJOR
    planes = [torch.zeros(4, 1, 64, 64, dtype=torch.uint16)]
    for ids in ([1.0], [True], [[1]]):
        with pytest.raises(InvalidArgument, match="copy_pages: dst must be integer ids"):
            copy_pages(planes, order, [0], ids)  # type: ignore[arg-type]
    good = torch.zeros(2, host_page_bytes(planes, order), dtype=torch.uint8)
    for host in (good.view(torch.int16), good.t(), good.view(-1)):
        with pytest.raises(InvalidArgument, match="host pages must be a contiguous uint8"):
            pack_pages(planes, order, [0], host)


def test_uint64_indices_are_refused_by_their_dtype() -> None:
    """The checks read index tensors as int64: a uint64 row of 2**63 wrapped to -2**63 and
    was refused under that name. uint64 is refused by its dtype, before any value is read;
    the other integer dtypes are taken."""
    view = bf16_view()
    q = torch.zeros(1, 1, 64)
    big = torch.tensor([2 ** 63], dtype=torch.uint64)
    with pytest.raises(InvalidArgument, match=r"table_rows must be .*got torch.uint64"):
        paged_decode(q, view, big, torch.tensor([1]))
    with pytest.raises(InvalidArgument, match=r"context_lens must be .*got torch.uint64"):
        paged_decode(q, view, torch.tensor([0]), torch.tensor([1], dtype=torch.uint64))
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.uint16, torch.uint32):
        paged_decode(q, view, torch.tensor([0], dtype=dtype), torch.tensor([1], dtype=dtype),
                     n_split=1)  # and with the default n_split (a review: uint32 crashed it)
        paged_decode(q, view, torch.tensor([0], dtype=dtype), torch.tensor([1], dtype=dtype))


def test_inputs_of_the_wrong_kind_or_rank_and_a_host_page_of_the_wrong_size_are_refused() -> None:
    """Survivors of a mutation run (2026-12-03): no test held these refusals by name.
    Without them a list or a matrix of rows, or a 2-D q, failed deeper, untyped, and a host
    buffer with pages of another size was read with the wrong strides."""
    view = bf16_view()
    q, rows, ctx = torch.zeros(1, 1, 64), torch.tensor([0]), torch.tensor([1])
    with pytest.raises(InvalidArgument, match="table_rows must be a torch.Tensor, got list"):
        paged_decode(q, view, [0], ctx)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"context_lens must be 1-D, got shape \(1, 1\)"):
        paged_decode(q, view, rows, ctx.view(1, 1))
    for bad in (torch.zeros(1, 64), torch.zeros(1, 1, 64, dtype=torch.int32)):
        with pytest.raises(InvalidArgument, match="q must be a 3-D floating-point tensor"):
            paged_decode(bad, view, rows, ctx)
    order = PlaneOrder.PAGE_MAJOR
    planes = [torch.zeros(4, 1, 64, 64, dtype=torch.uint16)]
    page = host_page_bytes(planes, order)
    for host in (torch.zeros(2, page + 8, dtype=torch.uint8),
                 torch.zeros(2, page // 2, dtype=torch.uint8)):
        with pytest.raises(InvalidArgument, match=f"host page of {host.shape[1]} B does not "
                                                  f"hold these planes \\({page} B\\)"):
            pack_pages(planes, order, [0], host)
        with pytest.raises(InvalidArgument, match="does not hold these planes"):
            unpack_pages(planes, order, host, [0])
