"""Paged KV append (spec §4.3, §12): quantize B new tokens' K and V and write them at their
positions through ``table_rows`` + block tables into the code and scale planes of one layer.
Positions may start inside a page; pages need not be contiguous.

    append_kv(view, table_rows[B], positions[B], k[B, H, D], v[B, H, D])

``view`` is a ``PagedKVBatchLayerView`` (or anything with its fields). k/v may be float32 or
bfloat16; they are read as float32.
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import torch
from numba import cuda

from ninfer_kv.engine.layout import PlaneOrder
from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels import jit, quant
from ninfer_kv.kernels.backend import dev_view, launch, scale_or_dummy, use_cuda_kernels
from ninfer_kv.kernels.checks import (
    check_devices,
    check_index,
    check_mapped,
    check_values,
    check_view,
    int32_or_skip,
)
from ninfer_kv.kernels.codecs import BF16, FP8_ROW, INT8_G64, NVFP4_G16

_ENC_CPU = quant.for_target(quant.encode_row, cpu=True)

CODEC_IDS = {"bf16": BF16, "int8-g64": INT8_G64, "fp8-e4m3fn-row256": FP8_ROW,
             "nvfp4-g16": NVFP4_G16}


def side_codecs(storage: Any) -> tuple[int, int]:
    """(K codec id, V codec id) of a closed profile."""
    k, v = storage.codecs
    return CODEC_IDS[k.value], CODEC_IDS[v.value]


@jit.njit(inline="always")
def _append_item(kc, ks, vc, vs, k_codec, v_codec, tables, rows, positions, k, v, i):  # noqa: ANN001
    """Token ``i // n_heads``, head ``i % n_heads``: encode its K and V row into its page."""
    n_heads, d = k.shape[1], k.shape[2]
    b = i // n_heads
    h = i % n_heads
    pos = positions[b]
    if pos < 0 or (pos >> 6) >= tables.shape[1]:
        return  # outside the row: never read another row's entries
    g = tables[rows[b], pos >> 6]
    if g >= 0:  # an unmapped entry (-1) is never written through (it would wrap)
        o = pos & 63
        _ENC_CPU(k_codec, k[b, h], kc, ks, g, h, o, d)
        _ENC_CPU(v_codec, v[b, h], vc, vs, g, h, o, d)


@jit.njit(parallel=True)
def _append_cpu(kc, ks, vc, vs, k_codec, v_codec, tables, rows, positions, k, v):  # noqa: ANN001
    for i in numba.prange(k.shape[0] * k.shape[1]):
        _append_item(kc, ks, vc, vs, k_codec, v_codec, tables, rows, positions, k, v, i)


@jit.njit(error_model="numpy")
def _append_serial(kc, ks, vc, vs, k_codec, v_codec, tables, rows, positions, k, v):  # noqa: ANN001
    """``_append_cpu`` on the calling thread (``jit.SERIAL_BELOW``)."""
    for i in range(k.shape[0] * k.shape[1]):
        _append_item(kc, ks, vc, vs, k_codec, v_codec, tables, rows, positions, k, v, i)


@functools.cache
def _append_cuda() -> Any:
    enc = quant.for_target(quant.encode_row, cpu=False)

    @cuda.jit
    def kernel(kc, ks, vc, vs, k_codec, v_codec, tables, rows, positions, k, v):  # noqa: ANN001
        i = cuda.grid(1)
        n_tok, n_heads, d = k.shape
        if i < n_tok * n_heads:
            b = i // n_heads
            h = i % n_heads
            pos = positions[b]
            r = rows[b]
            g = -1
            if pos >= 0 and (pos >> 6) < tables.shape[1] and 0 <= r < tables.shape[0]:
                g = tables[r, pos >> 6]  # never another row's entries (nor a wrapped row)
            if 0 <= g < kc.shape[0]:  # an unmapped (-1) or foreign entry: never written through
                o = pos & 63
                enc(k_codec, k[b, h], kc, ks, g, h, o, d)
                enc(v_codec, v[b, h], vc, vs, g, h, o, d)

    return kernel


def page_major(t: torch.Tensor | None, order: PlaneOrder) -> torch.Tensor | None:
    """Head-major planes [H, N, P, X] are handed to kernels as [N, H, P, X] views (§4.3)."""
    if t is None or order is PlaneOrder.PAGE_MAJOR:
        return t
    return t.permute(1, 0, 2, 3)


def append_kv(view: Any, table_rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, *, force_cuda_sim: bool = False) -> None:
    check_values(k, "k", "append_kv", 3)
    check_values(v, "v", "append_kv", 3)
    table_rows = check_index(table_rows, "table_rows", "append_kv")
    positions = check_index(positions, "positions", "append_kv")
    check_view(view, "append_kv")  # first: what follows reads the view's fields
    if k.shape != v.shape or k.dim() != 3 or k.shape[0] != table_rows.shape[0] or \
            positions.shape != table_rows.shape or table_rows.dim() != 1:
        raise InvalidArgument(f"append_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, table_rows "
                              f"{tuple(table_rows.shape)}, positions {tuple(positions.shape)} "
                              "disagree (want k, v [B, H, D]; table_rows, positions [B])")
    if k.shape[1] != view.num_kv_heads or k.shape[2] != view.head_dim:
        raise InvalidArgument(f"append_kv: k heads/dim {tuple(k.shape[1:])} != view "
                              f"({view.num_kv_heads}, {view.head_dim})")
    check_devices(view, "append_kv", k=k, v=v, table_rows=table_rows, positions=positions)
    check_mapped(view, table_rows, positions, "append_kv")
    record = None
    guard = getattr(view, "guard", None)
    if guard is not None:  # checked mode: writer/frontier/ownership
        check = getattr(guard, "check", None)  # the store's: records once the kernel ran
        if check is not None:
            record = check(table_rows, positions)
        else:
            guard(table_rows, positions)
    kc, vc = page_major(view.k_pages, view.order), page_major(view.v_pages, view.order)
    ks = scale_or_dummy(page_major(view.k_scale_pages, view.order), kc)
    vs = scale_or_dummy(page_major(view.v_scale_pages, view.order), vc)
    k_id, v_id = side_codecs(view.storage)
    kf = k.float().contiguous()
    vf = v.float().contiguous()
    rows, pos = int32_or_skip(table_rows), int32_or_skip(positions)
    args = [dev_view(t) for t in (kc, ks, vc, vs)] + [k_id, v_id] + [
        dev_view(t) for t in (view.block_tables, rows, pos, kf, vf)]
    if use_cuda_kernels(kc, force_sim=force_cuda_sim):
        n = k.shape[0] * k.shape[1]
        launch(_append_cuda(), (max(1, -(-n // 64)),), 64, *args)
    elif jit.parallel(k.numel()):  # values encoded
        _append_cpu(*args)
    else:
        _append_serial(*args)
    if record is not None:  # after the kernel: a write that failed before it is no write
        record()
