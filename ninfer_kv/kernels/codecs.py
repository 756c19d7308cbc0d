"""Scalar codecs, written once as plain Python over float32 bit patterns and compiled for both
targets: ``CPU.<name>`` (numba njit, inlined) and ``GPU.<name>`` (numba.cuda device
functions). The exact persistent format is docs/codecs.md (codec format version 1).

Only integer operations on the float32 bit pattern decide rounding, so both targets (and the
CUDA simulator, which runs these as plain Python over numpy scalars) agree bit for bit.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np

from ninfer_kv.kernels import jit

CODEC_VERSION = 1

# codec ids used by the kernels (one per side: K and V)
BF16, INT8_G64, FP8_ROW, NVFP4_G16 = 0, 1, 2, 3

FP8_MAX = 448.0
FP4_MAX = 6.0
INT8_MAX = 127.0


def f32_bits(x: float) -> int:
    return np.float32(x).view(np.uint32)


def bits_f32(b: int) -> float:
    return np.uint32(b).view(np.float32)


def rne_shift(x: int, s: int) -> int:
    """Round-to-nearest-even of x / 2**s for s >= 1 (x >= 0)."""
    return (x + (np.uint32(1) << np.uint32(s - 1)) - np.uint32(1)
            + ((x >> np.uint32(s)) & np.uint32(1))) >> np.uint32(s)


# --- BF16 ------------------------------------------------------------------------------------------
def bf16_encode(x: float) -> int:
    """float32 -> bf16 bits, round-to-nearest-even; NaN -> sign|0x7FC0; no FP16 step."""
    b = f32_bits(x)
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((b >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0))
    return np.uint16(rne_shift(b, 16))


def bf16_decode(h: int) -> float:
    return bits_f32(np.uint32(h) << np.uint32(16))


# --- minifloats (E4M3FN, E2M1) -------------------------------------------------------------------
def minifloat_encode(a: int, mbits: int, bias: int) -> int:
    """|x| bits (finite, already clamped to the format's max) -> exponent|mantissa code, RNE."""
    exp = np.int32(a >> np.uint32(23))
    if exp == 0:
        return np.uint32(0)  # float32 subnormals are far below half the smallest code
    e = exp - 127
    emin = 1 - bias
    shift = 23 - mbits
    if e >= emin:  # normal in the target: rebias, round (carry may bump the exponent)
        t = a - np.uint32((127 - bias) << 23)
        return rne_shift(t, shift)
    total = shift + (emin - e)
    if total > 25:
        return np.uint32(0)
    m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
    return rne_shift(m, total)


def fp8_encode(x: float) -> int:
    """float32 -> E4M3FN bits. Saturates to ±448 (no inf in E4M3FN); NaN -> sign|0x7F."""
    b = f32_bits(x)
    sign = (b >> np.uint32(24)) & np.uint32(0x80)
    a = b & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):
        return np.uint8(sign | np.uint32(0x7F))
    if a >= np.uint32(0x43E00000):  # >= 448.0
        return np.uint8(sign | np.uint32(0x7E))
    return np.uint8(sign | minifloat_encode(a, 3, 7))


def fp8_decode(c: int) -> float:
    c = np.uint32(c)
    e = (c >> np.uint32(3)) & np.uint32(0xF)
    m = c & np.uint32(7)
    if e == np.uint32(15) and m == np.uint32(7):
        v = np.float32(math.nan)
    elif e == 0:
        v = np.float32(m) * np.float32(0.001953125)  # m * 2**-9
    else:
        v = bits_f32(((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20)))
    if c & np.uint32(0x80):
        return -v
    return v


def fp4_encode(x: float) -> int:
    """float32 -> E2M1 nibble. Saturates to ±6; NaN -> +0 (documented; no NaN in E2M1)."""
    b = f32_bits(x)
    sign = (b >> np.uint32(28)) & np.uint32(0x8)
    a = b & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):
        return np.uint8(0)
    if a >= np.uint32(0x40C00000):  # >= 6.0
        return np.uint8(sign | np.uint32(7))
    return np.uint8(sign | minifloat_encode(a, 1, 1))


def fp4_decode(n: int) -> float:
    n = np.uint32(n)
    e = (n >> np.uint32(1)) & np.uint32(3)
    m = n & np.uint32(1)
    if e == 0:
        v = np.float32(m) * np.float32(0.5)
    else:
        v = bits_f32(((e + np.uint32(126)) << np.uint32(23)) | (m << np.uint32(22)))
    if n & np.uint32(8):
        return -v
    return v


# --- INT8 ---------------------------------------------------------------------------------------
def int8_encode(v: float) -> int:
    """Scaled value -> int8: round half to even, clamp to ±127; NaN -> 0."""
    if v != v:
        return np.int8(0)
    if v >= INT8_MAX:
        return np.int8(127)
    if v <= -INT8_MAX:
        return np.int8(-127)
    d = np.float64(v)  # in float64 the sum and the tie test are exact: in float32 the
    r = math.floor(d + 0.5)  # largest value below 0.5 rounded up to 1.0 (numpy and numba,
    if r - d == 0.5 and (np.int64(r) & 1) != 0:  # CPU and the simulator, disagreed on the tie)
        r -= 1.0
    if r > INT8_MAX:
        r = INT8_MAX
    if r < -INT8_MAX:
        r = -INT8_MAX
    return np.int8(r)


# --- scales ----------------------------------------------------------------------------------------
def bf16_scale(amax: float, qmax: float) -> int:
    """16-bit (bf16) scale = RNE(amax / qmax); 0 when the group is all zero."""
    return bf16_encode(np.float32(amax) / np.float32(qmax))


def fp8_scale(amax: float) -> int:
    """NVFP4 block scale: E4M3(amax / 6), clamped to 448."""
    s = np.float32(amax) / np.float32(FP4_MAX)
    if s > np.float32(FP8_MAX):
        s = np.float32(FP8_MAX)
    return fp8_encode(s)


def quant_div(x: float, s: float) -> float:
    """x / s, or 0 when the scale decoded to zero (an all-zero or underflowing group) — a
    NaN element stays NaN (its codec's NaN rule applies, as in a group with a scale)."""
    if s == np.float32(0.0):
        return np.float32(x) if x != x else np.float32(0.0)
    return np.float32(x) / np.float32(s)


_SCALARS = (f32_bits, bits_f32, rne_shift, bf16_encode, bf16_decode, minifloat_encode, fp8_encode,
            fp8_decode, fp4_encode, fp4_decode, int8_encode, bf16_scale, fp8_scale, quant_div)


def _compile_all(decorator, name: str) -> ModuleType:
    """Compile every scalar with ``decorator``; later ones see the compiled earlier ones. The
    result is a module object, so jitted code can say ``CPU.fp8_encode(x)``."""
    ns = ModuleType(f"{__name__}.{name}")
    g = dict(globals())
    for fn in _SCALARS:
        clone = type(fn)(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
        compiled = decorator(clone)
        g[fn.__name__] = compiled
        setattr(ns, fn.__name__, compiled)
    return ns


CPU = _compile_all(jit.njit(), "cpu")


def _gpu() -> ModuleType:
    from numba import cuda

    return _compile_all(cuda.jit(device=True, inline=True), "gpu")


_GPU: ModuleType | None = None


def gpu() -> ModuleType:
    """CUDA device-function twins (built on first use: importing numba.cuda is not free)."""
    global _GPU
    if _GPU is None:
        _GPU = _gpu()
    return _GPU
