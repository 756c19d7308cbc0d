"""Page copies (spec §5.3, §9.3): page-group copy of runs (every plane of a pool), the partial
tail COW copy (first n columns of every plane), and packing/unpacking between device pages and
the host layout (logical order, packed: a host page is every plane's page slice, back to back).

Every plane is seen as a 4-D strided byte/word view ``[outer, page, mid, row]``:

* page-major ``[N, H, P, X]`` -> ``[1, N, H, P*X*isz]``
* head-major ``[H, N, P, X]`` -> ``[H, N, 1, P*X*isz]``

and one kernel copies ``view[o, src[i], m, :w] -> view'[o, dst[i], m, :w]``. Whole pages move
in int64 words (a page row is always a multiple of 64 bytes), COW tails in bytes. On CUDA,
host packing goes through a device staging tensor and torch's async copy (kernels never
touch pageable host memory).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numba
import torch
from numba import cuda

from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.layout import P, PlaneOrder
from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels import jit
from ninfer_kv.kernels.backend import dev_view, launch, use_cuda_kernels


def plane_view(t: torch.Tensor, order: PlaneOrder, unit: torch.dtype) -> torch.Tensor:
    if not t.is_contiguous():  # reshape would copy it: the kernel would write the copy
        raise InvalidArgument(f"page copy: a plane {tuple(t.shape)} with strides {t.stride()}"
                              " is not contiguous (§12.4: closed strides)")
    b = t.view(torch.uint8)
    if order is PlaneOrder.PAGE_MAJOR:
        n, h, p, xb = b.shape
        v = b.reshape(1, n, h, p * xb)
    else:
        h, n, p, xb = b.shape
        v = b.reshape(h, n, 1, p * xb)
    return v.view(unit)


def row_bytes(t: torch.Tensor) -> int:
    return t.shape[2] * t.shape[3] * t.element_size()


@jit.njit(inline="always")
def _copy_row(src, dst, src_ids, dst_ids, words, item):  # noqa: ANN001
    """Row ``item`` of the copy: pair ``i``, outer ``o``, mid ``m``."""
    outer, mid = src.shape[0], src.shape[2]
    i = item // (outer * mid)
    r = item % (outer * mid)
    o = r // mid
    m = r % mid
    s, d = src_ids[i], dst_ids[i]
    for w in range(words[i]):
        dst[o, d, m, w] = src[o, s, m, w]


@jit.njit(parallel=True)
def _copy_cpu(src, dst, src_ids, dst_ids, words):  # noqa: ANN001
    """``dst[o, dst_ids[i], m, :words[i]] = src[o, src_ids[i], m, :words[i]]``."""
    for item in numba.prange(src_ids.shape[0] * src.shape[0] * src.shape[2]):
        _copy_row(src, dst, src_ids, dst_ids, words, item)


@jit.njit(error_model="numpy")
def _copy_serial(src, dst, src_ids, dst_ids, words):  # noqa: ANN001
    """``_copy_cpu`` on the calling thread (``jit.SERIAL_BELOW``)."""
    for item in range(src_ids.shape[0] * src.shape[0] * src.shape[2]):
        _copy_row(src, dst, src_ids, dst_ids, words, item)


@functools.cache
def _copy_cuda() -> Any:
    """One block per (pair, outer, mid) row (grid-strided over rows); its threads stride over
    the row's words, so loads and stores are coalesced and there is no per-word division."""

    @cuda.jit
    def kernel(src, dst, src_ids, dst_ids, words):  # noqa: ANN001
        n = src_ids.shape[0]
        outer, mid = src.shape[0], src.shape[2]
        n_rows = n * outer * mid
        for r in range(cuda.blockIdx.x, n_rows, cuda.gridDim.x):
            i = r // (outer * mid)
            rem = r % (outer * mid)
            o = rem // mid
            m = rem % mid
            s, d = src_ids[i], dst_ids[i]
            for w in range(cuda.threadIdx.x, words[i], cuda.blockDim.x):
                dst[o, d, m, w] = src[o, s, m, w]

    return kernel


