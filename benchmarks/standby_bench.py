"""What a standby costs the leader: boundary latency over gloo on two local processes, with
a plain follower and with a standby (``acks=``), measured in the same run. Prints medians and
ratios; asserts nothing about time.

    python benchmarks/standby_bench.py [--rounds 60]

Each round: a decode-like boundary (records that touch only an active sequence: nobody
waits), then a retained finish and a release (records that change what a reopen keeps: with
a standby the leader waits until it fsynced them and acknowledged). ``sync="commit"`` on both
sides, so the leader fsyncs those records itself too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer_kv import KVStore  # noqa: E402
from ninfer_kv.dist import Follower, Leader, shard_config  # noqa: E402
from ninfer_kv.dist.wire import receiver, sender  # noqa: E402
from tests.dist import workers as w  # noqa: E402


def worker(rank: int, port: int, out: str, standby: bool, rounds: int) -> None:
    w.init(rank, port)
    cfg = shard_config(w.config(host_bytes=1 << 22, sync="commit",
                                persist_dir=str(Path(out) / f"{int(standby)}{rank}")), 2)
    if rank == 0:
        store = KVStore.open(cfg)
        leader = Leader(store, sender([1]), acks=[receiver(1)] if standby else ())
        plain, durable = [], []
        for _ in range(rounds):
            s = store.activate(64, 1)
            store.ensure_mapped(s, "main", 64)
            t0 = time.perf_counter()
            with leader.boundary():
                pass
            plain.append(time.perf_counter() - t0)
            store.commit(s, "main", 64)
            ck = store.finish(s, retain=True)
            t0 = time.perf_counter()
            with leader.boundary():
                pass
            durable.append(time.perf_counter() - t0)
            store.release(ck)  # type: ignore[arg-type]
            with leader.boundary():
                pass
        leader.close()
        Path(out, f"{int(standby)}.json").write_text(json.dumps({
            "plain": statistics.median(plain), "durable": statistics.median(durable),
            "acked": leader.stats["acked"]}))
        store.close()
    else:
        f = (Follower.join(cfg, receiver(0), ack=sender([0])) if standby
             else Follower.join(dataclasses.replace(cfg, persist_dir=None), receiver(0)))
        f.run()
        f.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        res = {}
        for standby in (False, True):
            codes = w.launch(worker, out, standby, a.rounds)
            if codes != [0, 0]:
                raise SystemExit(f"ranks exited with {codes}")
            res[standby] = json.loads(Path(out, f"{int(standby)}.json").read_text())
    f, s = res[False], res[True]
    print(f"{a.rounds} rounds, medians, leader boundary latency")
    print(f"  decode boundary   follower {f['plain'] * 1e3:7.3f} ms   standby "
          f"{s['plain'] * 1e3:7.3f} ms   ratio {s['plain'] / f['plain']:5.2f}")
    print(f"  durable boundary  follower {f['durable'] * 1e3:7.3f} ms   standby "
          f"{s['durable'] * 1e3:7.3f} ms   ratio {s['durable'] / f['durable']:5.2f}"
          f"   ({s['acked']} acknowledged)")


if __name__ == "__main__":
    main()
