"""Consumer views (spec §12): non-owning, no allocator handle, identity, reservation or frontier.

A view holds one layer's plane tensors and block-table storage; per-row context lengths,
positions and ``table_rows`` are separate op inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer_kv.engine.args import as_int
from ninfer_kv.engine.layout import Codec, P, PlaneOrder, Profile
from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels.checks import check_devices, check_index, check_view

WriteCheck = Callable[[torch.Tensor, torch.Tensor], None]
"""Checked mode: ``guard(table_rows, positions)`` raises unless every write is allowed (and
records them as written; the store's guard also has ``check``, which returns the recording
for a kernel wrapper to run after its kernel). A validation hook only: it grants the consumer
no allocator or ownership authority (§12)."""


CODE_DTYPE = {Codec.BF16: torch.bfloat16, Codec.INT8_G64: torch.int8,
              Codec.FP8_ROW: torch.float8_e4m3fn, Codec.NVFP4_G16: torch.float4_e2m1fn_x2}
"""torch's name for each codec's stored element (NVFP4: two E2M1 codes per byte)."""
SCALE_DTYPE = {Codec.INT8_G64: torch.bfloat16, Codec.FP8_ROW: torch.bfloat16,
               Codec.NVFP4_G16: torch.float8_e4m3fn}


@dataclass(frozen=True, slots=True)
class TypedPlanes:
    """One layer's planes reinterpreted (no copy) in torch dtypes: ``k``/``v`` codes
    (bfloat16, int8, float8_e4m3fn or float4_e2m1fn_x2) and their scales (None for BF16).
    Layout as stored: page-major ``[G, H, 64, X]`` or head-major ``[H, G, 64, X]``."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


def typed_planes(view: PagedKVLayerView | PagedKVBatchLayerView) -> TypedPlanes:
    """The view's integer storage planes as the dtypes torch (and FlashInfer) name them;
    the view is checked as the kernels check it (``check_view``), so planes its profile does
    not store are refused, not reinterpreted."""
    if isinstance(view, PagedKVLayerView):  # one row: checked as a batch of that row
        table = view.block_table
        check_view(PagedKVBatchLayerView(
            view.k_pages, view.v_pages, view.k_scale_pages, view.v_scale_pages,
            table.unsqueeze(0) if isinstance(table, torch.Tensor) else table, view.head_dim,
            view.num_kv_heads, view.storage, view.order), "typed_planes")
    else:
        check_view(view, "typed_planes")
    kc, vc = view.storage.codecs

    def scale(t: torch.Tensor | None, codec: Codec) -> torch.Tensor | None:
        return None if t is None else t.view(SCALE_DTYPE[codec])

    return TypedPlanes(view.k_pages.view(CODE_DTYPE[kc]), view.v_pages.view(CODE_DTYPE[vc]),
                       scale(view.k_scale_pages, kc), scale(view.v_scale_pages, vc))


def slot_mapping(view: PagedKVBatchLayerView, table_rows: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """vLLM's ``slot_mapping`` for tokens given as (``table_rows[T]``, ``positions[T]``):
    ``page_group * 64 + position % 64`` (int64), -1 where the position's page is unmapped.
    Slot ``s`` is column ``s % 64`` of page group ``s // 64`` in the planes. A table entry
    naming no page group of the planes (damage: the store publishes none) is refused, as
    ``append_kv`` refuses it: a writer given its slot would write past the pool."""
    check_view(view, "slot_mapping")
    table_rows = check_index(table_rows, "table_rows", "slot_mapping")  # a float: refused,
    positions = check_index(positions, "positions", "slot_mapping")  # never truncated
    check_devices(view, "slot_mapping", table_rows=table_rows, positions=positions)
    pos, rows = positions.to(torch.int64), table_rows.to(torch.int64)
    c, logical = view.block_tables.shape
    if pos.shape != rows.shape or bool((pos < 0).any() | (pos >= logical * P).any()) or \
            bool((rows < 0).any() | (rows >= c).any()):
        raise InvalidArgument(f"slot_mapping: table_rows {rows.tolist()[:8]} must be in [0, {c}) "
                              f"and positions {pos.tolist()[:8]} in [0, {logical * P}), same "
                              "shape")
    groups = view.block_tables[rows, pos // P].to(torch.int64)
    n_pages = view.k_pages.shape[0 if view.order is PlaneOrder.PAGE_MAJOR else 1]
    past = groups >= n_pages
    if bool(past.any()):
        i = int(past.nonzero()[0, 0])
        raise InvalidArgument(f"slot_mapping: token {i} (table row {int(rows[i])}, position "
                              f"{int(pos[i])}) maps page group {int(groups[i])}, outside the "
                              f"{n_pages} of the planes (§12.4)")
    return torch.where(groups < 0, -1, groups * P + pos % P)


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
        """§12.1's view of table row ``row`` (``0 <= row < C``: a negative row would wrap to
        another sequence's row)."""
        row = as_int("row", row, lo=0, hi=self.block_tables.shape[0] - 1)
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
