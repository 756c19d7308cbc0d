"""Reopen cost of a long journal: from a recent snapshot, the old way (scan every segment, then
the snapshot), and with no snapshot (replay everything). Prints seconds and ratios; asserts
nothing.

The journal is written by the store itself: ``--seqs`` sequences decode one token per round,
each finishing and restarting after ``--life`` tokens, until ``--events`` events were journaled;
a snapshot is taken ``--tail`` records before the end.

    python benchmarks/recovery_bench.py [--events 1000000] [--seqs 16] [--tail 1000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.opening import _apply_record
from ninfer_kv.engine.state import StoreState, decode_state
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.log import SyncPolicy
from ninfer_kv.journal.recovery import scan
from ninfer_kv.journal.restore import recover_state


def config(d: str, seqs: int, life: int) -> StoreConfig:
    ctx = 64 + life
    return StoreConfig(model=ModelGeometry(layers=1, kv_heads=1, head_dim=64),
                       serving=ServingConfig(max_context=ctx, max_concurrency=seqs),
                       kv_tokens=seqs * -(-ctx // 64) * 64, journal_dir=d, sync=SyncPolicy.OFF,
                       allocate_planes=False)


def build(d: str, events: int, seqs: int, life: int, tail: int) -> int:
    s = KVStore.open(config(d, seqs, life))
    ids = np.array([s.activate(64, life) for _ in range(seqs)])
    s.ensure_mapped_many("main", ids, [64] * seqs)
    with s.boundary():
        pass
    s.commit_many("main", ids, [64] * seqs)
    front = np.full(seqs, 64)
    snapped = False
    while s.stats["events"] < events:
        if not snapped and s.stats["events"] >= events - tail * 2:
            s.snapshot()
            snapped = True
        s.ensure_mapped_many("main", ids, front + 1)
        with s.boundary():
            pass
        front += 1
        s.commit_many("main", ids, front)
        if front[0] >= 64 + life:  # all finish together; fresh ones take their rows
            for b in ids.tolist():
                s.finish(b)
            ids = np.array([s.activate(64, life) for _ in range(seqs)])
            s.ensure_mapped_many("main", ids, [64] * seqs)
            with s.boundary():
                pass
            s.commit_many("main", ids, [64] * seqs)
            front[:] = 64
    n = s.stats["events"]
    s.close()
    return n


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--life", type=int, default=512)
    ap.add_argument("--tail", type=int, default=1000, help="records after the snapshot")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="ninfer-recovery-")
    d = os.path.join(root, "j")
    try:
        t = time.perf_counter()
        n = build(d, a.events, a.seqs, a.life, a.tail)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"journal: {n:,} events, {size / 1e6:.1f} MB, {len(os.listdir(d))} files "
              f"(built in {time.perf_counter() - t:.1f} s)")
        cfg = config(d, a.seqs, a.life)

        def reopen() -> None:
            KVStore.open(cfg).close()

        def old_way() -> None:  # scan every segment first, then load the snapshot
            res = scan(d, schema_major=CODEC.schema[0], repair=False)
            recover_state(d, schema_major=CODEC.schema[0], initial=StoreState,
                          load_snapshot=decode_state, apply_record=_apply_record,
                          scan_result=res, repair=False)

        fast = min(timed(reopen) for _ in range(3))
        old = min(timed(old_way) for _ in range(3))
        for f in os.listdir(d):
            if f.startswith("snap-"):
                os.remove(os.path.join(d, f))
        full = timed(reopen)
        print(f"reopen from the snapshot:            {fast:8.3f} s")
        print(f"scan all, then the snapshot (before): {old:8.3f} s   ratio {old / fast:6.1f}x")
        print(f"no snapshot, replay all:              {full:8.3f} s   ratio {full / fast:6.1f}x"
              f"   ({n / full:,.0f} events/s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
