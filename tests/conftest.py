"""Test-wide set-up. The CUDA kernels run under numba's simulator in CI (no GPU): the switch
must be set before numba is first imported. NINFER_KV_CUDA=real keeps the real CUDA target
(for running the suite on a GPU machine)."""

import os

if os.environ.get("NINFER_KV_CUDA") != "real":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest


def _atomic_simulator_shared_arrays() -> None:
    """numba's CUDA simulator hands each thread of a block its shared array by call site
    (file, line) with a check-then-insert on a dict: two threads that interleave between the
    check and the insert get *different* arrays, so a block's threads no longer share memory
    and a kernel that is correct on a GPU computes garbage. The default 5 ms GIL switch
    interval made that rare (a thread rarely lost the GIL inside ``array``); the short one
    below makes it frequent. The same lookup under a lock, keyed the same way."""
    try:
        from numba.core import types
        from numba.cuda.simulator import kernelapi
        from numba.np import numpy_support
    except ImportError:  # no simulator in this numba: nothing to fix
        return
    cls = kernelapi.FakeCUDAShared
    original = cls.array
    lock = threading.Lock()

    def array(self: Any, shape: Any, dtype: Any, alignment: Any = None) -> Any:
        if shape == 0 or alignment is not None:  # dynamic shared memory, refusals: numba's
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        f = sys._getframe(1)
        caller = (f.f_code.co_filename, f.f_lineno)  # numba's key: the caller's file, line
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    cls.array = array


_atomic_simulator_shared_arrays()


@pytest.fixture(autouse=True)
def _short_gil_switch_interval() -> Iterator[None]:
    """numba's CUDA simulator runs each GPU thread of a block as a Python thread while its
    own loop polls them holding the GIL, so a thread waiting at a barrier gets the GIL only
    when the poller's switch interval (5 ms) runs out: a block of 64-128 threads then took
    0.5 s per barrier, and one simulated kernel test went from 4 s to 340 s depending on how
    the threads happened to interleave (seen in full runs here). A 200 µs interval bounds
    that wait; single-threaded tests never switch, so nothing else changes."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(2e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)