@functools.cache
def _copy2d_cuda() -> Any:
    """Page-major fast path: each page's slice is one contiguous row ``[page, words]``; one
    block per page pair, threads stride over the row."""

    @cuda.jit
    def kernel(src, dst, src_ids, dst_ids, words):  # noqa: ANN001
        for i in range(cuda.blockIdx.x, src_ids.shape[0], cuda.gridDim.x):
            s, d = src_ids[i], dst_ids[i]
            for w in range(cuda.threadIdx.x, words, cuda.blockDim.x):
                dst[d, w] = src[s, w]

    return kernel


def _as_rows(t: torch.Tensor) -> torch.Tensor | None:
    """A ``[1, N, H, W]`` view whose (H, W) block is dense per page, as ``[N, H*W]``."""
    if t.shape[0] != 1 or t.stride(3) != 1 or t.stride(2) != t.shape[3]:
        return None
    return t.as_strided((t.shape[1], t.shape[2] * t.shape[3]), (t.stride(1), 1),
                        t.storage_offset())


def _copy(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
          words: int | torch.Tensor, force_cuda_sim: bool = False) -> None:
    """``view[o, src_ids[i], m, :w] -> view'[o, dst_ids[i], m, :w]`` for every pair, ``w`` one
    count for all pairs, or ``words[i]`` (an int64 tensor on the ids' device: COW tails, each
    with its own column count)."""
    n = src_ids.numel()
    if n == 0 or (isinstance(words, int) and words <= 0):
        return
    on_cuda = use_cuda_kernels(src, dst, force_sim=force_cuda_sim)
    block = 256
    if isinstance(words, int):
        rs, rd = _as_rows(src), _as_rows(dst)
        if on_cuda and words == src.shape[3] and rs is not None and rd is not None:
            launch(_copy2d_cuda(), (max(1, min(65535, n)),), 256, dev_view(rs), dev_view(rd),
                   dev_view(src_ids), dev_view(dst_ids), rs.shape[1])
            return
        block = 256 if words >= 256 else 64
        words = torch.full((n,), words, dtype=torch.int64, device=src_ids.device)
    args = (dev_view(src), dev_view(dst), dev_view(src_ids), dev_view(dst_ids), dev_view(words))
    if on_cuda:
        n_rows = n * src.shape[0] * src.shape[2]
        launch(_copy_cuda(), (max(1, min(65535, n_rows)),), block, *args)
    elif jit.parallel(n * src.shape[0] * src.shape[2] * src.shape[3]):  # words at most
        _copy_cpu(*args)
    else:
        _copy_serial(*args)


def _n_pages(planes: Sequence[torch.Tensor], order: Any, who: str) -> int:
    """The page-group count every plane of a pool shares (the copies write every plane)."""
    if not isinstance(order, PlaneOrder):
        raise InvalidArgument(f"{who}: order must be a PlaneOrder, got {order!r}")
    counts = {t.shape[0 if order is PlaneOrder.PAGE_MAJOR else 1] for t in planes}
    if len(counts) != 1:
        raise InvalidArgument(f"{who}: the planes hold {sorted(counts)} page groups; a page "
                              "group spans every plane of a pool (§4.2)")
    return counts.pop()


def _ids(ids: Sequence[int] | torch.Tensor, n: int, name: str, who: str,
         device: torch.device) -> torch.Tensor:
    """``ids`` as the kernels' int32 on ``device``: integers in [0, n) — numba does not
    bounds-check, so a page past the pool is another allocation's memory and -1 the last
    page — else ``InvalidArgument`` naming the first (on the host; a CUDA tensor of ids is
    the caller's, unchecked, as the kernels' other device inputs)."""
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise InvalidArgument(f"{who}: {name} must be integer ids: {exc}") from None
    if t.numel() == 0:
        t = t.to(torch.int64).reshape(0)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() != 1:
        raise InvalidArgument(f"{who}: {name} must be integer ids, got {t.dtype} "
                              f"{tuple(t.shape)}")
    if not t.is_cuda:
        bad = (t < 0) | (t >= n)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InvalidArgument(f"{who}: {name}[{i}] = {int(t[i])} is outside [0, {n})")
    return t.to(torch.int32).to(device)


