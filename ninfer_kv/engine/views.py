"""Consumer views (spec §12): non-owning, no allocator handle, identity, reservation or frontier.

A view holds one layer's plane tensors and block-table storage; per-row context lengths,
positions and ``table_rows`` are separate op inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer_kv.engine.layout import PlaneOrder, Profile

WriteCheck = Callable[[torch.Tensor, torch.Tensor], None]
"""Checked mode: ``guard(table_rows, positions)`` raises unless every write is allowed. A
validation hook only: it grants the consumer no allocator or ownership authority (§12)."""


@dataclass(frozen=True, slots=True)
class PagedKVLayerView:
    """§12.1: one layer's planes and one row of the block table (I32 [L])."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    k_scale_pages: torch.Tensor | None
    v_scale_pages: torch.Tensor | None
    block_table: torch.Tensor
    head_dim: int
    num_kv_heads: int
    storage: Profile
    order: PlaneOrder
    guard: WriteCheck | None = None


@dataclass(frozen=True, slots=True)
class PagedKVBatchLayerView:
    """§12.2: shared layer planes and the whole table matrix I32 [C, L]; ``table_rows[B]`` is a
    separate op input selecting each compact batch row's table row."""

    k_pages: torch.Tensor
    v_pages: torch.Tensor
    k_scale_pages: torch.Tensor | None
    v_scale_pages: torch.Tensor | None
    block_tables: torch.Tensor
    head_dim: int
    num_kv_heads: int
    storage: Profile
    order: PlaneOrder
    guard: WriteCheck | None = None

    def row_view(self, row: int) -> PagedKVLayerView:
        return PagedKVLayerView(self.k_pages, self.v_pages, self.k_scale_pages,
                                self.v_scale_pages, self.block_tables[row], self.head_dim,
                                self.num_kv_heads, self.storage, self.order, self.guard)


@dataclass(frozen=True, slots=True)
class CyclicKVCacheLayerView:
    """DFlash/DFlash2 local sliding-window K/V (spec §11): fixed per-sequence storage with
    modulo/window semantics; no page ids, block table or growing reservation.

    ``k``/``v``: ``[B, H, W, D]`` BF16-as-uint16 (or float) tensors; token ``p`` lives at slot
    ``p % W`` and is valid iff ``p >= frontier - W``."""

    k: torch.Tensor
    v: torch.Tensor
    window: int
    head_dim: int
    num_kv_heads: int

    def slot(self, position: int) -> int:
        return position % self.window

    def valid_range(self, frontier: int) -> range:
        return range(max(0, frontier - self.window), frontier)

    @classmethod
    def allocate(cls, batch: int, num_kv_heads: int, window: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu") -> CyclicKVCacheLayerView:
        shape = (batch, num_kv_heads, window, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), window, head_dim, num_kv_heads)
