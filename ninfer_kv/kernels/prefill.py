"""Ragged (FlashInfer-style) causal prefill over paged KV: ``paged_prefill_varlen``.

Sequence ``b`` owns queries ``q[cu_seqlens[b]:cu_seqlens[b+1]]`` — its last ``n_b`` tokens,
already appended — and has ``context_lens[b]`` tokens in all, so its query ``i`` sees positions
``[0, context_lens[b] - n_b + i]``. A mixed prefill + decode batch is one call (a decode row
has ``n_b = 1``).

CPU: query-tiled. One work item is (sequence, KV head, tile of up to ``TILE`` queries); it
dequantizes each K/V row of the tile's context once and applies it to every query of the tile
(and every query head of the GQA group) with per-query causal limits and an online softmax, so
a page is read once per tile instead of once per query. CUDA: the same tiling in
kernels/prefill_cuda.py (tiles of ``16 // heads-per-block`` queries, warps over positions).
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import torch

from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels import jit
from ninfer_kv.kernels.append import page_major, side_codecs
from ninfer_kv.kernels.attention import _DQ_ROW, heads_per_block, paged_decode
from ninfer_kv.kernels.backend import (
    MAXD,
    THREADS,
    cuda_head_dim_ok,
    dev_view,
    launch,
    scale_or_dummy,
    use_cuda_kernels,
)
from ninfer_kv.kernels.checks import (
    attention_options,
    check_devices,
    check_index,
    check_read_domain,
    check_values,
    check_view,
    int32_or_skip,
)
from ninfer_kv.kernels.prefill_cuda import prefill_kernel, tile_queries

TILE = 16
"""Queries per CPU work item: each K/V row is dequantized once per tile."""


@jit.njit(inline="always", fastmath=True)
def _prefill_item(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, item_seq, item_q0,  # noqa: ANN001
                  item_q1, q_start, q_count, ctx_lens, sm_scale, out, item):
    """Work item ``item``: query tile ``item // h_kv`` (queries [q0, q1) of one sequence),
    KV head ``item % h_kv`` — causal attention of the tile's queries of the GQA group."""
    d = q.shape[2]
    h_kv = kc.shape[1]
    grp = q.shape[1] // h_kv
    it = item // h_kv
    h = item % h_kv
    b = item_seq[it]
    q0, q1 = item_q0[it], item_q1[it]          # global query indices [q0, q1)
    nq = q1 - q0
    first = ctx_lens[b] - q_count[b]           # position of the sequence's first query
    kbuf = np.empty(d, np.float32)
    vbuf = np.empty(d, np.float32)
    qs = np.empty((nq, grp, d), np.float32)
    lim = np.empty(nq, np.int64)               # query i sees positions < lim[i]
    for i in range(nq):
        lim[i] = first + (q0 + i - q_start[b]) + 1
        for j in range(grp):
            for e in range(d):
                qs[i, j, e] = q[q0 + i, h * grp + j, e] * sm_scale
    m = np.full((nq, grp), -np.inf, np.float32)
    lsum = np.zeros((nq, grp), np.float32)
    acc = np.zeros((nq, grp, d), np.float32)
    row = rows[b]
    end = lim[nq - 1]
    pos = 0
    while pos < end:
        g = tables[row, pos >> 6]              # one translation per page
        page_end = min(end, ((pos >> 6) + 1) << 6)
        for p in range(pos, page_end):
            o = p & 63
            _DQ_ROW(k_codec, kc, ks, g, h, o, d, kbuf)
            _DQ_ROW(v_codec, vc, vs, g, h, o, d, vbuf)
            for i in range(nq):
                if p >= lim[i]:
                    continue
                for j in range(grp):
                    dot = np.float32(0.0)
                    for e in range(d):
                        dot += qs[i, j, e] * kbuf[e]
                    m_new = max(m[i, j], dot)
                    corr = math.exp(m[i, j] - m_new)
                    pw = math.exp(dot - m_new)
                    lsum[i, j] = lsum[i, j] * corr + pw
                    for e in range(d):
                        acc[i, j, e] = acc[i, j, e] * corr + pw * vbuf[e]
                    m[i, j] = m_new
        pos = page_end
    for i in range(nq):
        for j in range(grp):
            for e in range(d):
                out[q0 + i, h * grp + j, e] = acc[i, j, e] / lsum[i, j]


@jit.njit(parallel=True, fastmath=True)
def _prefill_cpu(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, item_seq, item_q0,  # noqa: ANN001
                 item_q1, q_start, q_count, ctx_lens, sm_scale, out):
    for item in numba.prange(item_seq.shape[0] * kc.shape[1]):
        _prefill_item(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, item_seq, item_q0,
                      item_q1, q_start, q_count, ctx_lens, sm_scale, out, item)


@jit.njit(fastmath=True, error_model="numpy")
def _prefill_serial(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, item_seq, item_q0,  # noqa: ANN001
                    item_q1, q_start, q_count, ctx_lens, sm_scale, out):
    """``_prefill_cpu`` on the calling thread (``jit.SERIAL_BELOW``)."""
    for item in range(item_seq.shape[0] * kc.shape[1]):
        _prefill_item(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, item_seq, item_q0,
                      item_q1, q_start, q_count, ctx_lens, sm_scale, out, item)


