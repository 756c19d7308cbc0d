"""First-call cost of the CPU kernels in a fresh process: cold (nothing cached: numba
compiles) and warm (a second process loads the machine code the first one cached,
kernels/jit.py). Each process times ``warmup`` per profile, then one more ``paged_decode``
call. Prints seconds and the cold/warm ratio; asserts nothing.

    python benchmarks/jit_bench.py [--profiles bf16,int8-g64,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from ninfer_kv.kernels.warmup import warmup
t1 = time.perf_counter()
per = warmup(sys.argv[1].split(","))
print(json.dumps({"import": t1 - t0, "profiles": per}))
"""


def child(cache: str, profiles: str) -> dict:
    env = {**os.environ, "NINFER_KV_JIT_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", CHILD, profiles], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", default="bf16,int8-g64,fp8-e4m3fn-row256,nvfp4-g16,k8v4")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ninfer-jit-") as cache:
        cold = child(cache, a.profiles)
        warm = child(cache, a.profiles)
    print(f"{'profile':>20} {'cold s':>8} {'warm s':>8} {'ratio':>7}")
    for p, c in cold["profiles"].items():
        w = warm["profiles"][p]
        print(f"{p:>20} {c:8.2f} {w:8.3f} {c / w:7.0f}x")
    tc, tw = sum(cold["profiles"].values()), sum(warm["profiles"].values())
    print(f"{'all (first call)':>20} {tc:8.2f} {tw:8.3f} {tc / tw:7.0f}x   "
          f"(import ninfer_kv.kernels: {cold['import']:.2f} s / {warm['import']:.2f} s)")


if __name__ == "__main__":
    main()
