"""What a follower does besides ``apply`` to stay the leader's replica on its own shard:
publish its block-table rows (§7.2, §13) and, in checked mode, forget the written positions
its leader's commands forgot."""

from __future__ import annotations

from typing import Any

import numpy as np

from ninfer_kv.engine import checked
from ninfer_kv.engine.layout import P
from ninfer_kv.engine.store import KVStore
from ninfer_kv.journal import events as ev


def forget_written(store: KVStore, events: list[Any]) -> None:
    """Checked mode: drop the written positions the leader's commands dropped (a commit: the
    positions below; a finish, a trim, a truncate: those above must be written again), or
    they pile up forever. Nothing to do when nothing is recorded (not checked mode)."""
    if not store._written:
        return
    for e in events:
        if isinstance(e, ev.CommitFrontiers):
            checked.forget_committed(store, e.pool, ev.unpack(e.bundles).tolist(),
                                     ev.unpack(e.frontiers).tolist())
        elif isinstance(e, ev.Finish):
            checked.forget(store, e.pool, e.bundle)
        elif isinstance(e, ev.Trim):
            checked.forget(store, e.pool, e.bundle, e.keep * P)
        elif isinstance(e, ev.Truncate):
            checked.forget(store, e.pool, e.bundle, e.frontier)


def sync_tables(store: KVStore) -> int:
    """Publish every active row's membership (§7.2, §13): write each row from its first entry
    that differs and unmap what an earlier write mapped after it — the slice the leader wrote
    for its touched rows, so both tables are equal entry for entry — and unmap every row no
    sequence holds (the leader's boundary unmaps the rows a finish left). Returns rows
    written."""
    written = 0
    for name, pool in store.state.pools.items():
        pd = store.device.pools[name]
        for r in np.flatnonzero(pd.published).tolist():
            if r not in pool.row_owner:
                store.device.write_table(name, r, 0, ())
                written += 1
        pages = pool.pages
        for sp in pool.spaces.values():
            if not sp.active:
                continue
            n = sp.nmem
            want = np.fromiter((pages[s].device for s in sp.members),  # type: ignore[union-attr]
                               np.int32, n)
            diff = np.flatnonzero(pd.host_tables[sp.row, :n] != want)
            start = int(diff[0]) if diff.size else n
            if start == n and int(pd.published[sp.row]) == n:
                continue
            store.device.write_table(name, sp.row, start, want[start:])
            written += 1
    return written
