"""The query-tiled CUDA kernel of ``paged_prefill_varlen`` (kernels/prefill.py wraps it).

One block = (work item, KV head x query-head chunk). A work item is up to ``tq`` consecutive
queries of one sequence; the block serves ``tq * ng`` (query, head) pairs. Its 4 warps take
the item's context positions in turn; a warp loads a position's K and V row once (each lane
``ne`` = D/32 elements, dequantized in registers) and applies it to every pair whose causal
limit covers it, with an online softmax per pair. So a K/V row is read once per tile and
head chunk instead of once per query (the decode path). At the end the warps' partial
(max, sum, acc) are combined pair by pair through shared memory.

No split-K: parallelism comes from items x heads; a long context with one query (a decode
row) is better served by ``paged_decode``'s split kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda, float32

from ninfer_kv.kernels import quant
from ninfer_kv.kernels.attention import lane_fns, warp_sum_fn
from ninfer_kv.kernels.backend import MAXD, WARPS, simulator

PAIRS = 16
"""(query, head) pairs one block serves: the tile is ``PAIRS // ng`` queries."""


@functools.cache
def prefill_kernel(ne: int, ng: int, kcodec: int, vcodec: int) -> Any:
    load = quant.for_target(quant.load_lane, cpu=False)
    warp_sum = warp_sum_fn(simulator())
    fill_luts, lane_dot, softmax_step = lane_fns(ne)
    NE, NG, KC, VC = ne, ng, kcodec, vcodec  # noqa: N806 - compile-time constants
    TQ = max(1, PAIRS // ng)  # noqa: N806
    NP = TQ * NG  # noqa: N806

    @cuda.jit
    def kernel(q, kc, ks, vc, vs, k_codec, v_codec, tables, rows, item_seq, item_q0,  # noqa: ANN001
               item_q1, q_start, first_pos, sm_scale, out):
        it = cuda.blockIdx.x
        hy = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        hq = q.shape[1]
        h_kv = kc.shape[1]
        grp = hq // h_kv
        chunks = grp // NG
        h = hy // chunks
        hq0 = h * grp + (hy % chunks) * NG
        d0 = lane * NE
        b = item_seq[it]
        q0 = item_q0[it]
        nq = item_q1[it] - q0
        base = first_pos[b] + (q0 - q_start[b]) + 1   # query i sees positions < base + i
        end = base + nq - 1
        buf = cuda.shared.array((WARPS, 32), float32)
        lut8 = cuda.shared.array(256, float32)
        lut4 = cuda.shared.array(16, float32)
        fill_luts(lut8, lut4, tid, WARPS * 32)
        sm_m = cuda.shared.array((WARPS, NP), float32)
        sm_l = cuda.shared.array((WARPS, NP), float32)
        sm_acc = cuda.shared.array((WARPS, MAXD), float32)
        qr = cuda.local.array((NP, NE), float32)
        acc = cuda.local.array((NP, NE), float32)
        m = cuda.local.array(NP, float32)
        lsum = cuda.local.array(NP, float32)
        kr = cuda.local.array(NE, float32)
        vr = cuda.local.array(NE, float32)
        for p in range(NP):
            i = p // NG
            m[p] = -math.inf
            lsum[p] = 0.0
            for e in range(NE):
                acc[p, e] = 0.0
                qr[p, e] = q[q0 + i, hq0 + p % NG, d0 + e] * sm_scale if i < nq else 0.0
        row = rows[b]
        if row < 0 or row >= tables.shape[0]:  # a skipped row (int32_or_skip): reads nothing
            end = 0
        iters = (end + WARPS - 1) // WARPS
        for step in range(iters):          # uniform trip count across the block
            t = step * WARPS + warp
            valid = t < end and (t >> 6) < tables.shape[1]
            g = -1
            if valid:
                g = tables[row, t >> 6]
                valid = 0 <= g < kc.shape[0]  # unmapped or foreign: skipped, never wrapped
            if valid:
                o = t & 63
                load(KC, kc, ks, g, h, o, d0, NE, kr, lut8, lut4)
                load(VC, vc, vs, g, h, o, d0, NE, vr, lut8, lut4)
            for p in range(NP):
                i = p // NG
                sees = valid and i < nq and t < base + i
                dot = warp_sum(lane_dot(qr, p, kr) if sees else float32(0.0), buf, warp, lane)
                if sees:
                    softmax_step(m, lsum, acc, p, dot, vr)
        for p in range(NP):                # combine the warps, one pair at a time
            if lane == 0:
                sm_m[warp, p] = m[p]
                sm_l[warp, p] = lsum[p]
            for e in range(NE):
                sm_acc[warp, d0 + e] = acc[p, e]
            cuda.syncthreads()
            i = p // NG
            if warp == 0 and i < nq:
                mx = -math.inf
                for w in range(WARPS):
                    mx = max(mx, sm_m[w, p])
                tot = float32(0.0)
                for e in range(NE):
                    kr[e] = 0.0
                for w in range(WARPS):
                    c = math.exp(sm_m[w, p] - mx) if sm_m[w, p] > -math.inf else float32(0.0)
                    tot += sm_l[w, p] * c
                    for e in range(NE):
                        kr[e] += sm_acc[w, d0 + e] * c
                for e in range(NE):
                    out[q0 + i, hq0 + p % NG, d0 + e] = kr[e] / tot
            cuda.syncthreads()

    return kernel


def tile_queries(ng: int) -> int:
    """Queries per CUDA work item for query-head chunks of ``ng``."""
    return max(1, PAIRS // ng)
