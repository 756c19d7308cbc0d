"""The data plane: plane tensors and block-table tensors of every pool, and the device effects
run at a boundary (copies first, then table-slice writes — DESIGN.md, spec §13).

Every tensor is allocated once at open; base addresses never change for the store's lifetime
(CUDA-graph safe, spec §13): effects change contents, never storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ninfer_kv.engine.layout import PoolGeometry
from ninfer_kv.engine.round_kernels import publish_rows

if TYPE_CHECKING:
    from ninfer_kv.engine.pool import PoolState

UNMAPPED = -1
"""Block-table entries beyond a row's membership hold -1, so a stray read faults loudly."""


@dataclass(slots=True)
class PoolDevice:
    """``host_tables`` is the host image of ``block_tables`` (the same memory when the device
    is the CPU). Invariant: every entry of row r at or beyond ``published[r]`` is UNMAPPED, so
    a write touches only the entries that change, whatever the table width L."""

    geometry: PoolGeometry
    planes: list[dict[str, torch.Tensor]]  # per layer: {"k_code": t, "k_scale": t, ...}
    block_tables: torch.Tensor             # int32 [C, L]: row r = one contiguous slice
    host_tables: np.ndarray                # int32 [C, L]
    published: np.ndarray                  # int64 [C]: entries [0, published[r]) may be mapped


class DeviceState:
    def __init__(self, pools: dict[str, PoolGeometry], rows: int, logical_pages: int,
                 device: str | torch.device = "cpu", allocate_planes: bool = True) -> None:
        self.device = torch.device(device)
        self.on_cpu = self.device.type == "cpu"  # read per boundary: ``device.type`` costs ~1 µs
        self.pools: dict[str, PoolDevice] = {}
        for name, g in pools.items():
            planes: list[dict[str, torch.Tensor]] = []
            if allocate_planes:
                for layer in range(g.layers):
                    planes.append({key: torch.zeros(g.shape(p), dtype=p.dtype, device=self.device)
                                   for key, p in g.layer_planes(layer).items()})
            host = np.full((rows, logical_pages), UNMAPPED, dtype=np.int32)
            tables = (torch.from_numpy(host) if self.on_cpu
                      else torch.from_numpy(host).to(self.device))
            self.pools[name] = PoolDevice(g, planes, tables, host, np.zeros(rows, np.int64))

    def write_table(self, pool: str, row: int, start: int, ids: Sequence[int] | np.ndarray
                    ) -> None:
        """Publish ``ids`` at entries ``[start, start + len(ids))`` of ``row`` and unmap the
        entries after them that an earlier write had mapped: one contiguous slice write into
        the fixed-address table (spec §13), as long as what changed, not as long as L."""
        pd = self.pools[pool]
        end = start + len(ids)
        hi = max(end, int(pd.published[row]))
        t = pd.host_tables[row]
        t[start:end] = ids
        t[end:hi] = UNMAPPED
        pd.published[row] = end
        if not self.on_cpu and hi > start:
            pd.block_tables[row, start:hi].copy_(torch.from_numpy(t[start:hi]),
                                                 non_blocking=True)

    def write_rows(self, p: PoolState, bundles: np.ndarray, starts: np.ndarray) -> None:
        """``write_table`` for a batch: the row of each active sequence ``bundles[j]`` of pool
        ``p`` from block ``starts[j]`` on, in one compiled pass over the host image
        (``round_kernels.publish_rows``); a device table gets each changed slice copied."""
        pd = self.pools[p.name]
        bad, done = publish_rows(bundles, starts, p.bundle_index, p.sp_active, p.sp_row,
                                 p.sp_members, p.sp_nmem, p.pg_device, pd.host_tables,
                                 pd.published, p.pg_live)
        if not self.on_cpu:
            for r, start, hi in done.tolist():
                if hi > start:
                    pd.block_tables[r, start:hi].copy_(
                        torch.from_numpy(pd.host_tables[r, start:hi]), non_blocking=True)
        if bad >= 0:
            k = p.spaces[int(bundles[bad])].i
            row, nmem = int(p.sp_row[k]), int(p.sp_nmem[k])
            if not 0 <= row < len(pd.host_tables):
                raise AssertionError(f"pool {p.name}: seq {int(bundles[bad])} holds execution "
                                     f"row {row}, outside the {len(pd.host_tables)} rows of "
                                     "its table (§7.2)")
            raise AssertionError(f"pool {p.name}: seq {int(bundles[bad])}'s membership of "
                                 f"{nmem} pages is longer than its table row, or names a "
                                 "slot that is no live page (§14): publishing it would map "
                                 "another page")

    def planes(self, pool: str) -> list[torch.Tensor]:
        """Every plane of every layer of a pool (the page group's payload)."""
        return [t for layer in self.pools[pool].planes for t in layer.values()]

    def copy_tails(self, pool: str, src_pages: Sequence[int], dst_pages: Sequence[int],
                   columns: Sequence[int]) -> None:
        """Partial-tail COW copies (spec §9.3), independent of each other: the first
        ``columns[i]`` token columns of every plane, one kernel call per plane
        (``kernels.copy.copy_tails``; engine/effects.py batches a boundary's copies)."""
        from ninfer_kv.kernels.copy import copy_tails

        copy_tails(self.planes(pool), self.pools[pool].geometry.order, src_pages, dst_pages,
                   columns)
