"""The data plane: plane tensors and block-table tensors of every pool, and the device effects
run at a boundary (copies first, then table-slice writes — DESIGN.md, spec §13).

Every tensor is allocated once at open; base addresses never change for the store's lifetime
(CUDA-graph safe, spec §13): effects change contents, never storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer_kv.engine.layout import PoolGeometry

UNMAPPED = -1
"""Block-table entries beyond a row's membership hold -1, so a stray read faults loudly."""


@dataclass(slots=True)
class PoolDevice:
    geometry: PoolGeometry
    planes: list[dict[str, torch.Tensor]]  # per layer: {"k_code": t, "k_scale": t, ...}
    block_tables: torch.Tensor             # int32 [C, L]: row r = one contiguous slice


class DeviceState:
    def __init__(self, pools: dict[str, PoolGeometry], rows: int, logical_pages: int,
                 device: str | torch.device = "cpu", allocate_planes: bool = True) -> None:
        self.device = torch.device(device)
        self.pools: dict[str, PoolDevice] = {}
        for name, g in pools.items():
            planes: list[dict[str, torch.Tensor]] = []
            if allocate_planes:
                for layer in range(g.layers):
                    planes.append({key: torch.zeros(g.shape(p), dtype=p.dtype, device=self.device)
                                   for key, p in g.layer_planes(layer).items()})
            tables = torch.full((rows, logical_pages), UNMAPPED, dtype=torch.int32,
                                device=self.device)
            self.pools[name] = PoolDevice(g, planes, tables)

    def write_table(self, pool: str, row: int, start: int, ids: list[int]) -> None:
        """One contiguous slice write into the fixed-address table (spec §13)."""
        if ids:
            src = torch.tensor(ids, dtype=torch.int32)
            self.pools[pool].block_tables[row, start:start + len(ids)].copy_(src, non_blocking=True)

    def planes(self, pool: str) -> list[torch.Tensor]:
        """Every plane of every layer of a pool (the page group's payload)."""
        return [t for layer in self.pools[pool].planes for t in layer.values()]

    def copy_columns(self, pool: str, src_page: int, dst_page: int, columns: int) -> None:
        """Partial-tail COW: the first ``columns`` token columns of every plane (spec §9.3)."""
        from ninfer_kv.kernels.copy import copy_tail

        copy_tail(self.planes(pool), self.pools[pool].geometry.order, src_page, dst_page,
                  columns)
