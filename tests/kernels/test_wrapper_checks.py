"""Every check the kernel wrappers make before a launch (kernels/checks.py, spec §12.4) refuses
its bad input with InvalidArgument — one case per rule, so that removing any rule fails here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ninfer_kv.engine.layout import PlaneOrder, Profile
from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels.append import append_kv
from ninfer_kv.kernels.attention import paged_decode
from ninfer_kv.kernels.copy import copy_tails
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
    with pytest.raises(InvalidArgument, match="table_rows .* and context_lens .* must be"):
        paged_decode(q, bf16, torch.tensor([0]), torch.tensor([5, 5]))
    with pytest.raises(InvalidArgument, match="table_rows .* and context_lens .* must be"):
        paged_decode(q, bf16, torch.tensor([0, 1]), torch.tensor([5]))


def test_reads_refuse_a_page_group_past_the_pool(bf16) -> None:  # noqa: ANN001
    """Review finding: the read check refused only entries below 0; an entry at or past the
    pool's page count was read (another allocation's memory, or SIGSEGV)."""
    tables = bf16.block_tables.clone()
    tables[0, 0] = bf16.k_pages.shape[0]
    view = dataclasses.replace(bf16, block_tables=tables)
    with pytest.raises(InvalidArgument, match="maps page group 16: not a mapped page of the 16"):
        paged_decode(torch.randn(1, H, D), view, ROWS, torch.tensor([1]))


@pytest.mark.parametrize("field", ["table_rows", "context_lens"])
def test_prefill_checks_the_int64_values_not_their_int32_casts(bf16, field: str) -> None:  # noqa: ANN001
    """Review finding: paged_prefill_varlen cast rows and contexts to int32 before its check,
    so table row 2**32 read row 0 and a context of 2**32 + 4 passed as 4, then the CPU kernel
    walked the table with the int64 value (SIGSEGV)."""
    from ninfer_kv.kernels.prefill import paged_prefill_varlen

    args = {"table_rows": torch.tensor([0]), "context_lens": torch.tensor([4])}
    args[field] = args[field] + 2**32
    with pytest.raises(InvalidArgument, match="outside the table"):
        paged_prefill_varlen(torch.randn(1, H, D), bf16, args["table_rows"],
                             torch.tensor([0, 1]), args["context_lens"])


def test_a_row_with_no_context_attends_to_nothing(bf16) -> None:  # noqa: ANN001
    """Review finding: a decode row with context 0 came back NaN (0/0); it is a zero row, as
    FlashInfer returns. paged_prefill's start below 0 is refused."""
    from ninfer_kv.kernels.attention import paged_prefill

    out = paged_decode(torch.randn(2, H, D), bf16, torch.tensor([0, 1]), torch.tensor([0, 3]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and bool(out[1].isfinite().all())
    with pytest.raises(InvalidArgument, match="must be \\[B\\] positions >= 0"):
        paged_prefill(torch.randn(1, 1, H, D), bf16, ROWS, torch.tensor([-1]))


def test_one_sequence_views_and_one_d_tables_are_refused(bf16) -> None:  # noqa: ANN001
    """Review finding: §12.1's PagedKVLayerView reached the kernels as an AttributeError (no
    block_tables), and a 1-D table passed the view check to fail inside numba's typing."""
    q, (k, v) = torch.randn(1, H, D), kv(1)
    flat = dataclasses.replace(bf16, block_tables=bf16.block_tables[0].contiguous())
    for view in (flat, bf16.row_view(0)):
        with pytest.raises(InvalidArgument):
            append_kv(view, ROWS, torch.tensor([0]), k, v)
        with pytest.raises(InvalidArgument):
            paged_decode(q, view, ROWS, torch.tensor([1]))


def test_a_token_written_twice_in_one_append_is_refused(bf16) -> None:  # noqa: ANN001
    """Review finding: the two writes ran in parallel and a row could end up with one's scale
    and the other's codes."""
    k, v = kv(2)
    with pytest.raises(InvalidArgument, match=r"entries 0 and 1 \(table rows 0 and 0, "
                                              r"positions 3 and 3\) both write column 3"):
        append_kv(bf16, torch.tensor([0, 0]), torch.tensor([3, 3]), k, v)
    append_kv(bf16, torch.tensor([0, 1]), torch.tensor([3, 3]), k, v)  # two rows, two pages


@pytest.mark.parametrize("sim", [False, True], ids=["cpu", "cuda-sim"])
def test_an_empty_decode_batch_launches_nothing(bf16, sim: bool, monkeypatch) -> None:  # noqa: ANN001
    """Review note: an empty batch launched a CUDA grid with x = 0 (the simulator accepts
    it; a device refuses an empty grid). It returns an empty output without a launch."""
    import ninfer_kv.kernels.attention as att

    def no_launch(*a: object) -> None:
        raise AssertionError("launched")

    monkeypatch.setattr(att, "launch", no_launch)
    monkeypatch.setattr(att, "_decode_cpu", no_launch)
    monkeypatch.setattr(att, "_decode_serial", no_launch)
    out = paged_decode(torch.randn(0, H, D), bf16, torch.zeros(0, dtype=torch.int32),
                       torch.zeros(0, dtype=torch.int64), force_cuda_sim=sim)
    assert out.shape == (0, H, D)


@pytest.mark.parametrize("kw,pattern", [
    ({"n_split": 0}, "n_split=0"), ({"n_split": -1}, "n_split=-1"),
    ({"n_split": 2.5}, "not an integer"), ({"n_split": "4"}, "not an integer"),
    ({"n_split": 10**12}, "n_split=1000000000000"), ({"n_split": True}, "a bool"),
    ({"sm_scale": "x"}, "not a real number"), ({"sm_scale": True}, "not a real number"),
    ({"sm_scale": float("nan")}, "not a finite"), ({"sm_scale": float("inf")}, "not a finite"),
    ({"sm_scale": 1e39}, "not a finite float32"),
    ({"sm_scale": torch.ones(2)}, "not a real number"),
])
def test_attention_options_are_checked(bf16, kw: dict, pattern: str) -> None:  # noqa: ANN001
    """Review finding: n_split and sm_scale went to torch and float() unchecked — a negative
    split count escaped as RuntimeError, 10**12 tried to allocate, a string as ValueError."""
    from ninfer_kv.kernels.attention import paged_prefill
    from ninfer_kv.kernels.prefill import paged_prefill_varlen

    q = torch.randn(1, H, D)
    with pytest.raises(InvalidArgument, match=pattern):
        paged_decode(q, bf16, ROWS, torch.tensor([5]), **kw)
    with pytest.raises(InvalidArgument, match=pattern):
        paged_prefill(q.view(1, 1, H, D), bf16, ROWS, torch.tensor([4]), **kw)
    if "sm_scale" in kw:
        with pytest.raises(InvalidArgument, match=pattern):
            paged_prefill_varlen(q, bf16, ROWS, torch.tensor([0, 1]), torch.tensor([5]), **kw)


def test_attention_options_accept_what_they_did(bf16) -> None:  # noqa: ANN001
    q = torch.randn(1, H, D)
    want = paged_decode(q, bf16, ROWS, torch.tensor([70]), sm_scale=0.125, n_split=1)
    for kw in ({"sm_scale": torch.tensor(0.125), "n_split": torch.tensor(2)},
               {"sm_scale": 0.125, "n_split": 1024}):
        assert torch.allclose(paged_decode(q, bf16, ROWS, torch.tensor([70]), **kw), want,
                              atol=1e-5)


@pytest.mark.parametrize("bad", [None, object(), "view"])
def test_a_view_that_is_no_view_is_refused(bad) -> None:  # noqa: ANN001
    """Review finding: paged_decode(q, None, ...) raised AttributeError (the view's heads were
    read before the view was checked)."""
    from ninfer_kv.kernels.prefill import paged_prefill_varlen

    k, v = kv(1)
    with pytest.raises(InvalidArgument, match="takes a batch view"):
        paged_decode(torch.randn(1, H, D), bad, ROWS, torch.tensor([5]))
    with pytest.raises(InvalidArgument, match="takes a batch view"):
        append_kv(bad, ROWS, torch.tensor([0]), k, v)
    with pytest.raises(InvalidArgument, match="takes a batch view"):
        paged_prefill_varlen(torch.randn(1, H, D), bad, ROWS, torch.tensor([0, 1]),
                             torch.tensor([5]))


@pytest.mark.parametrize(("src", "dst", "cols", "pattern"), [
    ([0, 1], [2], [3, 3], "2 source pages, 1 destinations and 2 column counts"),
    ([0, 1], [2, 2], [3, 3], "depend on each other"),        # one page written twice
    ([0, 2], [2, 3], [3, 3], "depend on each other"),        # written by one, read by another
    ([0], [1], [65], r"columns\[0\]=65 must be <= 64"),
    ([0], [99], [3], r"dst_pages\[0\] = 99 is outside \[0, 16\)"),
])
def test_batched_tail_copies_refuse_what_one_kernel_cannot_run(bf16, src, dst, cols,  # noqa: ANN001
                                                               pattern: str) -> None:
    """``copy_tails`` runs its pairs concurrently: dependent pairs are refused, not raced;
    and ids and column counts are checked as ``copy_tail`` checks them. Nothing changes."""
    planes = [bf16.k_pages, bf16.v_pages]
    for t in planes:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    before = [t.clone() for t in planes]
    with pytest.raises(InvalidArgument, match=pattern):
        copy_tails(planes, PlaneOrder.PAGE_MAJOR, src, dst, cols)
    assert all(torch.equal(t, b) for t, b in zip(planes, before, strict=True))
    copy_tails(planes, PlaneOrder.PAGE_MAJOR, [1], [1], [5])  # one pair onto itself: no race
    assert all(torch.equal(t, b) for t, b in zip(planes, before, strict=True))
