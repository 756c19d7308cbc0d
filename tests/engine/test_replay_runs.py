"""Runs of CommitFrontiers across records, the decode rounds of a journal: plain replay
(``apply_record``) and verified replay (event by event, with the checkers) reach the same
state, and a refused event is named by record and event. Written for a replay that applied
a run as one combined event; measured twice and not kept: commits alone, ~10% of plain
replay; commits, Materialize and ProvisionalFrontiers of one pool applied by one compiled
call over their concatenated fields (2026-12-03), no gain within the noise — gathering an
event costs what applying it does. The rules any such batching must keep: a run is one
pool's; each event's fields are checked on their own (a concatenation can pair off two wrong
lengths into a valid-looking event); it stops before an event its kernel refuses or that
needs the arrays grown."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ninfer_kv.engine.capacity import Backend
from ninfer_kv.engine.store import KVStore
from ninfer_kv.errors import JournalCorrupt, UnappliableRecord
from ninfer_kv.journal import events as ev
from ninfer_kv.journal.events import CODEC, pack
from ninfer_kv.journal.recovery import iter_frames, scan
from ninfer_kv.replay import replay
from tests.engine.conftest import small_config
from tests.engine.test_continuation import running, step

BACKENDS = [Backend.OFF, Backend.MTP]


def commit(seq: int, f: int, pool: str = "main") -> ev.CommitFrontiers:
    return ev.CommitFrontiers(pool, pack([seq]), pack([f]))


def journal_with(tmp_path: Path, records: list[list[object]], backend: Backend = Backend.MTP
                 ) -> tuple[str, list[int]]:
    """A store with running sequences 1 (100 tokens committed, 2 pages) and 2 (30 tokens,
    1 page), then ``records`` appended raw; returns the directory and the records' seqs.
    MTP: pools main and mtp; OFF: main alone, whose decode rounds plain replay applies in
    compiled stretches (replay/plain.py)."""
    s = KVStore.open(small_config(tmp_path, backend=backend))
    a, b = running(s, 100), running(s, 30)
    step(s)  # the commits are journaled at the boundary: before the raw records
    assert (a, b) == (1, 2) and s.journal is not None
    seqs = [s.journal.append(r, durable=True) for r in records]
    s.close()
    return str(tmp_path / "journal"), seqs


def test_runs_give_the_state_of_event_by_event(tmp_path: Path) -> None:
    """Commits of the same seq in consecutive records, and two in one record, then a
    commits of another pool between them (a run is one pool's): plain replay (runs) and
    verified replay (each event on its own) agree."""
    d, _ = journal_with(tmp_path, [[commit(1, 110)], [commit(2, 40), commit(1, 120)],
                                   [commit(1, 125), commit(1, 128)], [commit(2, 45)],
                                   [commit(2, 50)], [commit(2, 60, "mtp")],
                                   [commit(2, 64, "mtp")]])
    plain, checked = replay(d), replay(d, verify_every=1)
    assert plain.digest == checked.digest and not checked.violations
    assert plain.events == checked.events
    main, mtp = plain.state.pools["main"], plain.state.pools["mtp"]
    assert (main.spaces[1].committed, main.spaces[2].committed) == (128, 50)
    assert mtp.spaces[2].committed == 64


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refusal_in_a_run_names_its_record(tmp_path: Path, backend: Backend) -> None:
    """The third commit of a run moves a frontier backwards: the combined event is refused
    whole and the run replayed event by event names record and event."""
    d, seqs = journal_with(tmp_path, [[commit(1, 110)], [commit(2, 40)],
                                      [commit(2, 50), commit(1, 105)], [commit(1, 120)]],
                           backend)
    with pytest.raises(UnappliableRecord, match="CommitFrontiers") as got:
        replay(d)
    assert (got.value.seq, got.value.index) == (seqs[2], 1)
    with pytest.raises(UnappliableRecord) as checked:
        replay(d, verify_every=1)
    assert str(got.value) == str(checked.value)


PAIR_OFF = {
    "counts": [ev.CommitFrontiers("main", pack([1, 2]), pack([110])),
               ev.CommitFrontiers("main", pack([2]), pack([40, 50]))],
    "halves": [ev.CommitFrontiers("main", pack([1]) + b"\x02\x00", pack([110]) + b"\x28\x00"),
               ev.CommitFrontiers("main", b"\x00\x00", b"\x00\x00")],
}


@pytest.mark.parametrize("case", sorted(PAIR_OFF))
@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_that_pair_off_are_refused(tmp_path: Path, case: str, backend: Backend) -> None:
    """Fields of different int32 counts, or of a length no int32 count has, that pair off
    when concatenated: the run would apply (seq 1 to 110, seq 2 to 40 [then 50]). Each
    event is refused on its own, and so is the run."""
    d, seqs = journal_with(tmp_path, [[e] for e in PAIR_OFF[case]], backend)
    with pytest.raises(UnappliableRecord, match="bytes of seqs") as got:
        replay(d)
    assert (got.value.seq, got.value.index) == (seqs[0], 0)


def test_a_materialize_that_needs_room_mid_run(tmp_path: Path) -> None:
    """Memberships start 16 pages wide and grow when a Materialize needs more
    (``PoolState.ensure_members``), which a compiled run could not do: between decode
    rounds, one sequence crosses into its 17th page. Plain and verified replay reach the
    live digest."""
    s = KVStore.open(small_config(tmp_path))
    a, b = running(s, 1000), running(s, 900)
    front = np.array([1000, 900])
    for _ in range(40):  # a's 17th page (token 1025) needs a 17-wide membership
        front += 1
        s.ensure_mapped_many("main", [a, b], front)
        with s.boundary():
            pass
        s.commit_many("main", [a, b], front)
    step(s)
    assert s.state.pools["main"].sp_members.shape[1] > 16  # it grew
    live = s.digest()
    s.close()
    d = str(tmp_path / "journal")
    assert replay(d).digest == live == replay(d, verify_every=1).digest


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_materialize_between_commits_names_its_record(tmp_path: Path,
                                                               backend: Backend) -> None:
    """A Materialize into slot 0, which seq 1's first page holds, between commits: refused
    (the slot is not free), named by record and event; the commits before it applied."""
    d, seqs = journal_with(tmp_path, [[commit(1, 110)],
                                      [commit(2, 40), ev.Materialize("main", pack([1]),
                                                                     pack([0]), pack([0]))],
                                      [commit(1, 120)]], backend)
    with pytest.raises(UnappliableRecord, match="Materialize") as got:
        replay(d)
    assert (got.value.seq, got.value.index) == (seqs[1], 1)
    with pytest.raises(UnappliableRecord) as checked:
        replay(d, verify_every=1)
    assert str(got.value) == str(checked.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_progress_is_reported_for_every_record(tmp_path: Path, backend: Backend) -> None:
    """Plain replay reports each record once, in order, as verified replay does."""
    d, seqs = journal_with(tmp_path, [[commit(1, 110)], [commit(2, 40)], [commit(1, 120)]],
                           backend)
    plain: list[int] = []
    checked: list[int] = []
    a = replay(d, progress=lambda seq, last: plain.append(seq))
    b = replay(d, progress=lambda seq, last: checked.append(seq), verify_every=1)
    assert plain == checked and plain[-3:] == seqs and a.digest == b.digest


def test_recovery_names_the_record_it_cannot_apply(tmp_path: Path) -> None:
    """Three records of commits, the second's refused (a frontier moved back): the reopen
    names that record (not a later one a batching apply may have read), at its offset in its
    segment."""
    d, seqs = journal_with(tmp_path, [[commit(1, 110)], [commit(1, 105)], [commit(1, 120)]])
    with pytest.raises(JournalCorrupt, match=f"record {seqs[1]} is well-formed but cannot be "
                                             "applied") as got:
        KVStore.open(small_config(tmp_path, backend=Backend.MTP))
    res = scan(d, schema_major=CODEC.schema[0], repair=False)
    offsets = {seq: off for seq, off, _ in iter_frames(res)}
    assert (got.value.segment, got.value.offset) == (res.segment_of(seqs[1]), offsets[seqs[1]])
