"""Crash soak: SIGKILL a store that is serving the Mooncake trace with host offload and
persistence on, reopen it, and check that nothing acknowledged was lost or corrupted.

The child drives the store (root activations and Forks from its own retained checkpoints),
writes a deterministic payload for every token (byte = f(position, plane, head), so any
checkpoint's expected bytes are known without the child), retains each finished request,
offloads it, and prints ``ACK <id>`` after its publish record was synced. Before releasing a
checkpoint it prints ``REL <id>``. The parent kills the child at random moments, reopens the
store and asserts: every acknowledged, unreleased checkpoint is present with byte-identical
committed payload (recomputed from the arena, not trusted from the journal), invariants hold,
and no host extent leaked (free + live == capacity). Last line::

    kills=N acknowledged=A lost=0 corrupt_served=0 violations=0

    python benchmarks/crash_soak.py --kills N [--trace FILE] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ninfer_kv.engine.capacity import ModelGeometry, ServingConfig
from ninfer_kv.engine.layout import P, PlaneOrder
from ninfer_kv.engine.store import KVStore, StoreConfig
from ninfer_kv.journal.log import SyncPolicy
from ninfer_kv.tools.simulate import DEFAULT_TRACE, load_trace

ROOT = Path(__file__).resolve().parents[1]


def config(directory: str) -> StoreConfig:
    return StoreConfig(model=ModelGeometry(layers=1, kv_heads=2, head_dim=64),
                       serving=ServingConfig(max_context=2048, max_concurrency=4),
                       kv_tokens=2048 * 3, persist_dir=directory, host_bytes=48 << 20,
                       sync=SyncPolicy.OFF, snapshot_every=100)


def pattern(positions: torch.Tensor, plane: int, heads: int) -> torch.Tensor:
    """[H, n] payload bytes of these positions in one plane."""
    h = torch.arange(heads).view(-1, 1)
    return ((positions.view(1, -1) * 31 + plane * 7 + h * 13) & 0xFF).to(torch.uint8)


def write_tokens(store: KVStore, seq: int, start: int, end: int) -> None:
    """The GPU unit: write the deterministic payload of positions [start, end)."""
    pd = store.device.pools["main"]
    row = store.space(seq).row
    planes = store.device.planes("main")
    pos = start
    while pos < end:
        blk = pos // P
        stop = min(end, (blk + 1) * P)
        g = int(pd.block_tables[row, blk])
        positions = torch.arange(pos, stop)
        for k, t in enumerate(planes):
            v = t.view(torch.uint8)  # [N, H, P, X*isz]
            v[g, :, pos % P:pos % P + (stop - pos), :] = \
                pattern(positions, k, t.shape[1]).unsqueeze(-1)
        pos = stop


def check_checkpoint(store: KVStore, ck: int) -> str | None:
    """Recompute the expected committed bytes of every page from the arena."""
    st = store.state
    pool = st.pools["main"]
    planes = store.device.planes("main")
    page_bytes = next(s.page_bytes for s in st.pool_specs if s.name == "main")
    for b, slot in enumerate(store.space(ck).members):
        pg = pool.pages[slot]
        if pg is None or pg.host is None:
            return f"block {b} has no host replica"
        data = store.arena.data[pg.host[0]:pg.host[0] + page_bytes]  # type: ignore[union-attr]
        off = 0
        for k, t in enumerate(planes):
            h, xb = t.shape[1], t.shape[3] * t.element_size()
            region = data[off:off + h * P * xb].view(h, P, xb)[:, :pg.committed, :]
            want = pattern(torch.arange(b * P, b * P + pg.committed), k, h).unsqueeze(-1)
            if not torch.equal(region, want.expand_as(region)):
                return f"block {b} plane {k}: payload differs"
            off += h * P * xb
    return None


def child(directory: str, trace: str, seed: int) -> None:
    rng = random.Random(seed)
    store = KVStore.open(config(directory))
    assert store.device.pools["main"].geometry.order is PlaneOrder.PAGE_MAJOR
    reqs = load_trace(trace)
    mine: list[tuple[int, int]] = []  # (checkpoint, committed) retained by this child
    i = rng.randrange(len(reqs))
    while True:
        r = reqs[i % len(reqs)]
        i += 1
        prompt = max(8, min(1500, r.prompt // 64))
        out = max(1, min(300, r.output))
        if mine and rng.random() < 0.4:  # continue from one of our checkpoints
            ck, committed = rng.choice(mine)
            f = rng.randint(1, committed)
            seq = store.activate_from(ck, f, max(prompt, f), out)
            start = f
        else:
            seq = store.activate(prompt, out)
            start = 0
        target = max(prompt, start) + rng.randint(1, out)
        step = rng.choice([1, 16, 64, 200])
        frontier = start
        while frontier < target:
            nxt = min(target, frontier + step)
            store.ensure_mapped(seq, "main", nxt)
            with store.boundary():
                write_tokens(store, seq, frontier, nxt)
            store.commit(seq, "main", nxt)
            frontier = nxt
        ck = store.finish(seq, retain=True)
        assert ck is not None
        store.offload(ck, drop_device=rng.random() < 0.5)
        with store.boundary():
            pass  # D2H, checksum, flush, publish record, journal.sync()
        print(f"ACK {ck}", flush=True)
        mine.append((ck, target))
        while len(mine) > 6 or (mine and store.state.host.free_bytes < 8 << 20):  # type: ignore[union-attr]
            old, _ = mine.pop(0)
            print(f"REL {old}", flush=True)
            store.release(old)
            with store.boundary():
                pass


def soak(kills: int, trace: str, directory: str, seed: int = 0,
         log: bool = True) -> dict[str, int]:
    rng = random.Random(seed)
    acked: set[int] = set()
    released: set[int] = set()
    totals = {"kills": 0, "acknowledged": 0, "lost": 0, "corrupt_served": 0, "violations": 0}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in range(kills):
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child",
                                 directory, "--trace", trace, "--seed", str(seed * 100003 + k)],
                                stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        for line in [first, *rest.splitlines()]:
            kind, _, val = line.strip().partition(" ")
            if kind == "ACK" and val.isdigit():
                acked.add(int(val))
            elif kind == "REL" and val.isdigit():
                released.add(int(val))
        totals["kills"] += 1
        store = KVStore.open(config(directory))
        violations = store.violations()
        totals["violations"] += len(violations)
        for ck in sorted(acked - released):
            b = store.state.bundles.get(ck)
            if b is None or b.active:
                totals["lost"] += 1
                if log:
                    print(f"LOST {ck}: {store.recovery.dropped.get(ck, 'absent')}")
        for ck in store.checkpoints():
            if check_checkpoint(store, ck) is not None:
                totals["corrupt_served"] += 1
        store.close()
        if log and violations:
            print("VIOLATIONS", violations[:3])
    totals["acknowledged"] = len(acked)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.trace, a.seed)
        return
    directory = a.dir or tempfile.mkdtemp(prefix="ninfer-kv-soak-")
    t = soak(a.kills, a.trace, directory, a.seed)
    print(f"kills={t['kills']} acknowledged={t['acknowledged']} lost={t['lost']} "
          f"corrupt_served={t['corrupt_served']} violations={t['violations']}")


if __name__ == "__main__":
    main()
