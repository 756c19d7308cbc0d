"""Compile every CUDA kernel to PTX for a compute capability without a GPU (CI runs this for
sm_90). The simulator accepts code a real GPU rejects, so this is the check that the kernels
are real CUDA. Needs NVRTC (``numba-cuda[cu13]``) and must run WITHOUT the simulator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from numba import types

from ninfer_kv.engine.layout import Profile, codec_planes
from ninfer_kv.kernels.append import side_codecs

_NB = {"uint16": types.uint16, "int8": types.int8, "uint8": types.uint8}


def _plane(dt: str) -> types.Array:
    return types.Array(_NB[dt], 4, "A")


def _planes(profile: Profile) -> tuple[types.Array, ...]:
    out = []
    for codec in profile.codecs:
        planes = codec_planes(codec, 128)
        out.append(_plane(str(planes[0][1]).split(".")[1]))
        out.append(_plane(str(planes[1][1]).split(".")[1]) if len(planes) > 1 else
                   _plane("uint16"))
    kc, ks, vc, vs = out
    return kc, ks, vc, vs


@contextlib.contextmanager
def _fake_device(cc: tuple[int, int]) -> Iterator[None]:
    """Nested device functions ask for the current device while compiling; answer for one."""
    import numba.cuda.dispatcher as disp

    class _Dev:
        compute_capability = cc

    with mock.patch.object(disp, "get_current_device", lambda: _Dev()):
        yield


def compile_all(cc: tuple[int, int] = (9, 0)) -> dict[str, int]:
    """{kernel/profile: PTX bytes} for every kernel and every profile."""
    from numba import cuda

    from ninfer_kv.kernels.append import _append_cuda
    from ninfer_kv.kernels.attention import _decode_cuda
    from ninfer_kv.kernels.copy import _copy2d_cuda, _copy_cuda
    from ninfer_kv.kernels.prefill_cuda import prefill_kernel

    i32, f32 = types.int32, types.float32
    a1 = types.Array(i32, 1, "A")
    a2 = types.Array(i32, 2, "A")
    f3 = types.Array(f32, 3, "A")
    f4 = types.Array(f32, 4, "A")
    out: dict[str, int] = {}
    with _fake_device(cc):
        for prof in Profile:
            kc, ks, vc, vs = _planes(prof)
            sig = (kc, ks, vc, vs, types.int64, types.int64, a2, a1, a1, f3, f3)
            ptx, _ = cuda.compile_ptx(_append_cuda().py_func, sig, cc=cc)
            out[f"append/{prof.value}"] = len(ptx)
            sig = (f3, kc, ks, vc, vs, types.int64, types.int64, a2, a1, a1, f32, types.int64,
                   f3, f3, f4)
            kid, vid = side_codecs(prof)
            for ne, ng in ((2, 1), (4, 4), (8, 8), (4, 3)):  # D = 64/128/256/128, heads
                ptx, _ = cuda.compile_ptx(_decode_cuda(ne, ng, kid, vid).py_func, sig, cc=cc)
            out[f"decode/{prof.value}"] = len(ptx)
            sig = (f3, kc, ks, vc, vs, types.int64, types.int64, a2, a1, a1, a1, a1, a1, a1,
                   f32, f3)
            for ne, ng in ((2, 1), (4, 4), (8, 8), (4, 2)):
                ptx, _ = cuda.compile_ptx(prefill_kernel(ne, ng, kid, vid).py_func, sig, cc=cc)
            out[f"prefill/{prof.value}"] = len(ptx)
        n1 = types.Array(types.int64, 1, "A")  # words per pair
        for unit in (types.int64, types.uint8):
            v4 = types.Array(unit, 4, "A")
            ptx, _ = cuda.compile_ptx(_copy_cuda().py_func, (v4, v4, a1, a1, n1), cc=cc)
            out[f"copy/{unit}"] = len(ptx)
        v2 = types.Array(types.int64, 2, "A")
        ptx, _ = cuda.compile_ptx(_copy2d_cuda().py_func, (v2, v2, a1, a1, types.int64), cc=cc)
        out["copy2d/int64"] = len(ptx)
    return out


if __name__ == "__main__":  # pragma: no cover
    for name, n in compile_all().items():
        print(f"{name:32s} {n:8d} bytes of PTX")
