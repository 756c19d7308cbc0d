"""Row-level encode/dequant shared by the append and attention kernels of both targets.

Planes are indexed ``[g, h, o, x]`` (page id, KV head, column, leading extent). Head-major
(Draft Full) planes reach the kernels already permuted to that index order, so one body serves
both closed orders (spec §4.3). ``C`` is bound to the CPU or GPU codec module by ``twin``.
"""

from __future__ import annotations

import numpy as np

from ninfer_kv.kernels import codecs
from ninfer_kv.kernels.backend import twin
from ninfer_kv.kernels.codecs import BF16, FP4_MAX, FP8_MAX, FP8_ROW, INT8_G64, INT8_MAX

C = codecs.CPU  # rebound per target by twin()


def encode_row(codec, x, code, scale, g, h, o, D):  # noqa: ANN001, N803 - numba body
    """Quantize one token-head row ``x[0:D]`` into its code (and scale) plane slots."""
    if codec == BF16:
        for d in range(D):
            code[g, h, o, d] = C.bf16_encode(x[d])
    elif codec == INT8_G64:
        for grp in range(D // 64):
            amax = np.float32(0.0)
            for d in range(grp * 64, grp * 64 + 64):
                a = abs(np.float32(x[d]))
                if a > amax:
                    amax = a
            s = C.bf16_scale(amax, INT8_MAX)
            scale[g, h, o, grp] = s
            sf = C.bf16_decode(s)
            for d in range(grp * 64, grp * 64 + 64):
                code[g, h, o, d] = C.int8_encode(C.quant_div(x[d], sf))
    elif codec == FP8_ROW:
        amax = np.float32(0.0)
        for d in range(D):
            a = abs(np.float32(x[d]))
            if a > amax:
                amax = a
        s = C.bf16_scale(amax, FP8_MAX)
        scale[g, h, o, 0] = s
        sf = C.bf16_decode(s)
        for d in range(D):
            v = C.quant_div(x[d], sf)
            v = min(max(v, np.float32(-FP8_MAX)), np.float32(FP8_MAX))
            code[g, h, o, d] = C.fp8_encode(v)
    else:  # NVFP4_G16: element 2i in the low nibble, 2i+1 in the high nibble
        for grp in range(D // 16):
            amax = np.float32(0.0)
            for d in range(grp * 16, grp * 16 + 16):
                a = abs(np.float32(x[d]))
                if a > amax:
                    amax = a
            s = C.fp8_scale(amax)
            scale[g, h, o, grp] = s
            sf = C.fp8_decode(s)
            for d in range(grp * 16, grp * 16 + 16, 2):
                lo = C.quant_div(x[d], sf)
                hi = C.quant_div(x[d + 1], sf)
                lo = min(max(lo, np.float32(-FP4_MAX)), np.float32(FP4_MAX))
                hi = min(max(hi, np.float32(-FP4_MAX)), np.float32(FP4_MAX))
                code[g, h, o, d >> 1] = np.uint8(C.fp4_encode(lo) | (C.fp4_encode(hi) << 4))


def dq_row(codec, code, scale, g, h, o, D, out):  # noqa: ANN001, N803 - numba body
    """A whole dequantized row; the codec branch sits outside the element loop."""
    if codec == BF16:
        for d in range(D):
            out[d] = C.bf16_decode(code[g, h, o, d])
    elif codec == INT8_G64:
        for grp in range(D // 64):
            sf = C.bf16_decode(scale[g, h, o, grp])
            for d in range(grp * 64, grp * 64 + 64):
                out[d] = np.float32(code[g, h, o, d]) * sf
    elif codec == FP8_ROW:
        sf = C.bf16_decode(scale[g, h, o, 0])
        for d in range(D):
            out[d] = C.fp8_decode(code[g, h, o, d]) * sf
    else:
        for grp in range(D // 16):
            sf = C.fp8_decode(scale[g, h, o, grp])
            for d in range(grp * 16, grp * 16 + 16, 2):
                byte = np.uint32(code[g, h, o, d >> 1])
                out[d] = C.fp4_decode(byte & np.uint32(15)) * sf
                out[d + 1] = C.fp4_decode(byte >> np.uint32(4)) * sf


def load_lane(codec, code, scale, g, h, o, d0, ne, out, lut8, lut4):  # noqa: ANN001
    """GPU lanes: ``ne`` consecutive dequantized elements from ``d0`` (inside one scale
    group, since ne <= 8 divides every group size), the scale decoded once, FP8/FP4 codes
    through small lookup tables (``lut8``: 256 E4M3 values, ``lut4``: 16 E2M1 values)."""
    if codec == BF16:
        for e in range(ne):
            out[e] = C.bf16_decode(code[g, h, o, d0 + e])
    elif codec == INT8_G64:
        sf = C.bf16_decode(scale[g, h, o, d0 >> 6])
        for e in range(ne):
            out[e] = np.float32(code[g, h, o, d0 + e]) * sf
    elif codec == FP8_ROW:
        sf = C.bf16_decode(scale[g, h, o, 0])
        for e in range(ne):
            out[e] = lut8[code[g, h, o, d0 + e]] * sf
    else:
        sf = lut8[scale[g, h, o, d0 >> 4]]
        if ne == 1:  # D = 32: one element a lane, the low or high nibble of its byte
            shift = 4 * (d0 & 1)
            out[0] = lut4[(code[g, h, o, d0 >> 1] >> shift) & 15] * sf
        else:        # an even count from an even d0: whole bytes
            for e in range(0, ne, 2):
                byte = code[g, h, o, (d0 + e) >> 1]
                out[e] = lut4[byte & 15] * sf
                out[e + 1] = lut4[byte >> 4] * sf


def for_target(fn, cpu: bool):  # noqa: ANN001, ANN201
    """The body compiled for the CPU (njit, inlined) or as a CUDA device function."""
    import numba

    if cpu:
        return numba.njit(twin(fn, C=codecs.CPU))
    from numba import cuda

    return cuda.jit(device=True)(twin(fn, C=codecs.gpu()))
