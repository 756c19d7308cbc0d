"""SIGKILL the store at random moments while it serves the trace with offload and
persistence on; nothing acknowledged may be lost or served corrupt (benchmarks/crash_soak.py).

The soak forks its children from a warm parent, which needs a process whose thread pools it
controls (numba's fork-safe threading layer, one torch thread): it runs as its own script,
not inside the pytest process. ``NINFER_KV_SOAK_KILLS`` sets the number of kills."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "crash_soak.py"
KILLS = int(os.environ.get("NINFER_KV_SOAK_KILLS", "50"))
VERDICT = re.compile(r"kills=(\d+) acknowledged=(\d+) lost=(\d+) corrupt_served=(\d+) "
                     r"violations=(\d+)")


def test_crash_soak(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kills", str(KILLS), "--seed", "1",
                           "--dir", str(tmp_path / "store")],
                          capture_output=True, text=True, env=env, timeout=600)
    report = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    lines = proc.stdout.strip().splitlines()
    m = VERDICT.fullmatch(lines[-1]) if lines else None
    assert m is not None, report
    kills, acknowledged, lost, corrupt, violations = map(int, m.groups())
    assert kills == KILLS, report
    assert acknowledged >= KILLS, report  # the children did real work between kills
    assert (lost, corrupt, violations) == (0, 0, 0), report
    assert proc.returncode == 0, report  # no child died by itself (an exception)