def copy_pages(planes: Sequence[torch.Tensor], order: PlaneOrder, src: Sequence[int],
               dst: Sequence[int], *, force_cuda_sim: bool = False) -> None:
    """Whole page groups src[i] -> dst[i] in every plane of a pool."""
    if not planes:
        return
    n, dev = _n_pages(planes, order, "copy_pages"), planes[0].device
    s, d = _ids(src, n, "src", "copy_pages", dev), _ids(dst, n, "dst", "copy_pages", dev)
    if s.shape != d.shape:
        raise InvalidArgument(f"copy_pages: {len(s)} source and {len(d)} destination pages")
    for t in planes:
        v = plane_view(t, order, torch.int64)
        _copy(v, v, s, d, v.shape[3], force_cuda_sim)


def copy_tail(planes: Sequence[torch.Tensor], order: PlaneOrder, src_page: int, dst_page: int,
              columns: int, *, force_cuda_sim: bool = False) -> None:
    """Partial-tail COW: the first ``columns`` token columns of every plane (spec §9.3)."""
    copy_tails(planes, order, [as_int("copy_tail: src_page", src_page)],
               [as_int("copy_tail: dst_page", dst_page)],
               [as_int("copy_tail: columns", columns, lo=0, hi=P)],
               force_cuda_sim=force_cuda_sim)


def copy_tails(planes: Sequence[torch.Tensor], order: PlaneOrder, src_pages: Sequence[int],
               dst_pages: Sequence[int], columns: Sequence[int], *,
               force_cuda_sim: bool = False) -> None:
    """A batch of partial-tail COW copies (spec §9.3): the first ``columns[i]`` token columns
    of page group ``src_pages[i]`` into ``dst_pages[i]``, in every plane — one kernel call per
    plane for the whole batch (a boundary of k Forks at mid-page frontiers made k calls per
    plane before: 64 planes of a 32-layer model, k x 64 launches).

    The kernel runs the pairs concurrently, so they must not depend on each other: no page
    is written twice, nor written by one pair and read by another (``InvalidArgument``
    otherwise; ``engine/effects.py`` splits a boundary's copies where they depend)."""
    who = "copy_tails"
    if not len(src_pages) == len(dst_pages) == len(columns):
        raise InvalidArgument(f"{who}: {len(src_pages)} source pages, {len(dst_pages)} "
                              f"destinations and {len(columns)} column counts")
    cols = [as_int(f"{who}: columns[{i}]", c, lo=0, hi=P) for i, c in enumerate(columns)]
    src = [as_int(f"{who}: src_pages[{i}]", x) for i, x in enumerate(src_pages)]
    dst = [as_int(f"{who}: dst_pages[{i}]", x) for i, x in enumerate(dst_pages)]
    readers: dict[int, list[int]] = {}
    for i, x in enumerate(src):
        readers.setdefault(x, []).append(i)
    if len(set(dst)) != len(dst) or any(j != i for i, x in enumerate(dst)
                                        for j in readers.get(x, ())):
        raise InvalidArgument(f"{who}: pairs {list(zip(src, dst, strict=True))[:8]} depend on "
                              "each other (a page written twice, or written and read): one "
                              "kernel runs them concurrently")
    keep = [i for i, c in enumerate(cols) if c]
    if not planes or not keep:
        return
    n, dev = _n_pages(planes, order, who), planes[0].device
    s = _ids([src[i] for i in keep], n, "src_pages", who, dev)
    d = _ids([dst[i] for i in keep], n, "dst_pages", who, dev)
    counts = torch.tensor([cols[i] for i in keep], dtype=torch.int64)
    nbytes: dict[int, torch.Tensor] = {}  # bytes of one token column -> per-pair byte counts
    for t in planes:
        width = t.shape[3] * t.element_size()
        if width not in nbytes:
            nbytes[width] = (counts * width).to(dev)
        v = plane_view(t, order, torch.uint8)
        _copy(v, v, s, d, nbytes[width], force_cuda_sim)


