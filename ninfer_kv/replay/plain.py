"""Plain replay (nothing runs between events): the decode rounds of a single-pool journal
applied straight from the segment's bytes by one compiled call a stretch of records
(``engine.record_kernels.apply_rounds``); every other record decoded and ``apply``-ed event by
event, as before. Same events, same order, same kernels, same refusals: the compiled call
stops before any record it does not take whole and before any event its kernel refuses or
that needs the arrays grown, and that record is decoded here and applied from that event on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.pool import PoolState
from ninfer_kv.engine.record_kernels import apply_rounds
from ninfer_kv.engine.state import StoreState
from ninfer_kv.errors import APPLY_ERRORS, UnappliableRecord
from ninfer_kv.journal.events import CODEC
from ninfer_kv.journal.format import FRAME_SIZE
from ninfer_kv.journal.reader import JournalReader


def apply_from(st: StoreState, events: list[Any], seq: int, first: int = 0) -> None:
    """``apply`` events ``first ..`` of record ``seq``; a failure is ``UnappliableRecord``
    naming the event."""
    done = first
    try:
        for e in events[first:]:
            apply(st, e)
            done += 1
    except APPLY_ERRORS as exc:
        raise UnappliableRecord(seq, done, type(events[done]).__name__, exc) from None


def _rounds(st: StoreState, buf: np.ndarray, lo: np.ndarray, hi: np.ndarray, r: int,
            r_end: int) -> tuple[int, int, int]:
    """``apply_rounds`` on the store's one pool: (the record it stopped at, the event of it
    to apply next, events applied). A store of several pools (or none yet) is left to the
    caller: (r, 0, 0)."""
    if len(st.pools) != 1:
        return r, 0, 0
    pool: PoolState = next(iter(st.pools.values()))
    fs, fp = pool.free_slots, pool.free_pages
    # ``not host_of``, read once for the stretch: no event it takes adds a host replica
    r, e, n, reused, taken, n_slots, new = apply_rounds(
        buf, lo, hi, r, r_end, np.frombuffer(pool.name.encode(), np.uint8), not pool.host_of,
        pool.n_slots, pool.logical_pages, pool.bundle_index, pool.sp_committed, pool.sp_nmem,
        pool.sp_members, pool.sp_active, fs.bits, fp.bits, pool.pg_live, pool.pg)
    fs.n -= reused  # what ``page_life.new_members`` does after each Materialize
    fp.n -= taken
    pool.n_slots = n_slots
    pool.reserved -= new
    return r, e, n


def replay_plain(reader: JournalReader, st: StoreState, start: int, until: int | None,
                 progress: Callable[[int, int], None] | None) -> tuple[int, int]:
    """Apply records ``start .. until`` (all when None) of ``reader``'s scan to ``st``;
    ``progress(seq, last)`` after each. Returns (records, events) applied."""
    n_records = n_events = 0
    last = reader.last_seq
    # the parser reads what ``CODEC`` writes: a reader given another codec decodes it all
    compiled = reader.codec is CODEC
    for seg in reader.scan.segments:
        rows = seg.frames.rows
        if not len(rows):
            continue
        first = int(rows[0, 2])  # seqs within a segment are consecutive
        r, r_end = max(start - first, 0), len(rows)
        if until is not None:
            r_end = min(r_end, until - first + 1)
        if r >= r_end:
            continue
        buf = np.frombuffer(seg.data, np.uint8)
        lo = rows[:, 0].astype(np.int64) + FRAME_SIZE
        hi = lo + rows[:, 1].astype(np.int64)
        view = memoryview(seg.data)
        while r < r_end:
            at, e, n = _rounds(st, buf, lo, hi, r, r_end) if compiled else (r, 0, 0)
            n_events += n
            n_records += at - r
            if at > r:
                st.seq = first + at - 1
                if progress is not None:
                    for seq in range(first + r, first + at):
                        progress(seq, last)
            r = at
            if r == r_end:
                break
            seq = first + r
            events = reader.decode(seq, int(rows[r, 0]), view[lo[r]:hi[r]])
            apply_from(st, events, seq, e)
            n_events += len(events) - e
            n_records += 1
            st.seq = seq
            if progress is not None:
                progress(seq, last)
            r += 1
    return n_records, n_events
