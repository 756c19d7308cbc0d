"""Paged attention through block tables (spec §12, §13): decode and prefill/verify, GQA with any
group size, per-row context length, split-K, fp32 accumulation with online softmax, codes and
scales read directly from pages — no gather to contiguous KV, no staging copy.

    paged_decode(q[B, Hq, D], view, table_rows[B], context_lens[B]) -> out[B, Hq, D]
    paged_prefill(q[B, T, Hq, D], view, table_rows[B], start[B]) -> out[B, T, Hq, D]

Prefill/verify query ``t`` of row ``b`` attends causally to positions ``[0, start[b] + t]``
(the chunk's own K/V must already be appended). It runs as decode over the flattened
``B * T`` queries with per-query context lengths; a tiled prefill kernel is a later step.

Split-K: each (row, KV head, split) item produces a partial (max, sum, acc) over its range of
positions; partials are combined with the usual log-sum-exp rescaling. Page translation is done
once per page (CPU) or once per token per warp (CUDA), never per element.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numba
import numpy as np
import torch
from numba import cuda, float32

from ninfer_kv.errors import InvalidArgument
from ninfer_kv.kernels import codecs, jit, quant
from ninfer_kv.kernels.append import page_major, side_codecs
from ninfer_kv.kernels.backend import (
    MAXD,
    MAXE,
    MAXG,
    THREADS,
    WARPS,
    cuda_head_dim_ok,
    dev_view,
    launch,
    scale_or_dummy,
    simulator,
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

_DQ_ROW = quant.for_target(quant.dq_row, cpu=True)


@jit.njit(inline="always", fastmath=True)
def _decode_item(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, ctx_lens, sm_scale,  # noqa: ANN001
                 n_split, out_m, out_l, out_acc, item):
    """Work item ``item``: row ``b``, KV head ``h``, split ``s`` of the context — its
    partial softmax (max, sum, weighted V) for the heads of the GQA group."""
    d = q.shape[2]
    h_kv = kc.shape[1]
    grp = q.shape[1] // h_kv
    b = item // (h_kv * n_split)
    rem = item % (h_kv * n_split)
    h = rem // n_split
    s = rem % n_split
    ctx = ctx_lens[b]
    chunk = (ctx + n_split - 1) // n_split
    start = s * chunk
    end = min(ctx, start + chunk)
    kbuf = np.empty(d, np.float32)
    vbuf = np.empty(d, np.float32)
    qs = np.empty((grp, d), np.float32)
    for j in range(grp):
        for e in range(d):
            qs[j, e] = q[b, h * grp + j, e] * sm_scale
    m = np.full(grp, -np.inf, np.float32)
    lsum = np.zeros(grp, np.float32)
    acc = np.zeros((grp, d), np.float32)
    row = rows[b]
    pos = start
    while pos < end:
        g = tables[row, pos >> 6]          # one translation per page
        page_end = min(end, ((pos >> 6) + 1) << 6)
        for p in range(pos, page_end):
            o = p & 63
            _DQ_ROW(k_codec, kc, ks, g, h, o, d, kbuf)
            _DQ_ROW(v_codec, vc, vs, g, h, o, d, vbuf)
            for j in range(grp):
                dot = np.float32(0.0)
                for e in range(d):
                    dot += qs[j, e] * kbuf[e]
                m_new = max(m[j], dot)
                corr = math.exp(m[j] - m_new)
                pw = math.exp(dot - m_new)
                lsum[j] = lsum[j] * corr + pw
                for e in range(d):
                    acc[j, e] = acc[j, e] * corr + pw * vbuf[e]
                m[j] = m_new
        pos = page_end
    for j in range(grp):
        out_m[b, h * grp + j, s] = m[j]
        out_l[b, h * grp + j, s] = lsum[j]
        for e in range(d):
            out_acc[b, h * grp + j, s, e] = acc[j, e]


@jit.njit(parallel=True, fastmath=True)
def _decode_cpu(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, ctx_lens, sm_scale,  # noqa: ANN001
                n_split, out_m, out_l, out_acc):
    for item in numba.prange(q.shape[0] * kc.shape[1] * n_split):
        _decode_item(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, ctx_lens, sm_scale,
                     n_split, out_m, out_l, out_acc, item)


@jit.njit(fastmath=True, error_model="numpy")
def _decode_serial(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, ctx_lens, sm_scale,  # noqa: ANN001
                   n_split, out_m, out_l, out_acc):
    """``_decode_cpu`` on the calling thread (``jit.SERIAL_BELOW``)."""
    for item in range(q.shape[0] * kc.shape[1] * n_split):
        _decode_item(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, ctx_lens, sm_scale,
                     n_split, out_m, out_l, out_acc, item)


def heads_per_block(grp: int) -> int:
    """Query heads one CUDA block serves: the largest divisor of the GQA group <= MAXG."""
    return max(n for n in range(1, min(grp, MAXG) + 1) if grp % n == 0)


@functools.cache
def warp_sum_fn(sim: bool) -> Any:
    """Device function: the sum of ``v`` over the 32 lanes of a warp. Every thread of the
    block must call it (the simulator has no shuffles: it reduces through shared ``buf``
    [WARPS, 32] between two block barriers)."""

    @cuda.jit(device=True)
    def warp_sum(v, buf, warp, lane):  # noqa: ANN001
        if sim:
            buf[warp, lane] = v
            cuda.syncthreads()
            t = float32(0.0)
            for i in range(32):
                t += buf[warp, i]
            cuda.syncthreads()
            return t
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
        return v

    return warp_sum


@functools.cache
def lane_fns(ne: int) -> tuple[Any, Any, Any]:
    """Device functions the decode and prefill kernels share, for ``ne`` elements per lane
    (a compile-time constant): ``fill_luts(lut8, lut4, tid, threads)`` (FP8/FP4 decode tables
    in shared memory), ``lane_dot(qr, j, kr)`` (this lane's part of q_j . k) and
    ``softmax_step(m, lsum, acc, j, dot, vr)`` (online-softmax update of accumulator ``j``)."""
    gpu_codecs = codecs.gpu()
    NE = ne  # noqa: N806

    @cuda.jit(device=True)
    def fill_luts(lut8, lut4, tid, threads):  # noqa: ANN001
        for i in range(tid, 256, threads):
            lut8[i] = gpu_codecs.fp8_decode(i)
            if i < 16:
                lut4[i] = gpu_codecs.fp4_decode(i)
        cuda.syncthreads()

    @cuda.jit(device=True)
    def lane_dot(qr, j, kr):  # noqa: ANN001
        part = float32(0.0)
        for e in range(NE):
            part += qr[j, e] * kr[e]
        return part

    @cuda.jit(device=True)
    def softmax_step(m, lsum, acc, j, dot, vr):  # noqa: ANN001
        m_new = max(m[j], dot)
        corr = math.exp(m[j] - m_new)
        pw = math.exp(dot - m_new)
        lsum[j] = lsum[j] * corr + pw
        for e in range(NE):
            acc[j, e] = acc[j, e] * corr + pw * vr[e]
        m[j] = m_new

    return fill_luts, lane_dot, softmax_step


@functools.cache
def _decode_cuda(ne: int = 4, ng: int = 4, kcodec: int = 0, vcodec: int = 0) -> Any:
    """Block = (row, KV head x query-head chunk, split); 4 warps take tokens in turn, each lane
    holds ``ne`` = D/32 consecutive elements of q, k, v and acc for ``ng`` query heads;
    dot products are warp-reduced. ``ne``/``ng`` are compile-time constants, so the per-lane
    arrays live in registers and the loops unroll; the codecs are constants too, so the
    dequant branches fold away (one specialization per (D, heads, profile))."""
    load = quant.for_target(quant.load_lane, cpu=False)
    warp_sum = warp_sum_fn(simulator())
    fill_luts, lane_dot, softmax_step = lane_fns(ne)
    NE, NG, KC, VC = ne, ng, kcodec, vcodec  # noqa: N806 - compile-time constants

    @cuda.jit
    def kernel(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, ctx_lens, sm_scale,  # noqa: ANN001
               n_split, out_m, out_l, out_acc):
        b = cuda.blockIdx.x
        hy = cuda.blockIdx.y
        s = cuda.blockIdx.z
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        hq = q.shape[1]
        h_kv = kc.shape[1]
        grp = hq // h_kv
        chunks = grp // NG
        h = hy // chunks
        q0 = h * grp + (hy % chunks) * NG
        d0 = lane * NE
        buf = cuda.shared.array((WARPS, 32), float32)
        lut8 = cuda.shared.array(256, float32)
        lut4 = cuda.shared.array(16, float32)
        fill_luts(lut8, lut4, tid, THREADS)  # decode tables for FP8/FP4 codes
        sm_m = cuda.shared.array((WARPS, MAXG), float32)
        sm_l = cuda.shared.array((WARPS, MAXG), float32)
        sm_acc = cuda.shared.array((WARPS, MAXG, MAXD), float32)
        qr = cuda.local.array((NG, NE), float32)
        acc = cuda.local.array((NG, NE), float32)
        m = cuda.local.array(NG, float32)
        lsum = cuda.local.array(NG, float32)
        kr = cuda.local.array(NE, float32)
        vr = cuda.local.array(NE, float32)
        for j in range(NG):
            m[j] = -math.inf
            lsum[j] = 0.0
            for e in range(NE):
                qr[j, e] = q[b, q0 + j, d0 + e] * sm_scale
                acc[j, e] = 0.0
        ctx = ctx_lens[b]
        chunk = (ctx + n_split - 1) // n_split
        start = s * chunk
        end = min(ctx, start + chunk)
        row = rows[b]
        if row < 0 or row >= tables.shape[0]:  # a skipped row (int32_or_skip): reads nothing
            end = start
        iters = (max(0, end - start) + WARPS - 1) // WARPS
        for it in range(iters):             # uniform trip count across the block
            t = start + it * WARPS + warp
            valid = t < end and (t >> 6) < tables.shape[1]
            g = -1
            if valid:
                g = tables[row, t >> 6]
                valid = 0 <= g < kc.shape[0]  # unmapped or foreign: skipped, never wrapped
            if valid:
                o = t & 63
                load(KC, kc, ks, g, h, o, d0, NE, kr, lut8, lut4)
                load(VC, vc, vs, g, h, o, d0, NE, vr, lut8, lut4)
            for j in range(NG):
                dot = warp_sum(lane_dot(qr, j, kr) if valid else float32(0.0), buf, warp, lane)
                if valid:
                    softmax_step(m, lsum, acc, j, dot, vr)
        for j in range(NG):                 # combine the warps of this block
            if lane == 0:
                sm_m[warp, j] = m[j]
                sm_l[warp, j] = lsum[j]
            for e in range(NE):
                sm_acc[warp, j, d0 + e] = acc[j, e]
        cuda.syncthreads()
        if warp == 0:
            for j in range(NG):
                mx = -math.inf
                for w in range(WARPS):
                    mx = max(mx, sm_m[w, j])
                tot = float32(0.0)
                for e in range(NE):
                    kr[e] = 0.0
                for w in range(WARPS):
                    c = math.exp(sm_m[w, j] - mx) if sm_m[w, j] > -math.inf else float32(0.0)
                    tot += sm_l[w, j] * c
                    for e in range(NE):
                        kr[e] += sm_acc[w, j, d0 + e] * c
                if lane == 0:
                    out_m[b, q0 + j, s] = mx
                    out_l[b, q0 + j, s] = tot
                for e in range(NE):
                    out_acc[b, q0 + j, s, d0 + e] = kr[e]

    return kernel


def choose_splits(n_rows: int, h_kv: int, max_ctx: int, cuda: bool) -> int:
    """Enough work items to fill the device, no split shorter than a few pages."""
    target = 8 * 132 if cuda else 4 * max(1, numba.get_num_threads())
    want = max(1, -(-target // max(1, n_rows * h_kv)))
    return int(max(1, min(want, -(-max_ctx // 256))))


def _combine(out_m: torch.Tensor, out_l: torch.Tensor, out_acc: torch.Tensor) -> torch.Tensor:
    mx = out_m.max(dim=-1, keepdim=True).values
    w = torch.where(out_m > -math.inf, torch.exp(out_m - mx), torch.zeros_like(out_m))
    tot = (out_l * w).sum(-1)
    # a row with context 0 attends to nothing: a zero row (FlashInfer's convention), not 0/0
    tot = torch.where(tot > 0, tot, torch.ones_like(tot))
    return (out_acc * w.unsqueeze(-1)).sum(-2) / tot.unsqueeze(-1)


def paged_decode(q: torch.Tensor, view: Any, table_rows: torch.Tensor,
                 context_lens: torch.Tensor, *, sm_scale: float | None = None,
                 n_split: int | None = None, force_cuda_sim: bool = False) -> torch.Tensor:
    check_values(q, "q", "paged_decode", 3)
    sm_scale, n_split = attention_options("paged_decode", sm_scale, n_split)
    table_rows = check_index(table_rows, "table_rows", "paged_decode")
    context_lens = check_index(context_lens, "context_lens", "paged_decode")
    check_view(view, "paged_decode")  # first: what follows reads the view's fields
    n_rows, hq, d = q.shape
    h_kv = view.num_kv_heads
    if d != view.head_dim or hq % h_kv or not hq or d % 32 or d > 32 * MAXE:
        raise InvalidArgument(f"paged_decode: q {tuple(q.shape)} vs view heads={h_kv} "
                              f"head_dim={view.head_dim} (need Hq a positive multiple of H, "
                              "D % 32 == 0, "
                              "D <= 256)")
    if table_rows.shape != (n_rows,) or context_lens.shape != (n_rows,):
        raise InvalidArgument(f"paged_decode: table_rows {tuple(table_rows.shape)} and "
                              f"context_lens {tuple(context_lens.shape)} must be [B={n_rows}] "
                              f"(q is {tuple(q.shape)})")
    check_devices(view, "paged_decode", q=q, table_rows=table_rows, context_lens=context_lens)
    check_read_domain(view, table_rows, context_lens, "paged_decode")
    kc, vc = page_major(view.k_pages, view.order), page_major(view.v_pages, view.order)
    ks = scale_or_dummy(page_major(view.k_scale_pages, view.order), kc)
    vs = scale_or_dummy(page_major(view.v_scale_pages, view.order), vc)
    k_id, v_id = side_codecs(view.storage)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    cuda_path = use_cuda_kernels(kc, force_sim=force_cuda_sim)
    if cuda_path and not cuda_head_dim_ok(d):
        raise InvalidArgument(f"paged_decode: head_dim={d} on CUDA: need D in 32/64/128/256 "
                              "(each lane's D/32 elements must sit in one scale group)")
    if not n_rows:  # no launch: a CUDA grid may not be empty
        return q.new_zeros(q.shape)
    # the longest context sizes the split only when the caller did not: reading it is a
    # device sync on CUDA, which a CUDA graph replay (§13) cannot take
    splits = n_split or choose_splits(n_rows, h_kv, int(context_lens.max()), cuda_path)
    dev = q.device
    out_m = torch.empty((n_rows, hq, splits), dtype=torch.float32, device=dev)
    out_l = torch.empty_like(out_m)
    out_acc = torch.empty((n_rows, hq, splits, d), dtype=torch.float32, device=dev)
    qf = q.float().contiguous()
    args = [dev_view(t) for t in (qf, kc, ks, vc, vs)] + [k_id, v_id] + [
        dev_view(t) for t in (view.block_tables, int32_or_skip(table_rows),
                              int32_or_skip(context_lens))] + [np.float32(scale), splits] + [
        dev_view(t) for t in (out_m, out_l, out_acc)]
    if cuda_path:
        ng = heads_per_block(hq // h_kv)
        launch(_decode_cuda(d // 32, ng, k_id, v_id), (n_rows, h_kv * (hq // h_kv // ng), splits),
               THREADS, *args)
    elif jit.parallel(hq * d * int(context_lens.sum())):  # QK^T terms (and as many PV)
        _decode_cpu(*args)
    else:
        _decode_serial(*args)
    return _combine(out_m, out_l, out_acc).to(q.dtype)


def paged_prefill(q: torch.Tensor, view: Any, table_rows: torch.Tensor, start: torch.Tensor,
                  **kw: Any) -> torch.Tensor:
    """Causal chunk attention: query t of row b sees positions [0, start[b] + t]."""
    check_values(q, "q", "paged_prefill", 4)
    table_rows = check_index(table_rows, "table_rows", "paged_prefill")
    start = check_index(start, "start", "paged_prefill")
    check_view(view, "paged_prefill")  # what follows reads the view's fields and devices
    check_devices(view, "paged_prefill", q=q, table_rows=table_rows, start=start)
    n_rows, t, hq, d = q.shape
    if table_rows.shape != (n_rows,):
        raise InvalidArgument(f"paged_prefill: table_rows {tuple(table_rows.shape)} must be "
                              f"[B={n_rows}] (q is {tuple(q.shape)})")
    # checked on the host only (no sync): on CUDA a negative start is a context below 1,
    # for which the kernels read nothing
    if start.shape != (n_rows,) or (not start.is_cuda and bool((start < 0).any())):
        raise InvalidArgument(f"paged_prefill: start {start.tolist()} must be [B] positions "
                              ">= 0 (the tokens already in each row)")
    rows = table_rows.repeat_interleave(t)
    ctx = (start.view(-1, 1) + torch.arange(1, t + 1, device=start.device)).reshape(-1)
    out = paged_decode(q.reshape(n_rows * t, hq, d), view, rows, ctx, **kw)
    return out.view(n_rows, t, hq, d)

