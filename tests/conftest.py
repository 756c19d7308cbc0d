"""Test-wide set-up. The CUDA kernels run under numba's simulator in CI (no GPU): the switch
must be set before numba is first imported. NINFER_KV_CUDA=real keeps the real CUDA target
(for running the suite on a GPU machine)."""

import os

if os.environ.get("NINFER_KV_CUDA") != "real":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
