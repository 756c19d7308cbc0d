"""Independent numpy references for the codecs (ml_dtypes is the oracle) and for attention."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
FP4 = ml_dtypes.float4_e2m1fn


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(BF16).view(np.uint16)


def bf16_val(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(BF16).astype(np.float32)


def fp8_bits(x: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -448, 448).astype(FP8).view(np.uint8)


def fp8_val(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, np.uint8).view(FP8).astype(np.float32)


def fp4_bits(x: np.ndarray) -> np.ndarray:
    return np.clip(np.asarray(x, np.float32), -6, 6).astype(FP4).view(np.uint8)


def fp4_val(nib: np.ndarray) -> np.ndarray:
    return np.asarray(nib, np.uint8).view(FP4).astype(np.float32)


def _amax(g: np.ndarray, axis: int | None = None) -> np.ndarray:
    """|g|'s max with NaN elements not raising it (docs/codecs.md): 0 for an all-NaN group."""
    return np.where(np.isnan(g), np.float32(0), np.abs(g)).max(axis)


def encode_row(codec: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(codes, scales) of one row, as docs/codecs.md defines them (a NaN element: FP8 code
    0x7F, INT8 and FP4 code 0; it does not raise its group's scale)."""
    x = np.asarray(x, np.float32)
    if codec == "bf16":
        return bf16_bits(x), None
    if codec == "int8-g64":
        g = x.reshape(-1, 64)
        s = bf16_bits(_amax(g, 1) / np.float32(127))
        sv = bf16_val(s)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where((sv == 0) | np.isnan(g), 0, g / sv).astype(np.float32)
        return np.clip(np.rint(v), -127, 127).astype(np.int8).reshape(-1), s
    if codec == "fp8-e4m3fn-row256":
        s = bf16_bits(np.array([_amax(x) / np.float32(448)], np.float32))
        sv = bf16_val(s)[0]
        v = (x / sv).astype(np.float32) if sv != 0 else np.where(np.isnan(x), x, 0)
        return fp8_bits(v), s
    g = x.reshape(-1, 16)
    s = fp8_bits(np.minimum(_amax(g, 1) / np.float32(6), np.float32(448)))
    sv = fp8_val(s)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where((sv == 0) | np.isnan(g), 0, g / sv).astype(np.float32)
    nib = fp4_bits(v).reshape(-1)
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8), s


def decode_row(codec: str, code: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    if codec == "bf16":
        return bf16_val(code)
    if codec == "int8-g64":
        return (code.astype(np.float32).reshape(-1, 64) * bf16_val(scale)[:, None]).reshape(-1)
    if codec == "fp8-e4m3fn-row256":
        return fp8_val(code) * bf16_val(scale)[0]
    nib = np.stack([code & 15, code >> 4], -1).reshape(-1)
    return (fp4_val(nib).reshape(-1, 16) * fp8_val(scale)[:, None]).reshape(-1)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 softmax attention of one query row set: q[Hq, D], k/v[T, H, D] -> [Hq, D]."""
    hq, d = q.shape
    grp = hq // k.shape[1]
    kk = k.double().repeat_interleave(grp, 1).permute(1, 0, 2)  # [Hq, T, D]
    vv = v.double().repeat_interleave(grp, 1).permute(1, 0, 2)
    w = torch.softmax((kk @ q.double().unsqueeze(-1)).squeeze(-1) / math.sqrt(d), -1)
    return (w.unsqueeze(-1) * vv).sum(1)
