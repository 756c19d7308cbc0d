"""Target selection: CUDA tensors -> numba.cuda kernels on torch's current stream; CPU tensors
-> numba CPU kernels (njit, parallel). Host and pinned buffers always come from torch.

``twin(fn, **names)`` clones a plain Python function with some globals rebound (e.g. ``C`` to
the CPU or GPU codec module), so one source body is compiled for both targets.

Under ``NUMBA_ENABLE_CUDASIM=1`` the CUDA kernels run in numba's simulator on CPU tensors'
numpy views (``simulate=True`` in the launch helpers) — that is how CI runs them.
"""

from __future__ import annotations

import functools
from types import FunctionType
from typing import Any

import numba
import numpy as np
import torch

WARPS = 4
THREADS = 32 * WARPS
MAXG = 8
"""Query heads per KV head handled by one CUDA block (more -> more blocks)."""
MAXE = 8
MAXD = 32 * MAXE
"""Head-dim elements per lane (D <= 256)."""


def twin(fn: FunctionType, **names: Any) -> FunctionType:
    g = dict(fn.__globals__)
    g.update(names)
    return FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


def cuda_head_dim_ok(d: int) -> bool:
    """CUDA lanes hold ``d / 32`` consecutive elements inside one scale group (groups of 16
    and 64): so ``d / 32`` must be 1, 2, 4 or 8 (D = 32, 64, 128, 256)."""
    return d in (32, 64, 128, 256)


def simulator() -> bool:
    return bool(numba.config.ENABLE_CUDASIM)


def is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def np_view(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (bf16 -> uint16 bits)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.numpy()


def dev_view(t: torch.Tensor) -> Any:
    """The array a kernel receives: a numba device array for CUDA tensors, else numpy."""
    if is_cuda(t):
        from numba import cuda

        if t.dtype == torch.bfloat16:
            t = t.view(torch.uint16)
        try:
            return cuda.as_cuda_array(t.detach())
        except (TypeError, ValueError, KeyError):
            if t.dtype != torch.uint16:
                raise
            # a torch without uint16 in __cuda_array_interface__: same bits as int16 (the
            # codecs take the low 16 bits, so sign extension is harmless)
            return cuda.as_cuda_array(t.detach().view(torch.int16))
    return np_view(t)


@functools.cache
def _dummy(device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((1, 1, 1, 1), dtype=dtype, device=device)


def scale_or_dummy(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """BF16 planes have no scale plane; kernels get a 1-element stand-in of a fixed dtype."""
    return t if t is not None else _dummy(str(like.device), torch.uint16)


def launch(kernel: Any, grid: tuple[int, ...], block: int, *args: Any) -> None:
    """Launch a numba.cuda kernel on torch's current stream (a no-op stream in the simulator)."""
    from numba import cuda

    if simulator():
        # wrap host arrays as simulated device arrays (no copy, strided views allowed)
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        args = tuple(FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in args)
        kernel[grid, block](*args)
        return
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    kernel[grid, block, stream](*args)


def use_cuda_kernels(*tensors: torch.Tensor, force_sim: bool = False) -> bool:
    """CUDA kernels for CUDA tensors; in the simulator also for CPU tensors when forced."""
    if any(is_cuda(t) for t in tensors):
        return True
    return force_sim and simulator()
