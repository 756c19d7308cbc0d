"""Replay throughput: plain replay vs ``--verify`` (invariants after every event), and plain
replay vs the same replay event by event (the loop before compiled stretches of decode rounds,
replay/plain.py: it still runs when a caller asks to stop after N events).

Verify-every-event runs the incremental checker (``engine.incremental``) after each event and
the full ``violations()`` every ``--full-every`` events and at the end. Goal: verify runs at
>= 50% of plain replay's events/s. Prints both rates and their ratio (best of ``--repeat``).

    python benchmarks/verify_bench.py --dir /tmp/sim1000/journal
    python benchmarks/verify_bench.py --requests 1000      # builds the journal with simulate
    python benchmarks/verify_bench.py --dir D --old        # also time the full check per event
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from ninfer_kv.replay import replay


def build_journal(requests: int, out: Path, extra: list[str]) -> Path:
    """A Mooncake-trace journal of ``requests`` requests (``ninfer-kv simulate``)."""
    journal = out / "journal"
    cmd = [sys.executable, "-m", "ninfer_kv.tools.cli", "simulate", "--limit", str(requests),
           "--journal", str(journal), "--json", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return journal


def best_rates(directory: str, repeat: int, **verify: object
               ) -> tuple[float, float, float, int, int]:
    """(best plain events/s, best event-by-event events/s, best verify events/s, events,
    violation reports): the replays alternate, so load from other processes hits all alike."""
    plain = by_event = checked = 0.0
    events = found = 0
    for _ in range(repeat):
        r = replay(directory)
        plain, events = max(plain, r.events_per_s), r.events
        one = replay(directory, until_event=1 << 62)  # the loop of each event in Python
        assert one.digest == r.digest
        by_event = max(by_event, one.events_per_s)
        r = replay(directory, verify_every=1, **verify)  # type: ignore[arg-type]
        checked, found = max(checked, r.events_per_s), len(r.violations)
    return plain, by_event, checked, events, found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="journal directory (default: build one with simulate)")
    ap.add_argument("--requests", type=int, default=1000, help="requests to simulate")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--full-every", type=int, default=None, help="full check every N events")
    ap.add_argument("--old", action="store_true",
                    help="also time the full check after every event (slow: ~100 events/s)")
    ap.add_argument("--old-events", type=int, default=2000, help="events for --old")
    ap.add_argument("sim_args", nargs="*", help="extra simulate flags after --, e.g. -- --mtp")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = a.dir or str(build_journal(a.requests, Path(tmp), a.sim_args))
        plain, by_event, verify, n, found = best_rates(directory, a.repeat,
                                                       full_every=a.full_every)
        print(f"journal   {directory}  ({n} events)")
        print(f"plain     {plain:>12,.0f} events/s  (decode rounds in compiled stretches)")
        print(f"by event  {by_event:>12,.0f} events/s  (each event decoded and applied; "
              f"plain / this = {plain / by_event:.2f})")
        print(f"verify    {verify:>12,.0f} events/s  (incremental after every event; "
              f"{found} violation reports)")
        print(f"ratio     {verify / plain:>12.3f}  (goal >= 0.5)")
        if a.old:
            r = replay(directory, verify_every=1, incremental=False, until_event=a.old_events)
            print(f"old full  {r.events_per_s:>12,.0f} events/s  (full check after every event, "
                  f"first {r.events} events)")


if __name__ == "__main__":
    main()
