"""kill -9 at random moments: every acknowledged record survives, exactly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from ninfer_kv.journal.reader import JournalReader
from tests.journal.kill_child import record

ROOT = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("NINFER_KV_KILLS", "50"))


def test_kill9_loses_no_acknowledged_record(tmp_path: Path) -> None:
    rng = random.Random(99)
    acked = 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(KILLS):
        child = subprocess.Popen([sys.executable, "-m", "tests.journal.kill_child", str(tmp_path)],
                                 cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        first = child.stdout.readline()  # wait until it is appending
        assert first.strip(), "child produced no acknowledgement"
        time.sleep(rng.uniform(0, 0.05))
        os.kill(child.pid, signal.SIGKILL)
        rest, _ = child.communicate()
        lines = [first, *rest.splitlines()]
        acked = max([acked, *(int(x) for x in lines if x.strip())])
        reader = JournalReader(str(tmp_path))
        assert reader.last_seq >= acked
        got = dict(reader.records())
        assert sorted(got) == list(range(1, reader.last_seq + 1))
    for seq, events in got.items():
        assert events == record(seq)
    assert acked >= KILLS
