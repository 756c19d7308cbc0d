"""Every CUDA kernel compiles to PTX for sm_90 (the simulator accepts code a GPU rejects)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_cuda_kernel_compiles_to_ptx_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-m", "ninfer_kv.kernels.ptx"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    names = {line.split()[0] for line in out.stdout.splitlines() if "bytes of PTX" in line}
    for prof in ("bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"):
        assert {f"append/{prof}", f"decode/{prof}", f"prefill/{prof}"} <= names
    assert {"copy/int64", "copy/uint8", "copy2d/int64"} <= names
