"""The content side of the state machine's shadow model: a deterministic payload per written
token, written through the published block tables the way a GPU unit would, and read back
from device pages or packed host pages to compare with what the model says was committed.

A token written by write round ``tag`` at position ``pos`` holds, in every byte ``x`` of
plane ``k`` and head ``h``: ``(tag * 131 + pos * 31 + k * 7 + h * 13 + x * 3) & 0xFF``. A
different tag or position gives different bytes, so a page mapped to the wrong request, a
lost COW copy or a stale restore shows up as a mismatch.
"""

from __future__ import annotations

import torch

from ninfer_kv.engine.layout import P, PlaneOrder
from ninfer_kv.engine.store import KVStore


def pattern(tags: torch.Tensor, pos: torch.Tensor, plane: int, heads: int, xb: int
            ) -> torch.Tensor:
    """uint8 [H, n, xb] payload of tokens (tags[i], pos[i]) in plane ``plane``."""
    h = torch.arange(heads).view(-1, 1, 1)
    x = torch.arange(xb).view(1, 1, -1)
    tok = (tags * 131 + pos * 31).view(1, -1, 1)
    return ((tok + plane * 7 + h * 13 + x * 3) & 0xFF).to(torch.uint8)


def _planes(store: KVStore, pool: str) -> tuple[list[torch.Tensor], PlaneOrder]:
    pd = store.device.pools[pool]
    return [t.view(torch.uint8) for t in store.device.planes(pool)], pd.geometry.order


def write(store: KVStore, seq: int, pool: str, start: int, tags: list[int]) -> None:
    """The GPU unit: the payload of positions [start, start + len(tags)) through the
    published table row (checked first by the store's write guard in checked mode)."""
    if not tags:
        return
    pd = store.device.pools[pool]
    row = store.space(seq, pool).row
    positions = torch.arange(start, start + len(tags))
    for layer in range(pd.geometry.layers):  # every layer writes (checked commit needs it)
        view = store.batch_view(pool, layer)
        if view.guard is not None:
            view.guard(torch.full((len(tags),), row, dtype=torch.int32), positions)
    planes, order = _planes(store, pool)
    tag_t = torch.tensor(tags)
    i = 0
    while i < len(tags):
        pos = start + i
        blk, col = divmod(pos, P)
        n = min(len(tags) - i, P - col)
        g = int(pd.block_tables[row, blk])
        assert g >= 0, f"seq {seq} pool {pool} block {blk} unmapped in the published table"
        for k, t in enumerate(planes):
            heads = t.shape[1] if order is PlaneOrder.PAGE_MAJOR else t.shape[0]
            data = pattern(tag_t[i:i + n], positions[i:i + n], k, heads, t.shape[3])
            if order is PlaneOrder.PAGE_MAJOR:
                t[g, :, col:col + n, :] = data
            else:
                t[:, g, col:col + n, :] = data
        i += n


def mismatches(store: KVStore, seq: int, pool: str, tags: list[int]) -> list[str]:
    """Where the committed tokens of ``seq`` in ``pool`` differ from ``tags`` (the model's
    writer tag per committed position): read from the device replica when there is one,
    else from the host replica's packed bytes."""
    st = store.state
    p = st.pools[pool]
    sp = p.spaces[seq]
    if sp.committed != len(tags):
        return [f"seq {seq} pool {pool}: committed {sp.committed}, model {len(tags)}"]
    planes, order = _planes(store, pool)
    page_bytes = next(s.page_bytes for s in st.pool_specs if s.name == pool)
    out = []
    for blk in range(-(-len(tags) // P)):
        pg = p.pages[sp.members[blk]]
        assert pg is not None
        cols = min(P, len(tags) - blk * P)
        tag_t = torch.tensor(tags[blk * P: blk * P + cols])
        pos = torch.arange(blk * P, blk * P + cols)
        if pg.device != -1:
            got = [(t[pg.device] if order is PlaneOrder.PAGE_MAJOR else t[:, pg.device])[:, :cols]
                   for t in planes]
        elif pg.host is not None and store.arena is not None:
            raw = store.arena.data[pg.host[0]:pg.host[0] + page_bytes]
            got, off = [], 0
            for t in planes:
                heads = t.shape[1] if order is PlaneOrder.PAGE_MAJOR else t.shape[0]
                n = heads * P * t.shape[3]
                got.append(raw[off:off + n].view(heads, P, t.shape[3])[:, :cols])
                off += n
        else:
            out.append(f"seq {seq} pool {pool} block {blk}: no replica holds it")
            continue
        for k, (g, t) in enumerate(zip(got, planes, strict=True)):
            heads = t.shape[1] if order is PlaneOrder.PAGE_MAJOR else t.shape[0]
            if not torch.equal(g, pattern(tag_t, pos, k, heads, t.shape[3])):
                where = "device" if pg.device != -1 else "host"
                out.append(f"seq {seq} pool {pool} block {blk} plane {k} ({where} page "
                           f"{pool}:{pg.slot}): bytes differ from the model")
                break
    return out
