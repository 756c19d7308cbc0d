"""Replay and diff. See the package docstring."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ninfer_kv.engine.apply import apply
from ninfer_kv.engine.incremental import IncrementalChecker
from ninfer_kv.engine.invariants import load_snapshot, violations
from ninfer_kv.engine.state import StoreState, digest, to_snapshot
from ninfer_kv.errors import (
    APPLY_ERRORS,
    InvalidArgument,
    JournalCorrupt,
    JournalError,
    UnappliableRecord,
)
from ninfer_kv.journal.reader import JournalReader
from ninfer_kv.journal.recovery import iter_frames
from ninfer_kv.journal.restore import usable_snapshots
from ninfer_kv.replay.plain import replay_plain


@dataclass(frozen=True, slots=True)
class Violation:
    seq: int
    index: int
    event: str
    problems: list[str]
    check: str = "full"
    """Which checker found it: ``full`` (``violations()``) or ``incremental``."""


@dataclass(slots=True)
class ReplayResult:
    state: StoreState
    records: int
    events: int
    digest: str
    seconds: float
    violations: list[Violation] = field(default_factory=list)
    cuts: list[str] = field(default_factory=list)
    """Where the journal's valid prefix ended early (a torn tail: the history replayed is the
    part before it; ``JournalReader`` only reads, so the files keep their bytes)."""

    @property
    def events_per_s(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")




@contextlib.contextmanager
def applying(seq: int, index: int, event: Any) -> Iterator[None]:
    """Turn a failure to apply (or to read the state around) one journaled event into
    ``UnappliableRecord`` naming the record."""
    try:
        yield
    except APPLY_ERRORS as exc:
        raise UnappliableRecord(seq, index, type(event).__name__, exc) from None


def apply_event(st: StoreState, event: Any, seq: int, index: int) -> None:
    """``apply`` one journaled event; a failure is ``UnappliableRecord`` naming the record
    (``applying`` without a context manager per event: replay's hot loop)."""
    try:
        apply(st, event)
    except APPLY_ERRORS as exc:
        raise UnappliableRecord(seq, index, type(event).__name__, exc) from None


def replay_start(reader: JournalReader, until: int | None = None) -> tuple[StoreState, int]:
    """(state, first record to apply). From the empty state when the log starts at record 1;
    when it does not (compacted, or its first segment is gone), from the oldest snapshot on
    the log's CRC chain (``usable_snapshots``) — replay then checks every record after it.
    Raises ``JournalCorrupt`` when no snapshot covers the missing records, and
    ``InvalidArgument`` when ``until`` lies before the first state the journal can show."""
    res = reader.scan
    if res.first_seq == 1:
        return StoreState(), 1
    why: list[str] = []
    # from the reader's view (reader.fs), never the directory: a live writer may have pruned
    # the snapshots the scan's log relies on since
    for cand in reversed(list(usable_snapshots(reader.directory, res, reader.codec.schema[0],
                                               reader.fs))):
        if isinstance(cand, str):
            why.append(cand)
            continue
        if until is not None and cand.seq > until:  # the caller's request, not damage
            raise InvalidArgument(f"record {until} lies before the oldest state this journal "
                                  f"still holds (snapshot at {cand.seq}; the log read starts "
                                  f"at {res.first_seq})")
        try:
            st = load_snapshot(cand.payload)
        except Exception as exc:  # a payload that does not decode, or breaks §14: untrusted
            why.append(f"snapshot {cand.seq}: payload refused: {exc!r}")
            continue
        return st, cand.seq + 1
    raise JournalCorrupt(res.segments[0].number if res.segments else 0, 0,
                         f"the log starts at seq {res.first_seq} (compacted, or its first "
                         "segment is gone) and no usable snapshot covers the records before it"
                         + (f" ({'; '.join(why)})" if why else ""))


def replay(directory: str | JournalReader, *, verify_every: int = 0, until_record: int | None = None,
           until_event: int | None = None, salvage: bool = False,
           progress: Callable[[int, int], None] | None = None,
           on_event: Callable[[StoreState, int, int, Any], None] | None = None,
           full_every: int | None = None, incremental: bool = True) -> ReplayResult:
    """Apply every event from the start (no snapshot: replay checks the whole history).

    ``verify_every``: 0 = check the invariants only at the end. N > 0 = verify while replaying:
    the incremental checker (``engine.incremental``, O(what the event touched)) after *every*
    event, plus the full ``violations()`` as a cross-check every ``full_every`` events
    (default: N when N > 1, else 10,000) and at the end. ``incremental=False``: the full check
    alone every N events (the old, O(state) per check behaviour).
    ``until_record``: stop after that record; ``until_event``: stop after that many events.
    ``directory`` may be a ``JournalReader`` already open (its scan is used, and its own
    ``salvage`` setting: a caller that needs the journal's length first scans it once).
    """
    if isinstance(directory, JournalReader):
        if salvage and not directory.salvage:
            raise JournalError("replay(salvage=True) of a reader opened without salvage")
        reader = directory
    else:
        reader = JournalReader(directory, salvage=salvage)
    st, start = replay_start(reader, until_record)
    found: list[Violation] = []
    checker: IncrementalChecker | None = None
    if verify_every and incremental:
        checker = IncrementalChecker(st)  # one full check of the starting state
        if checker.initial:
            found.append(Violation(start - 1, -1, "start", checker.initial))
        full_every = full_every or (verify_every if verify_every > 1 else 10_000)
    else:
        full_every = verify_every
    n_events = n_records = 0
    t0 = time.perf_counter()
    last = reader.last_seq
    done = False
    if not (on_event or checker or full_every or until_event is not None):
        # nothing to do between events: decode rounds in compiled stretches (replay/plain.py)
        n_records, n_events = replay_plain(reader, st, start, until_record, progress)
    else:
        for seq, off, payload in iter_frames(reader.scan, start):
            if until_record is not None and seq > until_record:
                break  # before decoding: the record after the last asked for is not read
            events = reader.decode(seq, off, payload)
            for i, e in enumerate(events):
                apply_event(st, e, seq, i)
                n_events += 1
                if on_event is not None:
                    on_event(st, seq, i, e)
                if checker is not None:
                    v = checker.check(e)
                    if v:
                        found.append(Violation(seq, i, type(e).__name__, v, "incremental"))
                if full_every and n_events % full_every == 0:
                    v = violations(st)
                    if v:
                        found.append(Violation(seq, i, type(e).__name__, v))
                if until_event is not None and n_events >= until_event:
                    done = True
                    break
            st.seq = seq
            n_records += 1
            if progress is not None:
                progress(seq, last)
            if done:
                break
    if not full_every or n_events % full_every:
        v = violations(st)
        if v:
            found.append(Violation(st.seq, -1, "end", v))
    cuts = [str(c) for c in reader.scan.cuts]
    return ReplayResult(st, n_records, n_events, digest(st), time.perf_counter() - t0, found,
                        cuts)


@dataclass(slots=True)
class DiffResult:
    record: int | None
    """First record whose resulting state differs (None: identical over the common length)."""
    left_records: int
    right_records: int
    differences: list[str] = field(default_factory=list)


def diff(left: str, right: str) -> DiffResult:
    """Replay two journals side by side; report the first record after which states differ."""
    a, b = JournalReader(left), JournalReader(right)
    (sa, fa), (sb, fb) = replay_start(a), replay_start(b)
    if fa != fb:
        raise JournalError(f"cannot diff: {left} starts at record {fa}, {right} at {fb}")
    for (qa, ea), (qb, eb) in zip(a.records(fa), b.records(fb), strict=False):
        for i, e in enumerate(ea):
            apply_event(sa, e, qa, i)
        for i, e in enumerate(eb):
            apply_event(sb, e, qb, i)
        if ea != eb:  # the first divergent record, and the state difference it causes
            diffs = state_differences(sa, sb) or ["events differ; the states they lead to agree"]
            return DiffResult(qa, a.last_seq, b.last_seq, diffs)
    res = DiffResult(None, a.last_seq, b.last_seq)
    if a.last_seq != b.last_seq:
        res.record = min(a.last_seq, b.last_seq) + 1
        res.differences = [f"journal lengths differ: {a.last_seq} vs {b.last_seq} records"]
    return res


def state_differences(a: StoreState, b: StoreState, limit: int = 20) -> list[str]:
    """Readable differences between two states (pools, pages, spaces, bundles)."""
    sa, sb = to_snapshot(a, with_seq=False), to_snapshot(b, with_seq=False)
    out: list[str] = []
    for pa, pb in zip(sa.pools, sb.pools, strict=False):
        for name in ("reserved", "free_pages", "free_rows", "gens"):
            if getattr(pa, name) != getattr(pb, name):
                out.append(f"pool {pa.name}: {name} differs")
        pages_a = {t[0]: t for t in pa.pages}
        pages_b = {t[0]: t for t in pb.pages}
        for slot in sorted(set(pages_a) | set(pages_b)):
            if pages_a.get(slot) != pages_b.get(slot):
                out.append(f"pool {pa.name} page {slot}: {pages_a.get(slot)} vs "
                           f"{pages_b.get(slot)}")
        spaces_a = {t[0]: t for t in pa.spaces}
        spaces_b = {t[0]: t for t in pb.spaces}
        for bid in sorted(set(spaces_a) | set(spaces_b)):
            if spaces_a.get(bid) != spaces_b.get(bid):
                out.append(f"pool {pa.name} seq {bid}: {spaces_a.get(bid)} vs {spaces_b.get(bid)}")
    if sa.bundles != sb.bundles:
        out.append("bundles differ")
    return out[:limit]
