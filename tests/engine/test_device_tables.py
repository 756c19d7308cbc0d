"""The block tables a device (not the CPU) reads: every boundary copies each changed slice of
the host image into them (``DeviceState.write_rows`` / ``write_table``, §13).

No GPU here: the store's device is declared a non-CPU one and the block tables made a separate
tensor, so the copy branch runs exactly as on a GPU (``copy_`` of the changed slices) and
the tables it produces can be compared with the host image after every boundary."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ninfer_kv.engine.store import KVStore
from tests.engine.conftest import small_config


def separate_device_tables(s: KVStore) -> None:
    """Make ``s`` publish as to a device: own table tensors, a non-CPU device type."""
    s.device.device = torch.device("cuda")
    s.device.on_cpu = False  # what the publishing path reads
    for pd in s.device.pools.values():
        pd.block_tables = torch.from_numpy(pd.host_tables.copy())


def device_tables_match(s: KVStore) -> None:
    for name, pd in s.device.pools.items():
        got = pd.block_tables.numpy()
        bad = np.flatnonzero((got != pd.host_tables).any(axis=1))
        assert not len(bad), (name, bad.tolist(), got[bad[0]].tolist(),
                              pd.host_tables[bad[0]].tolist())


@pytest.mark.parametrize("seed", range(6))
def test_device_tables_follow_every_boundary(tmp_path: Path, seed: int) -> None:
    """A random walk of activations, Forks, mapping, decode rounds, truncations and finishes:
    after each boundary the device tables equal the host image (a slice the copy missed,
    or one copied before it was written, shows as a differing row)."""
    rng = random.Random(seed)
    s = KVStore.open(small_config(tmp_path, pages=96, concurrency=4, allocate_planes=False))
    separate_device_tables(s)
    live: dict[int, int] = {}   # seq -> committed tokens
    cks: list[int] = []
    for _ in range(60):
        op = rng.random()
        if len(live) < 3 and op < 0.3:
            if cks and rng.random() < 0.5:
                ck = rng.choice(cks)
                f = rng.randrange(0, s.space(ck, "main").committed + 1)
                b = s.activate_from(ck, f, max(f, 1), 200)
                live[b] = f
            else:
                b = s.activate(rng.randrange(1, 300), 200)
                live[b] = 0
        elif live and op < 0.5:
            b = rng.choice(list(live))
            if rng.random() < 0.5 and live[b] > 0:
                to = rng.randrange(0, live[b])
                s.truncate(b, "main", to)
                live[b] = to
            else:
                ck = s.finish(b, retain=rng.random() < 0.5)
                del live[b]
                if ck is not None:
                    cks.append(ck)
        elif live:
            seqs = list(live)
            nxt = [min(live[b] + rng.choice((1, 1, 70)), s.space(b, "main").entitlement * 64)
                   for b in seqs]
            s.ensure_mapped_many("main", seqs, nxt)
            with s.boundary():
                pass
            s.commit_many("main", seqs, nxt)
            live.update(zip(seqs, nxt, strict=True))
        with s.boundary():
            pass
        device_tables_match(s)
    s.check_invariants()
    s.close()


def test_a_batched_map_keeps_the_earlier_touches_of_its_interval(tmp_path: Path) -> None:
    """Two continuations of one checkpoint, then one batched map of both, in one interval:
    each row must be published from block 0 (the shared pages the continuation mapped), not
    from the batched map's first new block — the batch merges into what the interval touched
    (``_touch_many`` keeps the lower block of each sequence)."""
    s = KVStore.open(small_config(tmp_path, pages=32, concurrency=4, allocate_planes=False))
    separate_device_tables(s)
    src = s.activate(3 * 64, 200)
    s.ensure_mapped(src, "main", 3 * 64)
    with s.boundary():
        pass
    s.commit(src, "main", 3 * 64)
    ck = s.finish(src, retain=True)
    assert ck is not None
    kids = [s.activate_from(ck, 3 * 64, 3 * 64, 200) for _ in range(2)]
    s.ensure_mapped_many("main", kids, [3 * 64 + 65] * 2)  # two new pages each, same interval
    with s.boundary():
        pass
    device_tables_match(s)
    p, pd = s.state.pools["main"], s.device.pools["main"]
    for b in kids:
        sp = p.spaces[b]
        members = np.asarray(sp.members, np.int64)
        assert len(members) == 5
        assert pd.host_tables[sp.row, :5].tolist() == p.pg_device[members].tolist(), b
    s.check_invariants()
    s.close()
