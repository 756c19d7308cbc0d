"""Page bytes for checkpoint transfer, plane by plane.

On the wire a chunk of ``k`` pages is, for each plane of the pool (every layer's K and V codes
and scales, in the host tier's order, §5.3 "HostKVPageLayout"), one ``[k, H, P * X * itemsize]``
byte tensor: plane ``p``'s slice of each page, pages in logical order. Concatenating a page's
slices over the planes gives exactly its packed host-tier bytes (``kernels.copy.pack_pages``),
and its CRC-32C is chained over the same slices in the same order, so it equals the CRC of the
packed page.

Zero copies where the layout allows: when a chunk's pages are consecutive device page groups of
a page-major pool, each plane's slice *is* a contiguous view of the plane — sent from it, or
received straight into it. Otherwise (scattered ids, head-major planes, host-only pages) the
slices are gathered into / scattered from reusable staging buffers.
"""

from __future__ import annotations

import torch
from crc32c import crc32c

from ninfer_kv.dist.errors import TransferCorrupt
from ninfer_kv.engine.layout import PlaneOrder
from ninfer_kv.engine.pages import NO_PAGE, LogicalKVPage
from ninfer_kv.engine.store import KVStore


def page_views(t: torch.Tensor, order: PlaneOrder) -> torch.Tensor:
    """A plane as bytes ``[N_physical, H, P * X * itemsize]``: row g is page group g's slice
    of every head (§4.3; strided for head-major planes, whose heads are outermost)."""
    u = t.view(torch.uint8)
    if order is PlaneOrder.PAGE_MAJOR:
        return u.view(t.shape[0], t.shape[1], -1)
    return u.view(t.shape[0], t.shape[1], -1).transpose(0, 1)


def plane_views(store: KVStore, pool: str) -> list[torch.Tensor]:
    order = store.device.pools[pool].geometry.order
    return [page_views(t, order) for t in store.device.planes(pool)]


def consecutive(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:], strict=False))


_STAGING: dict[tuple[str, int, int], torch.Tensor] = {}


def staging(device: torch.device, slot: int, plane: int, size: int) -> torch.Tensor:
    """A reusable byte buffer (grown on demand): a fresh one per chunk would pay a page fault
    per 4 KiB on first touch, about as long as the copy itself."""
    key = (str(device), slot, plane)
    t = _STAGING.get(key)
    if t is None or t.numel() < size:
        t = _STAGING[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return t[:size]


def retire_staging() -> None:
    """Forget the staging buffers (the process's, which ``export`` shares: transfers run one
    at a time): receives that may still write into them (an aborted transfer's) keep them
    alive, and the next chunk gets fresh ones."""
    _STAGING.clear()


def _stage(views: list[torch.Tensor], k: int, slot: int, device: torch.device
           ) -> list[torch.Tensor]:
    out = []
    for p, pv in enumerate(views):
        n = pv.shape[1] * pv.shape[2]
        out.append(staging(device, slot, p, k * n).view(k, pv.shape[1], pv.shape[2]))
    return out


def stage(store: KVStore, pool: str, k: int, slot: int, device: torch.device
          ) -> list[torch.Tensor]:
    """Staging ``slot`` shaped for a chunk of ``k`` pages of ``pool`` (one tensor per plane)."""
    return _stage(plane_views(store, pool), k, slot, device)


def in_place_views(store: KVStore, pool: str, ids: list[int], device: torch.device
             ) -> list[torch.Tensor] | None:
    """Per plane, the slices of page groups ``ids`` as views of the planes — when the ids are
    consecutive and the slices contiguous on ``device`` (page-major planes) — else None."""
    if not ids or NO_PAGE in ids or not consecutive(ids):
        return None
    views = [pv[ids[0]:ids[0] + len(ids)] for pv in plane_views(store, pool)]
    ok = views and all(v.is_contiguous() and v.device == device for v in views)
    return views if ok else None


def direct(store: KVStore, pool: str, pages: list[LogicalKVPage], device: torch.device
           ) -> list[torch.Tensor] | None:
    """``pages``' slices as views of the planes (``in_place_views``), or None: ``gather`` copies."""
    return in_place_views(store, pool, [pg.device for pg in pages], device)


def gather(store: KVStore, pool: str, pages: list[LogicalKVPage], slot: int,
           device: torch.device) -> list[torch.Tensor]:
    """Per plane, ``pages``' slices as one contiguous ``[k, H, row bytes]`` tensor on
    ``device``: views of the planes when possible, else copies into staging ``slot``."""
    views = direct(store, pool, pages, device)
    if views is not None:
        return views
    views = plane_views(store, pool)
    ids = [pg.device for pg in pages]
    out = _stage(views, len(pages), slot, device)
    dev = [i for i, g in enumerate(ids) if g != NO_PAGE]
    if dev:
        src = torch.tensor([ids[i] for i in dev], device=views[0].device)
        dst = torch.tensor(dev, device=device)
        for o, pv in zip(out, views, strict=True):
            o.index_copy_(0, dst, pv.index_select(0, src).to(device))
    pb = sum(pv.shape[1] * pv.shape[2] for pv in views)
    for i, pg in enumerate(pages):
        if pg.device == NO_PAGE:      # host-only: its packed page from the arena, split
            assert store.arena is not None and pg.host is not None
            packed = store.arena.pages(pg.host[0], 1, pb)[0]
            got = crc32c(packed.numpy())  # the sender's CRCs are of what it sends: check the
            if got != pg.host[3]:         # replica against its published one first (§5.3)
                raise TransferCorrupt(f"export: pool {pool} page {pool}:{pg.slot}: its host "
                                      f"replica at {pg.host[0]} has CRC-32C {got:#010x}, "
                                      f"published {pg.host[3]:#010x} (damaged in the arena)")
            off = 0
            for o in out:
                n = o.shape[1] * o.shape[2]
                o[i].view(-1).copy_(packed[off:off + n])
                off += n
    return out


def targets(store: KVStore, pool: str, ids: list[int], slot: int, device: torch.device
            ) -> tuple[list[torch.Tensor], bool]:
    """Where a chunk for page groups ``ids`` is received: the planes themselves (True) when
    the ids are consecutive and the slices contiguous on ``device``, else staging (False;
    ``scatter`` then writes it)."""
    views = in_place_views(store, pool, ids, device)
    if views is not None:
        return views, True
    return _stage(plane_views(store, pool), len(ids), slot, device), False


def scatter(store: KVStore, pool: str, ids: list[int], chunk: list[torch.Tensor]) -> None:
    views = plane_views(store, pool)
    idx = torch.tensor(ids, device=views[0].device)
    for c, pv in zip(chunk, views, strict=True):
        pv.index_copy_(0, idx, c.to(pv.device))


def crcs(chunk: list[torch.Tensor]) -> list[int]:
    """Per page, CRC-32C of its slices chained over the planes (= CRC of the packed page)."""
    host = [c.cpu().reshape(c.shape[0], -1).numpy() for c in chunk]
    out = []
    for i in range(chunk[0].shape[0] if chunk else 0):
        c = 0
        for h in host:
            c = crc32c(h[i], c)
        out.append(c)
    return out
