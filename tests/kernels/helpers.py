"""Build paged layer views directly (no store) with permuted, non-contiguous page ids."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ninfer_kv.engine.layout import PlaneOrder, PoolKind, Profile, pool_geometry
from ninfer_kv.engine.views import PagedKVBatchLayerView
from tests.kernels import reference as ref


@dataclass
class Case:
    view: PagedKVBatchLayerView
    rows: torch.Tensor


def make_view(profile: Profile, heads: int, head_dim: int, pages: int, rows: int,
              logical: int, order: PlaneOrder = PlaneOrder.PAGE_MAJOR,
              seed: int = 0) -> PagedKVBatchLayerView:
    kind = PoolKind.DRAFT_FULL if order is PlaneOrder.HEAD_MAJOR else PoolKind.MAIN
    g = pool_geometry(kind, profile, 1, heads, head_dim, pages)
    planes = {k: torch.zeros(g.shape(p), dtype=p.dtype) for k, p in g.layer_planes(0).items()}
    rng = np.random.default_rng(seed)
    perm = rng.permutation(pages)[: rows * logical]  # permuted, non-contiguous ids
    tables = torch.from_numpy(perm.reshape(rows, logical).astype(np.int32))
    return PagedKVBatchLayerView(planes["k_code"], planes["v_code"], planes.get("k_scale"),
                                 planes.get("v_scale"), tables, head_dim, heads, profile,
                                 g.order)


def read_token(view: PagedKVBatchLayerView, row: int, pos: int, side: str) -> np.ndarray:
    """Dequantize one token's [H, D] from the planes with the reference decoder."""
    codec = view.storage.codecs[0 if side == "k" else 1].value
    code_t = view.k_pages if side == "k" else view.v_pages
    scale_t = view.k_scale_pages if side == "k" else view.v_scale_pages
    g = int(view.block_tables[row, pos // 64])
    o = pos % 64
    out = []
    for h in range(view.num_kv_heads):
        if view.order is PlaneOrder.PAGE_MAJOR:
            code = code_t[g, h, o].numpy()
            scale = scale_t[g, h, o].numpy() if scale_t is not None else None
        else:
            code = code_t[h, g, o].numpy()
            scale = scale_t[h, g, o].numpy() if scale_t is not None else None
        out.append(ref.decode_row(codec, code, scale))
    return np.stack(out)


def read_kv(view: PagedKVBatchLayerView, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = np.stack([read_token(view, row, p, "k") for p in range(n)])
    v = np.stack([read_token(view, row, p, "v") for p in range(n)])
    return torch.from_numpy(k), torch.from_numpy(v)
