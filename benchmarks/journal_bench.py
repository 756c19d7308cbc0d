"""Journal throughput on this machine: appends per sync policy and batch size, decode rate,
bytes per event. Prints numbers; asserts nothing about time.

    python benchmarks/journal_bench.py [--records N]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from ninfer_kv.journal.events import CODEC, CommitFrontiers, Materialize, pack
from ninfer_kv.journal.log import Journal, JournalOptions, SyncPolicy
from ninfer_kv.journal.reader import JournalReader


def make_batch(n: int, seq: int) -> list:
    """n hot-path events: array-valued Materialize/CommitFrontiers of 4 sequences each."""
    ids = pack([seq, seq + 1, seq + 2, seq + 3])
    out: list = []
    for i in range(n):
        if i % 2:
            out.append(CommitFrontiers("main", ids, pack([seq * 64 + i] * 4)))
        else:
            out.append(Materialize("main", ids, ids, ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=2000)
    a = ap.parse_args()
    print(f"{'policy':>9} {'batch':>6} {'records/s':>12} {'events/s':>12} {'bytes/event':>12}")
    for policy in SyncPolicy:
        for bs in (1, 64, 1024):
            n = max(20, a.records // max(1, bs // 16))
            if policy is SyncPolicy.COMMIT:
                n = min(n, 1000)
            batches = [make_batch(bs, s) for s in range(8)]
            with tempfile.TemporaryDirectory() as d:
                j = Journal.open(d, CODEC, JournalOptions(sync=policy, interval_ms=10))
                t0 = time.perf_counter()
                for s in range(n):
                    j.append(batches[s % 8])
                j.sync()
                dt = time.perf_counter() - t0
                per_event = j.bytes_written / (n * bs)
                j.close()
            print(f"{policy.value:>9} {bs:>6} {n / dt:>12,.0f} {n * bs / dt:>12,.0f} "
                  f"{per_event:>12.1f}")
    with tempfile.TemporaryDirectory() as d:
        j = Journal.open(d, CODEC, JournalOptions(sync=SyncPolicy.OFF))
        batch = make_batch(1024, 7)
        for _ in range(500):
            j.append(batch)
        j.close()
        r = JournalReader(d)
        t0 = time.perf_counter()
        count = 0
        for _seq, _i, _ev in r.events():
            count += 1
        dt = time.perf_counter() - t0
        print(f"decode: {count:,} events in {dt * 1e3:.0f} ms = {count / dt:,.0f} events/s "
              f"({r.bytes / count:.1f} bytes/event on disk)")
        t0 = time.perf_counter()
        entries = 0
        wide = [CommitFrontiers("main", pack(range(256)), pack(range(256)))]
        with tempfile.TemporaryDirectory() as d2:
            j = Journal.open(d2, CODEC, JournalOptions(sync=SyncPolicy.OFF))
            for _ in range(5000):
                j.append(wide)
                entries += 256
            j.close()
        dt = time.perf_counter() - t0
        print(f"commit round of 256 sequences (one event): {5000 / dt:,.0f} rounds/s, "
              f"{dt / entries * 1e9:.0f} ns per sequence-entry appended")


if __name__ == "__main__":
    main()
