"""SIGKILL the store at random moments while it serves the trace with offload and
persistence on; nothing acknowledged may be lost or served corrupt (benchmarks/crash_soak.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from crash_soak import soak  # noqa: E402

from ninfer_kv.tools.simulate import DEFAULT_TRACE  # noqa: E402

KILLS = int(os.environ.get("NINFER_KV_SOAK_KILLS", "100"))


def test_crash_soak(tmp_path: Path) -> None:
    t = soak(KILLS, str(DEFAULT_TRACE), str(tmp_path / "store"), seed=1, log=False)
    assert t["kills"] == KILLS
    assert t["acknowledged"] >= KILLS  # the children did real work between kills
    assert (t["lost"], t["corrupt_served"], t["violations"]) == (0, 0, 0), t