def _ragged(q: torch.Tensor, table_rows: torch.Tensor, cu_seqlens: torch.Tensor,
            context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated (query counts, context lengths) as int64 CPU tensors."""
    b = table_rows.shape[0]
    if cu_seqlens.shape != (b + 1,) or context_lens.shape != (b,):
        raise InvalidArgument(f"paged_prefill_varlen: table_rows {tuple(table_rows.shape)}, "
                              f"cu_seqlens {tuple(cu_seqlens.shape)}, context_lens "
                              f"{tuple(context_lens.shape)}: want [B], [B + 1], [B]")
    cu = cu_seqlens.to(torch.int64).cpu()
    n = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or bool((n < 0).any()):
        raise InvalidArgument(f"paged_prefill_varlen: cu_seqlens {cu.tolist()} must rise from "
                              f"0 to the {q.shape[0]} queries")
    ctx = context_lens.to(torch.int64).cpu()
    short = torch.nonzero(ctx < n)
    if short.numel():
        i = int(short[0, 0])
        raise InvalidArgument(f"paged_prefill_varlen: sequence {i} has {int(n[i])} queries but "
                              f"context_lens={int(ctx[i])} (its queries' own tokens count)")
    return n, ctx


def paged_prefill_varlen(q: torch.Tensor, view: Any, table_rows: torch.Tensor,
                         cu_seqlens: torch.Tensor, context_lens: torch.Tensor, *,
                         sm_scale: float | None = None, tiled: bool = True,
                         force_cuda_sim: bool = False) -> torch.Tensor:
    """Causal attention of a ragged batch: ``q`` [total, Hq, D]; ``table_rows``,
    ``context_lens`` [B]; ``cu_seqlens`` [B + 1] from 0 to total. Returns [total, Hq, D].
    ``tiled=False`` runs the per-query decode path instead."""
    check_values(q, "q", "paged_prefill_varlen", 3)
    sm_scale, _ = attention_options("paged_prefill_varlen", sm_scale)
    table_rows = check_index(table_rows, "table_rows", "paged_prefill_varlen")
    cu_seqlens = check_index(cu_seqlens, "cu_seqlens", "paged_prefill_varlen")
    context_lens = check_index(context_lens, "context_lens", "paged_prefill_varlen")
    check_view(view, "paged_prefill_varlen")  # first: what follows reads the view's fields
    check_devices(view, "paged_prefill_varlen", q=q, table_rows=table_rows,
                  cu_seqlens=cu_seqlens, context_lens=context_lens)
    n, ctx = _ragged(q, table_rows, cu_seqlens, context_lens)
    seq = torch.repeat_interleave(torch.arange(len(n)), n)
    within = torch.arange(q.shape[0]) - (torch.cumsum(n, 0) - n)[seq]
    # int64 until checked: a cast first would check (and read) a wrapped row or context
    per_query = (ctx[seq] - n[seq] + within + 1).to(context_lens.device)
    rows = table_rows.to(torch.int64)[seq.to(table_rows.device)]
    kc = page_major(view.k_pages, view.order)
    cuda_path = use_cuda_kernels(kc, force_sim=force_cuda_sim)
    if not tiled:
        return paged_decode(q, view, rows, per_query, sm_scale=sm_scale,
                            force_cuda_sim=force_cuda_sim)
    total, hq, d = q.shape
    h_kv = view.num_kv_heads
    if d != view.head_dim or hq % h_kv or not hq or d % 32 or d > MAXD:
        raise InvalidArgument(f"paged_prefill_varlen: q {tuple(q.shape)} vs view heads={h_kv} "
                              f"head_dim={view.head_dim} (need Hq a positive multiple of H, "
                              "D % 32 == 0, "
                              f"D <= {MAXD})")
    if cuda_path and not cuda_head_dim_ok(d):
        raise InvalidArgument(f"paged_prefill_varlen: head_dim={d} on CUDA: need D in "
                              "32/64/128/256 (each lane's D/32 elements in one scale group)")
    check_read_domain(view, rows, per_query, "paged_prefill_varlen")  # every query's reads
    starts = torch.cumsum(n, 0) - n
    ng = heads_per_block(hq // h_kv)
    tile = tile_queries(ng) if cuda_path else TILE
    items = [(b, q0, min(q0 + tile, int(starts[b] + n[b])))
             for b in range(len(n)) for q0 in range(int(starts[b]), int(starts[b] + n[b]), tile)]
    item = torch.tensor(items, dtype=torch.int32).reshape(-1, 3).T.contiguous()
    vc = page_major(view.v_pages, view.order)
    ks = scale_or_dummy(page_major(view.k_scale_pages, view.order), kc)
    vs = scale_or_dummy(page_major(view.v_scale_pages, view.order), vc)
    k_id, v_id = side_codecs(view.storage)
    scale = np.float32(sm_scale if sm_scale is not None else 1.0 / math.sqrt(d))
    out = torch.zeros((total, hq, d), dtype=torch.float32, device=q.device)
    if not total:
        return out.to(q.dtype)
    if cuda_path:
        dev = q.device
        ints = [int32_or_skip(t.to(dev)) for t in (item[0], item[1], item[2], starts, ctx - n)]
        args = [dev_view(t) for t in (q.float().contiguous(), kc, ks, vc, vs)] + [k_id, v_id] + [
            dev_view(t) for t in (view.block_tables, int32_or_skip(table_rows), *ints)] + [
            scale, dev_view(out)]
        launch(prefill_kernel(d // 32, ng, k_id, v_id), (len(items), h_kv * (hq // h_kv // ng)),
               THREADS, *args)
        return out.to(q.dtype)
    idx = item.to(torch.int64).numpy()
    # work: QK^T terms (and as many PV) of every query against its causal context
    work = hq * d * int((n * ctx).sum())
    kernel = _prefill_cpu if jit.parallel(work) else _prefill_serial
    kernel(dev_view(q.float().contiguous()), dev_view(kc), dev_view(ks), dev_view(vc),
           dev_view(vs), k_id, v_id, dev_view(view.block_tables),
           table_rows.to(torch.int32).cpu().numpy(), idx[0], idx[1], idx[2],
           starts.numpy(), n.numpy(), ctx.numpy(), scale, out.numpy())
    return out.to(q.dtype)
