"""Page bytes for checkpoint transfer: between page groups and packed pages (the host tier's
layout, §5.3 "HostKVPageLayout": every plane of every layer back to back, each its H rows of
``P * X * itemsize`` bytes; no device ids, no holes), with torch/numpy copies that work for
both plane orders (§4.3) and any device, plus per-page CRC-32C and reusable chunk buffers."""

from __future__ import annotations

import numpy as np
import torch
from crc32c import crc32c

from ninfer_kv.dist.errors import TransferError
from ninfer_kv.engine.layout import P, PlaneOrder
from ninfer_kv.engine.pages import NO_PAGE, LogicalKVPage
from ninfer_kv.engine.store import KVStore


def zero_tail(page: torch.Tensor, planes: list[torch.Tensor], order: PlaneOrder,
              committed: int) -> None:
    """Bytes past the committed columns are not part of the checkpoint: zero them (as the
    host tier does, engine/host.py ``zero_uncommitted``), so CRCs cover only content."""
    off = 0
    for t in planes:
        h = t.shape[1] if order is PlaneOrder.PAGE_MAJOR else t.shape[0]
        rows, xb = t.shape[2], t.shape[3] * t.element_size()
        page[off:off + h * rows * xb].view(h, rows, xb)[:, committed:, :] = 0
        off += h * rows * xb


def page_views(t: torch.Tensor, order: PlaneOrder) -> torch.Tensor:
    """A plane as bytes ``[N_physical, H, P * X * itemsize]``: row g is page group g's slice
    of every head (§4.3; strided for head-major planes, whose heads are outermost)."""
    u = t.view(torch.uint8)
    if order is PlaneOrder.PAGE_MAJOR:
        return u.view(t.shape[0], t.shape[1], -1)
    return u.view(t.shape[0], t.shape[1], -1).transpose(0, 1)


def runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first index, end index, first id) of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for i, g in enumerate(ids):
        if out and g == out[-1][2] + (i - out[-1][0]):
            out[-1] = (out[-1][0], i + 1, out[-1][2])
        else:
            out.append((i, i + 1, g))
    return out


def copy_pages(planes: list[torch.Tensor], order: PlaneOrder, ids: list[int],
               buf: torch.Tensor, *, into_planes: bool) -> None:
    """Between page groups ``ids`` and packed pages ``buf[len(ids), page_bytes]`` (the host
    tier's layout, §5.3: every plane back to back, each its H rows): one strided copy per
    plane and run of consecutive ids, or one gather/scatter per plane when ids are
    scattered. Device-agnostic (torch copies: CPU, CUDA, or across the two)."""
    rr = runs(ids)
    idx = torch.tensor(ids, dtype=torch.int64, device=planes[0].device) if len(rr) > 4 else None
    host = planes[0].device.type == "cpu" and buf.device.type == "cpu"
    off = 0
    for t in planes:
        pv = page_views(t, order)
        n = pv.shape[1] * pv.shape[2]
        packed = buf[:, off:off + n].view(len(ids), pv.shape[1], pv.shape[2])
        off += n
        if host and idx is None:  # numpy's strided copy: several times torch's on the CPU
            pn, bn = pv.numpy(), packed.numpy()
            for i, j, g in rr:
                if into_planes:
                    np.copyto(pn[g:g + j - i], bn[i:j])
                else:
                    np.copyto(bn[i:j], pn[g:g + j - i])
            continue
        if idx is not None:
            if into_planes:
                pv.index_copy_(0, idx, packed.to(pv.device))
            else:
                packed.copy_(pv.index_select(0, idx))
            continue
        for i, j, g in rr:
            if into_planes:
                pv[g:g + j - i].copy_(packed[i:j])
            else:
                packed[i:j].copy_(pv[g:g + j - i])
    if off != buf.shape[1]:
        raise TransferError(f"packed page of {buf.shape[1]} B != the planes' {off} B")


def pack(store: KVStore, pool: str, pages: list[LogicalKVPage], buf: torch.Tensor) -> None:
    """Packed bytes of ``pages`` (logical order) into ``buf[len(pages), page_bytes]``: device
    replicas with ``copy_pages``, host-only pages from the arena (the same layout)."""
    planes = store.device.planes(pool)
    order = store.device.pools[pool].geometry.order
    pb = buf.shape[1]
    i = 0
    while i < len(pages):
        j = i
        while j < len(pages) and pages[j].device != NO_PAGE:
            j += 1
        if j > i:
            copy_pages(planes, order, [pg.device for pg in pages[i:j]], buf[i:j],
                       into_planes=False)
            i = j
        else:
            assert store.arena is not None and pages[i].host is not None
            buf[i].copy_(store.arena.pages(pages[i].host[0], 1, pb)[0])  # type: ignore[index]
            i += 1
    for k, pg in enumerate(pages):
        if pg.committed < P:
            zero_tail(buf[k], planes, order, pg.committed)


_STAGING: dict[tuple[str, int], torch.Tensor] = {}


def staging(device: torch.device, slot: int, size: int) -> torch.Tensor:
    """A reusable chunk buffer (two per device, grown on demand): a fresh one per transfer
    would pay a page fault per 4 KiB on first touch, about as long as the copy itself."""
    key = (str(device), slot)
    t = _STAGING.get(key)
    if t is None or t.numel() < size:
        t = _STAGING[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return t[:size]


def crcs(buf: torch.Tensor) -> list[int]:
    data = buf.cpu().numpy() if buf.device.type != "cpu" else buf.numpy()
    return [crc32c(data[i]) for i in range(data.shape[0])]