def _heads(t: torch.Tensor, order: PlaneOrder) -> int:
    return t.shape[1] if order is PlaneOrder.PAGE_MAJOR else t.shape[0]


def host_page_bytes(planes: Sequence[torch.Tensor], order: PlaneOrder) -> int:
    """Bytes of one packed host page: every plane's page slice (H rows), back to back."""
    return sum(_heads(t, order) * row_bytes(t) for t in planes)


def _host_views(planes: Sequence[torch.Tensor], order: PlaneOrder,
                host: torch.Tensor) -> list[torch.Tensor]:
    """Per-plane strided int64 views into a packed host buffer ``host[n_pages, page_bytes]``."""
    if host.dtype != torch.uint8 or host.dim() != 2 or not host.is_contiguous():
        raise InvalidArgument(f"host pages must be a contiguous uint8 [n, page bytes] tensor, "
                              f"got {host.dtype} {tuple(host.shape)}")
    n, page = host.shape
    if page != host_page_bytes(planes, order):
        raise InvalidArgument(f"host page of {page} B does not hold these planes "
                              f"({host_page_bytes(planes, order)} B)")
    words = host.view(torch.int64).view(-1)
    pw = page // 8
    out = []
    off = 0
    for t in planes:
        rw = row_bytes(t) // 8
        h = _heads(t, order)
        base = words[off:]
        if order is PlaneOrder.PAGE_MAJOR:
            out.append(base.as_strided((1, n, h, rw), (0, pw, rw, 1)))
        else:
            out.append(base.as_strided((h, n, 1, rw), (rw, pw, 0, 1)))
        off += h * rw
    return out


def pack_pages(planes: Sequence[torch.Tensor], order: PlaneOrder, page_ids: Sequence[int],
               host: torch.Tensor, *, force_cuda_sim: bool = False) -> None:
    """Device pages ``page_ids`` (logical order) -> packed host pages ``host[i]`` (D2H)."""
    if not planes:
        return
    dev = planes[0].device
    s = _ids(page_ids, _n_pages(planes, order, "pack_pages"), "page_ids", "pack_pages", dev)
    if not len(s):
        return
    d = _ids(range(len(s)), host.shape[0], "host pages", "pack_pages", dev)
    stage = host if not use_cuda_kernels(planes[0]) or host.device == dev else \
        torch.empty(host.shape, dtype=torch.uint8, device=dev)
    for t, hv in zip(planes, _host_views(planes, order, stage), strict=True):
        _copy(plane_view(t, order, torch.int64), hv, s, d, row_bytes(t) // 8, force_cuda_sim)
    if stage is not host:
        host.copy_(stage, non_blocking=host.is_pinned())


def unpack_pages(planes: Sequence[torch.Tensor], order: PlaneOrder, host: torch.Tensor,
                 page_ids: Sequence[int], *, force_cuda_sim: bool = False) -> None:
    """Packed host pages ``host[i]`` -> device pages ``page_ids[i]`` (H2D)."""
    if not planes:
        return
    dev = planes[0].device
    d = _ids(page_ids, _n_pages(planes, order, "unpack_pages"), "page_ids", "unpack_pages",
             dev)
    if not len(d):
        return
    s = _ids(range(len(d)), host.shape[0], "host pages", "unpack_pages", dev)
    stage = host if host.device == dev else host.to(dev, non_blocking=True)
    for t, hv in zip(planes, _host_views(planes, order, stage), strict=True):
        _copy(hv, plane_view(t, order, torch.int64), s, d, row_bytes(t) // 8, force_cuda_sim)
