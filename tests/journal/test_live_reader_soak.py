"""The live-reader soak (benchmarks/live_reader_soak.py) as a test: a real writer process
races the reader. It runs the store in a subprocess, which a mutant of this process never
reaches, so the mutation check leaves it out (``SLOW``); tests/journal/test_live_reader.py
holds each rule deterministically. ``NINFER_KV_LIVE_READER_REQUESTS`` sets its length."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOAK_REQUESTS = int(os.environ.get("NINFER_KV_LIVE_READER_REQUESTS", "150"))
VERDICT = re.compile(r"reads=(\d+) failed=(\d+) checked=(\d+) mismatched=(\d+) "
                     r"writer_records=(\d+) writer_rc=(-?\d+)")


def test_soak_beside_a_live_writer(tmp_path: Path) -> None:
    """The real race (benchmarks/live_reader_soak.py): a writer process serves the trace with
    small segments, snapshots and compactions while this one reads and replays its journal
    over and over. Before readers captured one view, a 150-request run failed a few reads
    ("cannot read seg-…/snap-…: No such file")."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "live_reader_soak.py"),
                           "--requests", str(SOAK_REQUESTS), "--dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    report = f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    m = VERDICT.fullmatch(lines[-1]) if lines else None
    assert m is not None, report
    reads, failed, checked, mismatched, records, rc = map(int, m.groups())
    assert (failed, mismatched, rc) == (0, 0, 0), report
    assert reads > 10 and checked > 0 and records > 100, report  # it raced a real writer
    assert proc.returncode == 0, report
