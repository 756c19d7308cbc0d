"""The device effects a record's events ask for, run after the record is journaled and before
its tables are published (spec §13): H2D restores (``DeviceRestore``) and partial-tail COW
copies (``CopyTail``, §9.3), in emission order — a copy may read a page a restore of the same
record wrote, and a Fork's fresh tail page may be the source of a ``fork_live`` right after it.

Copies run in batches, one kernel call per plane for each (``DeviceState.copy_tails``): a
batch is a run of consecutive copies of one pool that do not depend on each other. A copy
that reads or writes a page an earlier copy of the run writes, or writes a page one of them
reads, starts a new batch, so every copy sees exactly what the ones before it left (the
order the boundary ran them in one at a time, which the leader and its followers share).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ninfer_kv.engine import host
from ninfer_kv.journal import events as ev

if TYPE_CHECKING:
    from ninfer_kv.engine.txn import Txn


def batches(effects: Sequence[Any]) -> Iterator[ev.DeviceRestore | list[ev.CopyTail]]:
    """``effects`` in order: each ``DeviceRestore`` alone, the ``CopyTail`` events grouped
    into runs of one pool whose pages are independent (module docstring)."""
    batch: list[ev.CopyTail] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for e in effects:
        if type(e) is ev.CopyTail:
            if batch and (e.pool != batch[0].pool or e.src_page in writes or e.page in writes
                          or e.page in reads):
                yield batch
                batch, reads, writes = [], set(), set()
            batch.append(e)
            reads.add(e.src_page)
            writes.add(e.page)
            continue
        assert type(e) is ev.DeviceRestore, f"a device effect {type(e).__name__}"
        if batch:
            yield batch
            batch, reads, writes = [], set(), set()
        yield e
    if batch:
        yield batch


def run(store: Txn, effects: Sequence[Any]) -> None:
    """Run ``effects`` (``batches`` of them) on ``store``'s device."""
    device = store.device
    for b in batches(effects):
        if isinstance(b, list):
            if device.pools[b[0].pool].planes:
                device.copy_tails(b[0].pool, [e.src_page for e in b], [e.page for e in b],
                                  [e.columns for e in b])
        else:
            host.restore_pages(store, [b])
